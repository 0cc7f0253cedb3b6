"""The default model of ``python -m exporter.export`` when no model_dir is given.

A small Llama trained for a minute on Python standard-library source, with a Medusa drafter
trained on it (``samples/demo_model.py``; nothing is downloaded). Run from the repository root.
"""

from __future__ import annotations

from pathlib import Path

from exporter.loading import UserError


def build_demo_model(model_dir, mode: str = "medusa") -> Path:
    try:
        from samples.demo_model import build_demo_model as build
    except ImportError:
        raise UserError(
            "the demo model builder lives in samples/ of the source checkout: run from the repository "
            "root, or pass a model_dir"
        ) from None
    return build(Path(model_dir), mode=mode)
