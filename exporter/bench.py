"""Our runtime against what users run instead: same prompts, same token budget, one run.

    python -m exporter.bench out_dir [--model-dir MODEL_DIR] [--prompts-file FILE] [--prompts N]
        [--max-new-tokens 96] [--repeats 3] [--temperature 0] [--threads N] [--precisions fp32,int4]
        [--peers genai,hf,optimum] [--draft-model DIR] [--optimum-python PY] [--json F] [--png F] [--sweep]

Systems: our runtime autoregressive (``ours-ar``) and speculative (``ours-spec``) on the export, per
precision (opt/int8/int4 through the optimize stage, each copy's tree re-tuned as optimize ships it;
``--no-tune``: the export's tree); onnxruntime-genai on its own build of the same base
(``genai``, ``genai-int4``: the anchor); HF ``generate`` greedy, with prompt-lookup decoding and
with an assistant model (``hf``, ``hf-pld``, ``hf-assisted``); optimum's ``ORTModelForCausalLM``.
Peers need ``--model-dir`` (the HF directory the export came from). Each system runs in its own
subprocess; prompts go round-robin, the order rotating, so machine noise hits all alike. Greedy
tokens of ``ours-spec`` must equal ``ours-ar``'s (exit 1 otherwise); peers' are compared and reported.

A thin command line over :func:`exporter.benchmark.run.bench` (``--variants``:
:func:`exporter.benchmark.variants.run_variants`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from exporter.benchmark import report as R
from exporter.benchmark.run import PEERS, BenchOptions, bench, check_writable
from exporter.errors import UserError

__all__ = ["BenchOptions", "bench", "main"]


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory")
    ap.add_argument("--model-dir",
                    help="the HF model directory the export came from (peers build from it; "
                         "default: no peers that need it)")
    ap.add_argument("--prompts-file",
                    help="prompts: text (one per line) or JSONL with 'prompt' or 'messages' "
                         "(default: the built-in set)")
    ap.add_argument("--prompts", "--count", dest="prompts", type=int, default=None,
                    help="how many prompts (cycles the file or built-in set; default: the whole file, or 8 built-in)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="token budget per prompt, every system")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each prompt per system")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default: 0, greedy: outputs checked equal)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    ap.add_argument("--threads", type=int, default=None, help="threads per system (default: all cores)")
    ap.add_argument("--tree", help="tree JSON file for ours-spec (default: the manifest's)")
    ap.add_argument("--precisions", default="fp32", help="comma list of fp32,opt,int8,int4 (ours: opt/int8/int4 "
                                                         "through the optimize stage; genai: fp32/int4 builds)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of genai,hf,optimum,llamacpp ('' for none)")
    ap.add_argument("--draft-model",
                    help="HF draft model directory for hf-assisted (assisted generation; default: not run)")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens of hf-pld")
    ap.add_argument("--optimum-python",
                    help="python of an environment with optimum-onnx installed (default: optimum skipped with a line)")
    ap.add_argument("--load-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra graphs.load() keyword for our systems (JSON value), e.g. eagle_draft=\"one_call\"")
    ap.add_argument("--sweep", action="store_true", help="also measure ours-spec against tree size")
    ap.add_argument("--work", help="keep peers' model builds here and reuse them (default: a temporary dir)")
    ap.add_argument("--logs", help="keep every worker's and build's log here (default: a temporary directory, "
                                   "kept and named when a system fails)")
    ap.add_argument("--also", action="append", default=[], metavar="EXPORT",
                    help="a raw export of the same base with another drafter, run as ours-spec-<kind> beside the "
                         "main export's systems at every precision (repeatable; default: none)")
    ap.add_argument("--also-tree", action="append", default=[], metavar="NAME=TREE",
                    help="another tree of the export (JSON, or a JSON file), run as ours-spec-NAME beside ours-spec "
                         "(repeatable), e.g. a DFlash top-k tree beside its chain: "
                         "tree4x16='{\"topk\": 4, \"total_tokens\": 16}' (default: none)")
    ap.add_argument("--json", help="write the report as JSON here (default: not written)")
    ap.add_argument("--png", help="draw the report here (default: not drawn)")
    ap.add_argument("--variants", help="instead of the systems run: compare optimized variants of a raw export, "
                    "e.g. raw,fused,int8,int4 (exporter.variants; verify latency at 1/8/16/32 tree tokens, tok/s; "
                    "default: not run)")
    ap.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                    help="re-tune each optimized copy's default tree for its own graphs, as exporter.optimize does "
                         "(default: on for --precisions opt/int8/int4, the trees optimize ships; off for --variants, "
                         "which compare the graphs under one tree; --tree overrides both)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        from exporter.cli import require_module
        from graphs.sessions import use_shared_thread_pool

        for flag, path in (("--json", args.json), ("--png", args.png)):
            if path:
                check_writable(path, flag, args.out_dir, args.model_dir, args.draft_model)
        if args.png:  # say so before the run, not after it
            require_module("matplotlib", "--png", "'specexport[plot]' (or matplotlib)")
        tree = _read_tree(args.tree) if args.tree else None
        tune_flag = {True: "--tune", False: "--no-tune"}.get(args.tune)  # as given; never silently ignored
        if tune_flag and tree is not None:
            raise UserError(f"{tune_flag} and --tree: --tree fixes the tree every system runs; drop one of them")
        if tune_flag and not args.variants and not set(_csv(args.precisions)) - {"fp32"}:
            raise UserError(f"{tune_flag} applies to the optimized copies bench makes (--precisions opt, int8 or "
                            f"int4); with fp32 alone there is none: drop it, add an optimized precision, or tune the "
                            f"export itself (python -m exporter.tune OUT_DIR)")
        if args.variants:
            from exporter.benchmark import variants

            unused = [flag for flag, v in (("--model-dir", args.model_dir), ("--draft-model", args.draft_model),
                                           ("--optimum-python", args.optimum_python), ("--work", args.work),
                                           ("--precisions", args.precisions != "fp32"), ("--also", args.also)) if v]
            if unused:  # never silently ignored
                raise UserError(f"{unused[0]} does not apply to --variants (it runs our variants only, no peers); "
                                f"drop it, or run without --variants")
            use_shared_thread_pool(args.threads)  # one ORT pool for base, draft and K/V sessions
            report = variants.run_variants(args.out_dir, _csv(args.variants), max_new_tokens=args.max_new_tokens,
                                           repeats=args.repeats, prompts=args.prompts or 8, threads=args.threads,
                                           sweep=args.sweep, tune=bool(args.tune), tree=tree,
                                           load_options=_load_options(args.load_option),
                                           prompts_file=args.prompts_file, logs=args.logs)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            if args.png:
                variants.draw(report, Path(args.png))
            return 0
        opts = BenchOptions(
            model_dir=args.model_dir, prompts_file=args.prompts_file, prompts=args.prompts,
            max_new_tokens=args.max_new_tokens, repeats=args.repeats, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, threads=args.threads, tree=tree,
            precisions=_csv(args.precisions), peers=_csv(args.peers), draft_model=args.draft_model,
            prompt_lookup=args.prompt_lookup, optimum_python=args.optimum_python,
            load_options=_load_options(args.load_option), sweep=args.sweep, work=args.work, logs=args.logs,
            tune=args.tune, also=tuple(args.also), also_trees=_also_trees(args.also_tree))
        report = bench(args.out_dir, opts, log=lambda *a, **k: print(*a, file=sys.stderr, flush=True))
        for e in report["systems"]:
            print(R.line(e, report["anchor"]))
        for text in R.category_lines(report):
            print(text)
        for g in report["greedy"] if isinstance(report["greedy"], list) else []:
            print("\n".join(R.greedy_lines(g)))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.png:
            R.draw(report, Path(args.png))
        if report["failed"]:  # a system asked for that failed is never a silent exit 0
            print(f"error: {len(report['failed'])} system(s) failed: {', '.join(report['failed'])} (their logs: "
                  f"{report['logs']})", file=sys.stderr)
        return 1 if report["greedy_mismatches"] or report["failed"] else 0

    return run_cli(body, debug=args.debug)


def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _read_tree(path: str):
    try:
        tree = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --tree {path}: {e}") from None
    return tree["paths"] if isinstance(tree, dict) and "paths" in tree else tree


def _also_trees(items: list[str]) -> tuple:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"--also-tree {item!r}: expected NAME=TREE, e.g. tree4x16='{{\"topk\": 4, "
                            f"\"total_tokens\": 16}}'")
        try:
            tree = json.loads(value)
        except json.JSONDecodeError:
            tree = _read_tree(value) if Path(value).is_file() else None
            if tree is None:
                raise UserError(f"--also-tree {name}: {value!r} is neither JSON nor a JSON file") from None
        out.append((name, tree))
    return tuple(out)


def _load_options(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UserError(f"--load-option {item!r}: expected KEY=VALUE, e.g. eagle_draft=\"one_call\"")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare word is a string
    return out


if __name__ == "__main__":
    sys.exit(main())
