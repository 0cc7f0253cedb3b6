"""Tune the draft tree for the machine at hand and record it as the export's default.

    python -m exporter.tune out_dir [--prompts FILE] [--provider cpu] [--threads N] [--budget-s 300]
                                    [--model-dir DIR] [--json report.json]

Measures the verify cost against tree size and the drafter's acceptance on calibration prompts,
predicts tokens/s for every candidate tree, confirms the winner with a measured run and writes it
into ``manifest.json`` as the default tree (``tree["tuned"]``), through the writer: the manifest is
rehashed and swapped in atomically. EAGLE with ``--model-dir``: a new winning tree is baked as a
one-call graph first (traced, checked against PyTorch). DFlash: the chain and trees of the block's
per-slot top-k (1..4) compete, every size of each scored from one run (``tree.dflash``).

A thin command line over :func:`exporter.pipeline.tune_export` (the measurements: :mod:`exporter.tuning`).
Greedy output is the same whatever tree is chosen; only speed changes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from exporter.pipeline import tune_export as tune
from exporter.prompts import read_prompt_texts

__all__ = ["main", "tune"]


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory (holds manifest.json)")
    ap.add_argument("--prompts", help="calibration prompts: a text file (one per line) or a JSON list "
                                      "(default: the built-in set)")
    ap.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto",
                    help="ONNX Runtime provider to tune for (auto: CUDA when onnxruntime-gpu sees a GPU, as generate)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="time for the EAGLE (topk, depth) or DFlash topk sweep")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt")
    ap.add_argument("--model-dir", help="EAGLE: the model_dir of the export, to bake a new winning tree "
                         "(default: trees not baked yet compete as step-wise drafts)")
    ap.add_argument("--json", help="write the full report (every candidate) to this file (default: not written)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        from exporter.cli import check_output

        if args.json:
            check_output(args.json, "--json", args.out_dir, args.model_dir)
        prompts = read_prompt_texts(args.prompts, "--prompts") if args.prompts else None
        report = tune(args.out_dir, prompts=prompts, provider=args.provider, threads=args.threads,
                      budget_s=args.budget_s, model_dir=args.model_dir, max_new_tokens=args.max_new_tokens)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        return 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
