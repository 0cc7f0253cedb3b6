"""PyTorch vs ONNX Runtime: where the exported graphs differ from the model, and by how much.

    python -m exporter.compare model_dir out_dir [--json report.json] [--provider cpu] [--text FILE]

Runs the float32 PyTorch model and the exported graphs on the same inputs and reports, per graph,
case and output: max absolute error, max relative error, the index where the largest error
occurs (with both values there) and top-1 agreement of logits, against two references (the traced
wrappers and Hugging Face's own forward); ``--e2e`` compares greedy tokens of PyTorch and the
runtime instead. Exits non-zero when an output exceeds the tolerance for its dtype and device.

A thin command line over :func:`exporter.pipeline.compare` (the cases and the report:
:mod:`exporter.validate`, :mod:`exporter.compare_report`, :mod:`exporter.distance`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from exporter.errors import UserError
from exporter.pipeline import compare, compare_end_to_end

__all__ = ["compare", "main"]


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--text {p} is not a file; pass a UTF-8 text file of held-out text")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--text {p} is not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 file") from None
    if not text.strip():
        raise UserError(f"--text {p} is empty; pass a file with at least two tokens of held-out text")
    return text


def _main_e2e(args) -> int:
    from exporter import e2e

    rows = compare_end_to_end(args.model_dir, args.out_dir, drafter=args.drafter, provider=args.provider,
                              prompts=args.prompt, max_new_tokens=args.max_new_tokens)
    print(e2e.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(e2e.to_json(rows), indent=2) + "\n")
    return 0 if all(r.ok for r in rows) else 1


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="the model directory that was exported")
    ap.add_argument("out_dir", help="the export directory (holds manifest.json)")
    ap.add_argument("--drafter", help="the drafter file passed to export, if any (default: none)")
    ap.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="ONNX Runtime execution provider")
    ap.add_argument("--json", help="also write the report as JSON to this file (default: none)")
    ap.add_argument("--e2e", action="store_true",
                    help="end to end: greedy tokens of PyTorch vs the runtime (speculative and autoregressive)")
    ap.add_argument("--prompt", action="append", help="prompt for --e2e (repeatable; default: built-in prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt for --e2e")
    ap.add_argument("--text", help="held-out text file for the distance rows (quantized graphs; default: built-in)")
    ap.add_argument("--distance", action="store_true",
                    help="also score held-out text for float graphs (top-1, mean KL, perplexity vs PyTorch)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)

    def body():
        from exporter.cli import check_output

        if args.json:
            check_output(args.json, "--json", args.out_dir, args.model_dir)
        if args.e2e:
            return _main_e2e(args)
        report = compare(args.model_dir, args.out_dir, provider=args.provider, drafter=args.drafter,
                         text=_read_text(args.text), distance=args.distance)
        print(report.table())
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        return 0 if report.ok else 1

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
