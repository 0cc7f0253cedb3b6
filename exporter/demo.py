"""The default model of ``python -m exporter.export`` when no model_dir is given.

A small Llama trained for a minute on Python standard-library source, with a Medusa drafter
trained on it (:mod:`exporter.demo_model`; nothing is downloaded). The command can be run again:
the second run reuses the demo model (and says so) and replaces its own earlier export.
"""

from __future__ import annotations

from pathlib import Path

from exporter.errors import UserError
from graphs.manifest import MANIFEST


def default_paths() -> tuple[Path, Path]:
    """(model_dir, out_dir) of the demo, relative to the working directory."""
    return Path("spec-demo-tiny/model"), Path("spec-demo-tiny/onnx")


def build_demo_model(model_dir, mode: str = "medusa") -> Path:
    from exporter.demo_model import build_demo_model as build

    return build(Path(model_dir), mode=mode)


def prepare_demo(model_dir: Path, out_dir: Path, log=print) -> bool:
    """Build the demo model unless it is there; returns whether ``out_dir`` may be replaced.

    ``out_dir`` is replaced only when it is absent or holds an export (a ``manifest.json``): the
    earlier run's. Anything else there is left alone and export refuses it as usual.
    """
    if (model_dir / "config.json").is_file():
        log(f"no model_dir given: reusing the demo model in {model_dir} (delete it to build it again)", flush=True)
    else:
        if model_dir.exists() and {p.name for p in model_dir.iterdir()} - {"_trainer"}:  # (an interrupted build)
            raise UserError(f"{model_dir} exists but holds no demo model (no config.json); move it away or "
                            f"pass a model_dir")
        log(f"no model_dir given: building the demo model in {model_dir}", flush=True)
        build_demo_model(model_dir)
    replace = (out_dir / MANIFEST).is_file()
    if replace:
        log(f"replacing the earlier demo export in {out_dir}", flush=True)
    return replace
