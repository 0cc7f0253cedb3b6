"""Optimize an export in place: tree-safe fusions, float16 for GPUs, int4/int8 weight-only graphs.

    python -m exporter.optimize out_dir [--target cpu|cuda] [--quantize none|int8|int4] [--no-fuse]
    python -m exporter.optimize out_dir --measure-forms     # on the GPU: choose the CUDA attention form

The stage between export and run (docs/DESIGN.md, "The stages"). Per traced graph (base, draft,
and the one-call EAGLE tree graphs ``draft_tree.*``, whose unrolled drafter forwards get the draft
graph's passes):

    fuse       eager attention -> ONNX ``Attention`` (opset 23: any mask, grouped K/V; never
               ``GroupQueryAttention``, which ignores tree masks), rotary -> ONNX ``RotaryEmbedding``,
               RMSNorm -> SimplifiedLayerNorm, residual Add + RMSNorm -> SkipSimplifiedLayerNorm
               (exporter.passes.*)
    quantize   MatMul weights -> ``MatMulNBits`` (4 or 8 bits, block 32; ORT's quantizer)
    float16    --target cuda: ORT's float16 converter, norms and softmax kept float32; the base in
               two attention forms (ONNX ``Attention`` with the tree mask as a float additive mask,
               ``GroupQueryAttention`` with it as ``attention_bias``), the faster chosen by timing both
               on the GPU (exporter.attention_forms)

then checks every rewritten graph against the raw one on random non-causal tree masks, batch 2
with holes in the past, a decode with a past and a prefill (exporter.passes.parity), records what
was done in ``manifest.json`` (``optimization``: role -> passes, target, dtype, quantization) and
rehashes every file. The export is rewritten in a temporary directory beside it and swapped in
only when all of that passed: a failure leaves it as it was. A quantized base is a new base:
speculative decoding stays lossless relative to it, and its distance from the float model is
what ``python -m exporter.compare`` reports.

A thin command line over :func:`exporter.pipeline.optimize_export` (the stage:
:mod:`exporter.optimizing`; the writer: :mod:`exporter.outdir`; the re-tuning:
:func:`exporter.pipeline.tune_export`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from exporter.optimizing import TUNE_BUDGET_S
from exporter.pipeline import optimize_export

__all__ = ["add_arguments", "main", "optimize_export", "options_from_args"]


def main(argv=None) -> int:
    import json

    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.optimize", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory (holds manifest.json); rewritten in place")
    add_arguments(ap)
    ap.add_argument("--no-validate", action="store_true", help="skip the raw-vs-optimized parity check (not advised)")
    ap.add_argument("--measure-forms", action="store_true",
                    help="on a CUDA machine, for an export already optimized with --target cuda: time its two "
                         "attention forms and record the faster in manifest.json (optimize does this itself "
                         "where it runs on the GPU)")
    ap.add_argument("--json", help="also write the summary as JSON to this file (default: not written)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)

    def body():
        from exporter.cli import check_output

        if args.json:
            check_output(args.json, "--json", args.out_dir)
        if args.measure_forms:
            from exporter.pipeline import measure_attention_forms

            summary = measure_attention_forms(args.out_dir, provider="cuda")
        else:
            summary = optimize_export(args.out_dir, validate=not args.no_validate, **options_from_args(args))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0

    return run_cli(body, debug=args.debug)


def add_arguments(ap) -> None:
    """The optimize options, shared with ``python -m exporter.export --optimize``."""
    ap.add_argument("--target", default="cpu", help="provider to tune for: cpu (default) | cuda (float16)")
    ap.add_argument("--quantize", default="none", help="weight-only: none (default) | int8 | int4")
    ap.add_argument("--quantize-draft", default=None,
                    help="the drafter's graphs on their own: none | int8 | int4 (default: as --quantize). "
                         "A quantized drafter beside a float base drafts faster and the output stays the "
                         "float model's")
    ap.add_argument("--no-fuse", action="store_true", help="skip the attention and norm fusions")
    ap.add_argument("--no-kv-in-place", action="store_true",
                    help="keep the traced past+new K/V concatenation in every layer instead of writing the new "
                         "rows into the cache buffer (default: in place; the GroupQueryAttention graph of "
                         "either target needs it)")
    ap.add_argument("--kv-layout", default="bhsd", choices=["bhsd", "bsh"],
                    help="the base's K/V buffers when written in place: bhsd (default; per-head contiguous, the "
                         "faster attention as the context grows) or bsh (genai's compact 3-D form: fewer nodes, "
                         "slower per cached token)")
    ap.add_argument("--no-one-sequence-graph", action="store_true",
                    help="do not write base.gqa.onnx beside the base: the same contract with each layer's attention "
                         "one GroupQueryAttention, which the runtime runs for one-token steps and one sequence's "
                         "trees (default on with K/V in place)")
    ap.add_argument("--float32", action="store_true", help="keep float32 on --target cuda")
    ap.add_argument("--block-size", type=int, default=32, help="quantization block size (default 32)")
    ap.add_argument("--no-tune", action="store_true",
                    help="keep the default tree as it is instead of re-tuning it for the optimized graphs "
                         "on this machine (default: re-tune, python -m exporter.tune)")
    ap.add_argument("--tune-budget-s", type=float, default=TUNE_BUDGET_S,
                    help="time for the EAGLE tree sweep of the re-tuning (default 60)")
    ap.add_argument("--accuracy-level", type=int, default=None,
                    help="the base's MatMulNBits compute: 4 int8 (default: MLAS's fast kernels, kept where "
                         "optimize's rows check finds every row's logits independent of the call's row count), "
                         "0 float32")
    ap.add_argument("--draft-accuracy-level", type=int, default=4,
                    help="the drafter graphs' MatMulNBits compute (default 4, int8: drafts are verified by the "
                         "base, so their rounding never changes the output)")


def options_from_args(args) -> dict:
    return {"target": args.target, "quantize": args.quantize, "quantize_draft": args.quantize_draft,
            "fuse": not args.no_fuse, "kv_in_place": False if args.no_kv_in_place else None,
            "kv_layout": args.kv_layout, "one_sequence_graph": not args.no_one_sequence_graph,
            "float16": False if args.float32 else None, "block_size": args.block_size,
            "accuracy_level": args.accuracy_level, "draft_accuracy_level": args.draft_accuracy_level,
            "tune": not args.no_tune, "tune_budget_s": args.tune_budget_s}


if __name__ == "__main__":
    sys.exit(main())
