"""Train a Medusa / EAGLE-1 / EAGLE-3 drafter with a plain HF ``Trainer`` and save a ``model_dir``.

Default: build the demo model (a tiny Llama pretrained on the Python standard library's sources,
~2-4 minutes on 2 CPU cores), self-distill, train the drafter, save::

    python -m samples.train_drafter --out demo_medusa --mode medusa
    python -m samples.train_drafter --out demo_eagle3 --mode eagle3 --data text

With ``--base DIR`` (a saved HF causal LM with a ``tokenizer.json``), skip the pretraining and train
a drafter for that model on self-distilled standard-library text instead.
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


class _DefaultsUnlessUnset(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None (the help says what "unset" means) and required options."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)

def train_for_base(base_dir, out_dir, mode: str, spec: DemoSpec, data: str = "distill", seed: int = 0,
                   log=print) -> Path:
    """Attach and train a ``mode`` drafter for an existing base model saved in ``base_dir``."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from exporter import demo_model as dm
    from exporter.speculative import convert
    from exporter.speculative.checkpoint import huggingface_checkpointing_disabled

    clock = Clock(log)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    with huggingface_checkpointing_disabled():  # the base alone, even if base_dir carries a drafter
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    clock(f"loaded {base_dir}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")
    stream = dm.encode_corpus(tok, dm.read_corpus(spec.corpus_bytes))
    examples = dm.drafter_examples(model, stream, spec, data, seed, clock)
    kind, cfg = MODES[mode]
    convert(model, [(kind, dict(cfg))])
    held = examples[: max(1, len(examples) // 8)]
    dm.train_drafter(model, examples[len(held) :] or examples, spec, out_dir / "_trainer", seed, clock)
    acc = dm.drafter_accuracy(model, held)
    clock(f"drafter on held-out examples: {acc}")
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base_dir / name).is_file() and not (out_dir / name).is_file():
            (out_dir / name).write_bytes((base_dir / name).read_bytes())
    dm._rmtree(out_dir / "_trainer")
    clock(f"saved {out_dir}")
    return out_dir


def main(argv=None) -> Path:
    defaults = DemoSpec()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_DefaultsUnlessUnset
    )
    p.add_argument("--out", required=True, type=Path, help="output model_dir")
    p.add_argument("--mode", choices=sorted(MODES), default="medusa", help="the drafter to train")
    p.add_argument("--data", choices=["distill", "text"], default="distill",
                   help="drafter training text: the base's own greedy continuations, or the corpus itself")
    p.add_argument("--base", type=Path, help="an existing HF model dir (with tokenizer.json); unset: train the "
                   "demo base too")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and initialisation")
    p.add_argument("--seconds-budget", type=float, default=None,
                   help="stop training early past this many seconds (gives up determinism)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (unset: torch's choice)")
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
    if args.base is not None:
        return train_for_base(args.base, args.out, args.mode, spec, data=args.data, seed=args.seed)
    return build_demo_model(args.out, mode=args.mode, seconds_budget=args.seconds_budget, seed=args.seed,
                            spec=spec, data=args.data)


if __name__ == "__main__":
    main()
