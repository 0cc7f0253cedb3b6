"""Export a HF causal LM and its drafter to ONNX graphs with tree-attention inputs.

    python -m exporter.export model_dir out_dir [--drafter PATH] [--dtype float32] [--overwrite]

Writes ``base.onnx`` (and ``draft.onnx`` when there is a drafter), ``manifest.json`` and the
tokenizer files into ``out_dir``. The export is built in a temporary directory beside
``out_dir``, checked against PyTorch (:mod:`exporter.validate`) and moved into place only when
complete, under a lock on ``out_dir`` (:mod:`exporter.outdir`): a failed or terminated export leaves
nothing behind, and ``--overwrite`` replaces an earlier export only (``--overwrite-non-export OUT_DIR``
replaces anything). ``model_dir`` may also be a ``.gguf`` file (dequantized to float32 once, cached).
Without ``model_dir`` it runs the main job on a real model (:mod:`exporter.mainjob`: SmolLM2-135M-Instruct,
an EAGLE-3 drafter trained for it, exported and optimized); ``--tiny`` builds the seconds-long demo instead.

A thin command line over :func:`exporter.pipeline.export` (load -> plan -> trace -> validate -> write,
then optimize with ``--optimize``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from exporter import pipeline
from exporter.errors import UserError
from exporter.mainjob import DRAFTER_BUDGET_S
from exporter.plan import DTYPES, OPSET, parse_tree
from exporter.trace import EXTERNAL_DATA_BYTES as _TRACE_EXTERNAL_DATA_BYTES
from graphs.manifest import Manifest

# Graphs over this many bytes keep their weights in one .data file. Read here at each call, so a
# test may lower it on this module (tests/test_reliability_runtime.py does).
EXTERNAL_DATA_BYTES = _TRACE_EXTERNAL_DATA_BYTES


def export(model_dir, out_dir, **options) -> Manifest:
    """Export ``model_dir`` into ``out_dir``; returns the manifest written there.

    The library call behind this command: :func:`exporter.pipeline.export`, whose keywords it takes
    (drafter, dtype, overwrite, opset, validate, trust_remote_code, eagle_trees, log,
    overwrite_non_export, optimize).
    """
    options.setdefault("external_data_bytes", EXTERNAL_DATA_BYTES)
    return pipeline.export(model_dir, out_dir, **options)


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?",
                    help="HF model directory, a .gguf file, or a hub id (org/name) in the local HF cache; never "
                         "downloads (default: the main job: SmolLM2-135M-Instruct + a trained EAGLE-3 drafter, "
                         "in spec-demo/)")
    ap.add_argument("out_dir", nargs="?",
                    help="where to write the export, empty or absent (default with no model_dir: spec-demo/onnx)")
    ap.add_argument("--tiny", action="store_true",
                    help="with no model_dir: the seconds-long demo (a 0.9M model trained here, nonsense text) "
                         "in spec-demo-tiny/ instead of the real model")
    ap.add_argument("--budget-s", type=float, default=DRAFTER_BUDGET_S,
                    help="with no model_dir: seconds for the drafter's distillation + training")
    ap.add_argument("--drafter", help="a drafter trained elsewhere (ModelOpt, Medusa, EAGLE, EAGLE-3, DFlash files) "
                                      "(default: the drafter saved in model_dir, if any)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="precision of the graphs")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    ap.add_argument("--overwrite-non-export", metavar="OUT_DIR",
                    help="replace out_dir whatever it holds (deletes it); must repeat out_dir (default: never)")
    ap.add_argument("--opset", type=int, default=OPSET, help="ONNX opset of the graphs")
    ap.add_argument("--eagle-trees", nargs="+", type=parse_tree, metavar="K,D,T",
                    help="EAGLE: bake one-call draft graphs for these (topk, depth, total_tokens) trees "
                         "(default: the default tree 2,3,6)")
    ap.add_argument("--no-validate", action="store_true", help="skip the PyTorch-vs-ONNX check (not advised)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the model's own Python code from its directory (off: only transformers' code runs)")
    ap.add_argument("--optimize", action="store_true", help="then run python -m exporter.optimize on the export")
    from exporter.optimize import add_arguments, options_from_args

    add_arguments(ap)  # --target, --quantize, ... (used with --optimize)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)  # options may come between model_dir and out_dir

    def body():
        from exporter.hub import resolve_model

        model_dir, out_dir, overwrite = args.model_dir, args.out_dir, args.overwrite
        if model_dir is None and not args.tiny:
            from exporter.mainjob import run_main_job

            root = Path(out_dir).parent if out_dir else Path("spec-demo")
            if out_dir and Path(out_dir).name != "onnx":
                raise UserError(f"the main job writes its export to ROOT/onnx; pass an out_dir ending in /onnx "
                                f"(got {out_dir}), or pass a model_dir")
            run_main_job(root, budget_s=args.budget_s)
            return 0
        if model_dir is None:
            from exporter.demo import default_paths, prepare_demo

            model_dir, default_out = default_paths()
            out_dir = Path(out_dir or default_out)
            overwrite = prepare_demo(model_dir, out_dir) or overwrite  # a rerun replaces its own export
        elif args.tiny:
            raise UserError("--tiny is the demo's: drop it, or drop model_dir")
        elif out_dir is None:
            raise UserError("missing out_dir: python -m exporter.export model_dir out_dir")
        force = args.overwrite_non_export
        if force is not None and Path(force).absolute() != Path(out_dir).absolute():
            raise UserError(f"--overwrite-non-export must repeat out_dir ({out_dir}), got {force}")
        model_dir = resolve_model(model_dir)  # a directory, or org/name from the local HF cache
        export(model_dir, out_dir, drafter=args.drafter, dtype=args.dtype, overwrite=overwrite, opset=args.opset,
               validate=not args.no_validate, trust_remote_code=args.trust_remote_code, eagle_trees=args.eagle_trees,
               overwrite_non_export=force is not None, optimize=options_from_args(args) if args.optimize else None)
        return 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
