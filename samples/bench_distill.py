"""Self-distillation speed: HF ``generate`` (padded batches) vs this project's engine (continuous batching).

    python samples/bench_distill.py MODEL_DIR BASE_EXPORT --prompts 32 --max-new-tokens 96 --json runs/distill.json

MODEL_DIR: the HF base (a .gguf works too); BASE_EXPORT: its export (``python -m exporter.export
MODEL_DIR BASE_EXPORT``). Both decode the same chat prompts greedily, ``--rounds`` times, alternating
which goes first; the report gives each one's answer tokens/s and whether their answers agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from exporter import mainjob
    from exporter.hub import resolve_model
    from exporter.speculative import self_distill
    from exporter.speculative.training import TrainingConfig, distill

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("base_export")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16, help="HF's batch size and the engine's rows")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model_dir)
    prompts = mainjob.chat_prompt_ids(model_dir, mainjob.interleaved_training_prompts()[: args.prompts])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = TrainingConfig(max_new_tokens=args.max_new_tokens, distill_rows=args.batch, seconds_budget=None,
                         threads=args.threads)
    rows = {"hf_generate": [], "engine": []}
    answers = {}

    def hf():
        ex = self_distill(model, None, [p for _, p in prompts], args.max_new_tokens, batch_size=args.batch)
        return [e["input_ids"][len(p):] for e, (_, p) in zip(ex, prompts)]

    def engine():
        return [e.answer for e in distill(args.base_export, prompts, cfg, log=lambda s: None)]

    for r in range(args.rounds):
        order = [("hf_generate", hf), ("engine", engine)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            n = sum(len(a) for a in out)
            rows[name].append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt})
            answers[name] = out
            print(f"round {r + 1} {name}: {n} tokens in {dt:.1f} s, {n / dt:.1f} tok/s", flush=True)
    best = {k: max(x["tokens_per_s"] for x in v) for k, v in rows.items()}
    same = sum(a == b for a, b in zip(answers["hf_generate"], answers["engine"]))
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch": args.batch,
              "threads": args.threads, "runs": rows, "best_tokens_per_s": best,
              "engine_over_hf": best["engine"] / best["hf_generate"], "answers_equal": f"{same}/{len(prompts)}"}
    print(f"engine / HF generate: {report['engine_over_hf']:.2f}x; answers equal on {report['answers_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
