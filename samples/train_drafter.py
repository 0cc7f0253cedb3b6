"""Train a Medusa / EAGLE-1 / EAGLE-3 / DFlash drafter with a plain HF ``Trainer`` and save a ``model_dir``.

Default: build the demo model (a tiny Llama pretrained on the Python standard library's sources,
~2-4 minutes on 2 CPU cores), self-distill, train the drafter, save::

    python -m samples.train_drafter --out demo_medusa --mode medusa
    python -m samples.train_drafter --out demo_eagle3 --mode eagle3 --data text

With ``--base DIR`` (a saved HF causal LM with a ``tokenizer.json``, or a ``.gguf``), skip the
pretraining and train a drafter for that model the scalable way (``exporter.speculative.training``):
the base's own answers to the project's chat prompts (standard-library text for a base without a chat
template) decoded by our engine, its features cached once, a seconds budget over the whole run::

    python samples/train_drafter.py --out smol-eagle3 --mode eagle3 --base model.gguf --budget-s 360
    python samples/train_drafter.py --out smol-dflash --mode dflash --base model.gguf --budget-s 360

DFlash (``--mode dflash``) trains for an existing base only (``--base``).
The output loads with ``AutoModelForCausalLM.from_pretrained`` after
``exporter.speculative.enable_huggingface_checkpointing()``, and is what the exporter takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: python samples/train_drafter.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.demo_model import MODES, Clock, DemoSpec, build_demo_model
from exporter.speculative.training import MODES as SCALABLE_MODES


class _DefaultsUnlessUnset(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None (the help says what "unset" means) and required options."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)

def train_for_base(base_dir, out_dir, mode: str, spec: DemoSpec, data: str = "distill", seed: int = 0,
                   budget_s: float | None = None, distilled=None, log=print) -> Path:
    """Attach and train a ``mode`` drafter for an existing base (a model directory or a .gguf).

    The scalable path (:mod:`exporter.speculative.training`): an autoregressive export of the base
    distills (chat prompts where the base has a chat template, else standard-library windows), the
    frozen base's features are cached once, the drafter trains on the cache within ``budget_s``."""
    from exporter import mainjob, pipeline
    from exporter.hub import resolve_model
    from exporter.speculative.training import Example, TrainingConfig
    from graphs.manifest import MANIFEST

    clock = Clock(log)
    base_dir, out_dir = resolve_model(base_dir), Path(out_dir)
    cfg = TrainingConfig(mode=mode, max_new_tokens=spec.distill_new_tokens, seconds_budget=budget_s, seed=seed,
                         batch_size=spec.drafter_batch, learning_rate=spec.drafter_lr,
                         epochs=max(1.0, spec.drafter_steps * spec.drafter_batch / max(spec.distill_prompts, 1)))
    ar = out_dir.with_name(f".{out_dir.name}.base-ar")
    if not (ar / MANIFEST).is_file():
        pipeline.export(base_dir, ar, overwrite=ar.exists(), log=lambda *a, **k: clock(" ".join(map(str, a))))
    examples = prompts = None
    from graphs.chat import ChatTemplate

    if ChatTemplate.from_export(base_dir) is not None:
        prompts = mainjob.chat_prompt_ids(base_dir, mainjob.interleaved_training_prompts())[: spec.distill_prompts]
    else:
        from tokenizers import Tokenizer

        from exporter import demo_model as dm

        tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
        stream = dm.encode_corpus(tok, dm.read_corpus(spec.corpus_bytes))
        g = torch.Generator().manual_seed(seed + 1)
        if data == "text":
            rows = dm.windows(stream, spec.distill_prompts, spec.seq_len, g).tolist()
            examples = [Example([], r, "python") for r in rows]
        else:
            rows = dm.windows(stream, spec.distill_prompts, spec.prompt_len, g).tolist()
            prompts = [("python", r) for r in rows]
    report = mainjob.train_drafter_for(base_dir, ar, out_dir, cfg, clock, prompts=prompts, examples=examples,
                                       distilled=distilled)
    clock(f"saved {out_dir} (held-out acceptance: {report['heldout_acceptance'].get('all')})")
    return out_dir


def main(argv=None) -> Path:
    defaults = DemoSpec()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_DefaultsUnlessUnset
    )
    p.add_argument("--out", required=True, type=Path, help="output model_dir")
    p.add_argument("--mode", choices=sorted(set(MODES) | set(SCALABLE_MODES)), default="medusa",
                   help="the drafter to train (dflash: with --base)")
    p.add_argument("--data", choices=["distill", "text"], default="distill",
                   help="drafter training text: the base's own greedy continuations, or the corpus itself")
    p.add_argument("--base", type=Path, help="an existing HF model dir (with tokenizer.json); unset: train the "
                   "demo base too")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and initialisation")
    p.add_argument("--seconds-budget", "--budget-s", type=float, default=None,
                   help="stop early past this many seconds (gives up determinism); with --base it bounds "
                        "distillation + features + training")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (unset: torch's choice)")
    p.add_argument("--distilled", type=Path, default=None,
                   help="with --base: keep the distilled answers in this JSON file, and reuse it if it exists "
                        "(e.g. the main job's spec-demo/distilled.json; default: not kept)")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tests)")
    for f in dataclasses.fields(DemoSpec):  # --base-steps, --drafter-steps, --hidden-size, ...
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)), default=None,
                       help=f"the demo spec's {f.name} (unset: {getattr(defaults, f.name)!r}; --tiny: "
                            f"{getattr(DemoSpec.tiny(), f.name)!r})")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = DemoSpec.tiny() if args.tiny else defaults
    names = [f.name for f in dataclasses.fields(DemoSpec)]
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    spec = dataclasses.replace(spec, **overrides)
    if args.mode not in MODES and args.base is None:
        p.error(f"--mode {args.mode} trains for an existing base: pass --base DIR (a model directory or a .gguf)")
    if args.base is not None:
        return train_for_base(args.base, args.out, args.mode, spec, data=args.data, seed=args.seed,
                              budget_s=args.seconds_budget, distilled=args.distilled)
    return build_demo_model(args.out, mode=args.mode, seconds_budget=args.seconds_budget, seed=args.seed,
                            spec=spec, data=args.data)


if __name__ == "__main__":
    main()
