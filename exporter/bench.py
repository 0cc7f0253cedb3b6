"""Our runtime against what users run instead: same prompts, same token budget, one run.

    python -m exporter.bench out_dir [--model-dir MODEL_DIR] [--prompts-file FILE] [--prompts N]
        [--max-new-tokens 96] [--repeats 3] [--temperature 0] [--threads N] [--precisions fp32,int4]
        [--peers genai,hf,optimum] [--draft-model DIR] [--optimum-python PY] [--json F] [--png F] [--sweep]

Systems: our runtime autoregressive (``ours-ar``) and speculative (``ours-spec``) on the export, per
precision (int4 through the optimize stage); onnxruntime-genai on its own build of the same base
(``genai``, ``genai-int4``: the anchor); HF ``generate`` greedy, with prompt-lookup decoding and
with an assistant model (``hf``, ``hf-pld``, ``hf-assisted``); optimum's ``ORTModelForCausalLM``.
Peers need ``--model-dir`` (the HF directory the export came from). Each system runs in its own
subprocess; prompts go round-robin, the order rotating, so machine noise hits all alike. Greedy
tokens of ``ours-spec`` must equal ``ours-ar``'s (exit 1 otherwise); peers' are compared and reported.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from exporter.benchmark import report as R
from exporter.benchmark import systems as S
from exporter.benchmark.prompts import DEFAULT_PROMPTS, build_prompts  # noqa: F401 (DEFAULT_PROMPTS: exporter.e2e)
from exporter.loading import UserError

PEERS = ("genai", "hf", "optimum")
# our variants: the export as it is, or a copy through the optimize stage (fused; quantized)
PRECISIONS = {"fp32": None, "opt": "none", "int8": "int8", "int4": "int4"}
GENAI_PRECISIONS = ("fp32", "int4")  # what onnxruntime-genai's builder is asked for


@dataclass
class BenchOptions:
    model_dir: str | None = None  # the HF source of the export: peers build from it
    prompts_file: str | None = None
    prompts: int | None = None  # how many prompts (default: all of the file, or 8 built-in)
    max_new_tokens: int = 96
    repeats: int = 3
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    threads: int | None = None
    tree: object = None  # Medusa paths or EAGLE {topk, depth, total_tokens}; default: the manifest's
    precisions: tuple = ("fp32",)
    peers: tuple = PEERS
    draft_model: str | None = None  # HF assistant model for hf-assisted
    prompt_lookup: int = 10  # HF prompt_lookup_num_tokens
    optimum_python: str | None = None  # a python with optimum-onnx (it pins transformers < 4.58)
    load_options: dict = field(default_factory=dict)  # extra graphs.load() keywords (eagle_draft=...)
    sweep: bool = False
    work: str | None = None  # keep peers' builds here (default: a temporary directory)

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise UserError(msg)

        need(self.prompts is None or self.prompts >= 1, f"--prompts must be >= 1, got {self.prompts}")
        need(self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}")
        need(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        need(self.threads is None or self.threads >= 1, f"--threads must be >= 1, got {self.threads}")
        need(math.isfinite(self.temperature) and self.temperature >= 0,
             f"--temperature must be a finite number >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}")
        bad = [p for p in self.precisions if p not in PRECISIONS] + [p for p in self.peers if p not in PEERS]
        need(not bad, f"unknown precision or peer {bad[0] if bad else ''!r}; precisions: {', '.join(PRECISIONS)} "
                      f"(opt: fused fp32); "
                      f"peers: {', '.join(PEERS)}")


def check_writable(path, flag: str) -> None:
    """Fail before the run, not after it, if a report cannot be written where asked."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {p}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{flag} {p} is not writable; check its permissions")


def plan(out_dir: Path, manifest, opts: BenchOptions, work: Path, log=print) -> list[S.System]:
    """The systems of this run, their models prepared (or the reason each is skipped)."""
    systems = []
    ours_base = {"runner": "ours", "threads": opts.threads, "load_options": opts.load_options}
    for prec in opts.precisions:
        sfx = "" if prec == "fp32" else f"-{prec}"
        path, why = (out_dir, "") if prec == "fp32" else S.ours_variant(out_dir, PRECISIONS[prec], work, log)
        ar = S.System(f"ours-ar{sfx}", "ours", {**ours_base, "out_dir": str(path), "mode": "autoregressive"},
                      precision=prec)
        mine = [ar]
        if manifest.drafter:
            mine.append(S.System(f"ours-spec{sfx}", "ours", {**ours_base, "out_dir": str(path),
                                 "mode": "speculative", "tree": opts.tree}, precision=prec, must_equal=ar.name))
        for s in mine:
            if not path:
                s.skip(why)
        systems += mine
    peers = [p for p in opts.peers]
    if not peers:
        return systems
    names = {"genai": [f"genai{'' if p == 'fp32' else '-' + p}" for p in opts.precisions if p in GENAI_PRECISIONS],
             "hf": ["hf", "hf-pld"] + (["hf-assisted"] if opts.draft_model else []), "optimum": ["optimum"]}
    if not opts.model_dir:
        for p in peers:
            for n in names[p]:
                s = S.System(n, p, {})
                s.skip("needs --model-dir (the HF directory the export was made from)")
                systems.append(s)
        return systems
    plain, why = S.plain_base(Path(opts.model_dir), work, log)
    hf_ref = "hf"
    for p in peers:
        for n in names[p]:
            prec = n.split("-")[1] if p == "genai" and "-" in n else "fp32"
            s = S.System(n, p, {"threads": opts.threads}, precision=prec)
            systems.append(s)
            if plain is None:
                s.skip(why)
                continue
            if p == "genai":
                model, why2 = S.genai_model(plain, prec, work, log)
                s.spec.update(runner="genai", model=str(model))
                s.compare_to = "ours-ar" if prec == "fp32" else f"ours-ar-{prec}"
            elif p == "hf":
                model, why2 = plain, ""
                s.spec.update(runner="hf", model=str(plain))
                if n == "hf-pld":
                    s.spec["prompt_lookup"] = opts.prompt_lookup
                if n == "hf-assisted":
                    s.spec["assistant"] = str(opts.draft_model)
                s.compare_to = "ours-ar" if n == hf_ref else hf_ref
            else:
                if not opts.optimum_python:
                    s.skip("no --optimum-python given: optimum-onnx pins transformers < 4.58, so it needs its own "
                           "environment; pass that environment's python")
                    continue
                s.python = opts.optimum_python
                model, why2 = S.optimum_model(plain, opts.optimum_python, work, log)
                s.spec.update(runner="optimum", model=str(model))
                s.compare_to = "hf"
            if model is None:
                s.skip(why2)
    return systems


def _tree_sizes(kind: str, drafter: dict) -> list:
    """Trees of growing size for ``--sweep``: Medusa paths or EAGLE settings."""
    from graphs.trees import default_medusa_paths

    if kind == "medusa":
        trees = {}
        for s in (2, 4, 8, 12, 16, 24, 32):
            paths = default_medusa_paths(drafter["num_heads"], size=s)
            trees.setdefault(len(paths), paths)  # the heuristic stops growing where paths get unlikely
        return list(trees.values())
    return [{"topk": k, "depth": d, "total_tokens": t}
            for k, d, t in [(1, 2, 3), (2, 3, 6), (4, 4, 8), (4, 4, 12), (6, 5, 16), (8, 5, 24), (8, 6, 32)]]


def _tree_size(tree) -> int:
    return tree["total_tokens"] if isinstance(tree, dict) else 1 + len(tree)


def bench(out_dir, opts: BenchOptions | None = None, log=print) -> dict:
    """Run every planned system on the same prompts; return the report (see ``report.SCHEMA``)."""
    from tokenizers import Tokenizer

    from graphs.manifest import Manifest

    opts = opts or BenchOptions()
    out_dir = Path(out_dir).absolute()
    manifest = Manifest.read(out_dir, verify=False)  # each worker's graphs.load() checks the hashes
    tokenizer = Tokenizer.from_file(str(out_dir / manifest.tokenizer)) if manifest.tokenizer else None
    prompts = build_prompts(out_dir, tokenizer, opts.prompts_file, opts.prompts, opts.seed,
                            manifest.source["vocab_size"],
                            frozenset(manifest.generation.get("eos_token_ids") or []) | {0})
    own_work = opts.work is None
    work = Path(tempfile.mkdtemp(prefix="bench-")) if own_work else Path(opts.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _bench(out_dir, manifest, prompts, opts, work, log)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def _bench(out_dir, manifest, prompts, opts: BenchOptions, work: Path, log) -> dict:
    t_start = time.perf_counter()
    log(f"measuring copy bandwidth ({opts.threads or os.cpu_count()} threads)")
    bandwidth = R.copy_bandwidth(opts.threads)
    log("planning systems")
    systems = plan(out_dir, manifest, opts, work, log)
    try:
        for s in systems:
            log(f"  starting {s.name}")
            S.start(s, work, log)
            if s.status == "ok":  # warm-up: first runs allocate
                S.run(s, _request(prompts[0].ids, opts, 8, None))
            if s.status != "ok":
                log(f"  {s.name}: {s.status}: {s.reason}")
        live = [s for s in systems if s.status == "ok"]
        total = opts.repeats * len(prompts)
        log(f"running {len(live)} systems x {len(prompts)} prompts x {opts.repeats} repeats")
        for r in range(opts.repeats):
            for i, p in enumerate(prompts):
                k = r * len(prompts) + i
                order = live[k % len(live):] + live[: k % len(live)] if live else []
                for s in order:
                    if s.status == "ok":
                        reply = S.run(s, _request(p.ids, opts, opts.max_new_tokens, opts.seed + k))
                        if reply is not None:
                            s.runs.append({**reply, "_prompt": i})
                if (k + 1) % max(1, total // 10) == 0 or k + 1 == total:
                    log(f"  {k + 1}/{total} prompt runs ({time.perf_counter() - t_start:.0f} s)")
        sweep = _sweep(systems, prompts, manifest, opts, log) if opts.sweep else None
    finally:
        for s in systems:
            S.close(s)
    n_tokens = [len(p.ids) for p in prompts]
    entries = [R.summarize(s, n_tokens, bandwidth) for s in systems]
    ok = {e["name"] for e in entries if e["status"] == "ok"}
    anchor = next((a for a in ("genai", "ours-ar") if a in ok), None)
    R.speedups(entries, [a for a in ("genai", "ours-ar", "ours-ar-opt", "genai-int4", "ours-ar-int4", "hf") if a in ok])
    greedy = R.greedy_check(systems, len(prompts)) if opts.temperature == 0 else []
    report = {
        "schema": R.SCHEMA,
        "out_dir": str(out_dir),
        "model_dir": opts.model_dir,
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "copy_bandwidth_bytes_per_s": bandwidth, "python": platform.python_version()},
        "settings": {"prompts": len(prompts), "prompts_file": opts.prompts_file,
                     "prompt_sources": sorted({p.source for p in prompts}),
                     "mean_prompt_tokens": sum(n_tokens) / len(n_tokens), "max_new_tokens": opts.max_new_tokens,
                     "repeats": opts.repeats, "temperature": opts.temperature, "top_p": opts.top_p,
                     "top_k": opts.top_k, "seed": opts.seed, "threads": opts.threads,
                     "precisions": list(opts.precisions), "load_options": opts.load_options,
                     "drafter": manifest.drafter["kind"] if manifest.drafter else None,
                     "tree": opts.tree or manifest.tree},
        "anchor": anchor,
        "systems": entries,
        "greedy": greedy if opts.temperature == 0 else "not checked: sampling (temperature > 0)",
        "greedy_mismatches": sum(1 for g in greedy if g["must_equal"] and g["prompts_equal"] < g["prompts_compared"]),
        "seconds": time.perf_counter() - t_start,
    }
    if sweep is not None:
        report["sweep"] = sweep
    return report


def _request(ids, opts: BenchOptions, max_new: int, seed, tree=None) -> dict:
    return {"ids": ids, "max_new_tokens": max_new, "temperature": opts.temperature, "top_p": opts.top_p,
            "top_k": opts.top_k, "seed": seed, "tree": tree}


def _sweep(systems, prompts, manifest, opts: BenchOptions, log) -> list | None:
    """ours-spec per tree size, each prompt run beside ours-ar (order alternating), so every row's
    speedup compares runs made under the same machine load."""
    by = {s.name: s for s in systems if s.status == "ok"}
    spec, ar = by.get("ours-spec"), by.get("ours-ar")
    if spec is None or ar is None:
        log("sweep: skipped (ours-spec or ours-ar did not run)")
        return None
    rows = []
    # the export's own default first (the tuned one after exporter.tune / exporter.optimize), then the
    # hand-picked trees of growing size, all under the same protocol
    default = manifest.tree.get("eagle") if manifest.drafter["kind"] == "eagle" else manifest.tree.get("medusa_paths")
    for tree in ([default] if default else []) + _tree_sizes(manifest.drafter["kind"], manifest.drafter):
        runs = {"spec": [], "ar": []}
        for r in range(max(1, opts.repeats // 2)):
            for i, p in enumerate(prompts):
                pair = [("spec", spec, tree), ("ar", ar, None)]
                for key, system, tr in pair if (r + i) % 2 == 0 else pair[::-1]:
                    reply = S.run(system, _request(p.ids, opts, opts.max_new_tokens, opts.seed + i, tr))
                    if reply is not None:
                        runs[key].append(reply)
        if not runs["spec"] or not runs["ar"]:
            break
        tps = {k: sum(len(x["tokens"]) - 1 for x in v) / max(sum(x["decode_s"] for x in v), 1e-9)
               for k, v in runs.items()}
        acc = [a for x in runs["spec"] for a in x["accepted"]]
        row = {"tree": tree, "tree_size": _tree_size(tree), "decode_tokens_per_s": tps["spec"],
               "autoregressive_tokens_per_s": tps["ar"], "speedup": tps["spec"] / max(tps["ar"], 1e-9),
               "mean_accepted_length": sum(acc) / len(acc) if acc else 0.0}
        if not rows and default:
            row["default"] = True
            row["tuned"] = "tuned" in manifest.tree
        rows.append(row)
        name = ("default" + (" (tuned)" if row.get("tuned") else "")) if row.get("default") else "tree"
        log(f"  {name} size {row['tree_size']:3d}: {row['decode_tokens_per_s']:.1f} tok/s "
            f"({row['speedup']:.2f}x ours-ar beside it), tau {row['mean_accepted_length']:.2f}")
    hand = [r for r in rows if not r.get("default")]
    if rows and rows[0].get("default") and hand:
        best = max(hand, key=lambda r: r["speedup"])
        rows[0]["vs_best_hand_picked"] = rows[0]["speedup"] / best["speedup"]
        log(f"  default tree vs the best hand-picked one (size {best['tree_size']}): "
            f"{rows[0]['vs_best_hand_picked']:.2f}x")
    return rows


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
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked equal)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--threads", type=int, default=None, help="threads per system (default: all cores)")
    ap.add_argument("--tree", help="tree JSON file for ours-spec (default: the manifest's)")
    ap.add_argument("--precisions", default="fp32", help="comma list of fp32,opt,int8,int4 (ours: opt/int8/int4 "
                                                         "through the optimize stage; genai: fp32/int4 builds)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of genai,hf,optimum ('' for none)")
    ap.add_argument("--draft-model",
                    help="HF draft model directory for hf-assisted (assisted generation; default: not run)")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens of hf-pld")
    ap.add_argument("--optimum-python",
                    help="python of an environment with optimum-onnx installed (default: optimum skipped with a line)")
    ap.add_argument("--load-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra graphs.load() keyword for our systems (JSON value), e.g. eagle_draft=\"one_call\"")
    ap.add_argument("--sweep", action="store_true", help="also measure ours-spec against tree size")
    ap.add_argument("--work", help="keep peers' model builds here and reuse them (default: a temporary dir)")
    ap.add_argument("--json", help="write the report as JSON here (default: not written)")
    ap.add_argument("--png", help="draw the report here (default: not drawn)")
    ap.add_argument("--variants", help="instead of the systems run: compare optimized variants of a raw export, "
                    "e.g. raw,fused,int8,int4 (exporter.variants; verify latency at 1/8/16/32 tree tokens, tok/s; "
                    "default: not run)")
    ap.add_argument("--tune", action="store_true", help="with --variants: re-tune each variant's default tree "
                    "for its own graphs before the end-to-end run, as exporter.optimize does (default: the "
                    "export's tree for all)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        from exporter.cli import require_module
        from graphs.sessions import use_shared_thread_pool

        for flag, path in (("--json", args.json), ("--png", args.png)):
            if path:
                check_writable(path, flag)
        if args.png:  # say so before the run, not after it
            require_module("matplotlib", "--png", "'specexport[plot]' (or matplotlib)")
        if args.variants:
            from exporter import variants

            use_shared_thread_pool(args.threads)  # one ORT pool for base, draft and K/V sessions
            report = variants.run_variants(args.out_dir, _csv(args.variants), max_new_tokens=args.max_new_tokens,
                                           repeats=args.repeats, prompts=args.prompts or 8, threads=args.threads,
                                           sweep=args.sweep, tune=args.tune)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            if args.png:
                variants.draw(report, Path(args.png))
            return 0
        tree = None
        if args.tree:
            try:
                tree = json.loads(Path(args.tree).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise UserError(f"cannot read --tree {args.tree}: {e}") from None
            tree = tree["paths"] if isinstance(tree, dict) and "paths" in tree else tree
        opts = BenchOptions(
            model_dir=args.model_dir, prompts_file=args.prompts_file, prompts=args.prompts,
            max_new_tokens=args.max_new_tokens, repeats=args.repeats, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, threads=args.threads, tree=tree,
            precisions=_csv(args.precisions), peers=_csv(args.peers), draft_model=args.draft_model,
            prompt_lookup=args.prompt_lookup, optimum_python=args.optimum_python,
            load_options=_load_options(args.load_option), sweep=args.sweep, work=args.work)
        report = bench(args.out_dir, opts, log=lambda *a: print(*a, file=sys.stderr))
        for e in report["systems"]:
            print(R.line(e, report["anchor"]))
        for g in report["greedy"] if isinstance(report["greedy"], list) else []:
            if g["prompts_equal"] == g["prompts_compared"]:
                print(f"greedy tokens equal: {g['system']} = {g['reference']} on {g['prompts_compared']} prompts")
            else:
                print(f"{'GREEDY MISMATCH' if g['must_equal'] else 'note: greedy tokens differ'}: {g['system']} vs "
                      f"{g['reference']} on {g['prompts_compared'] - g['prompts_equal']}/{g['prompts_compared']} "
                      f"prompts (first at prompt {g['first_mismatch']['prompt']}, token "
                      f"{g['first_mismatch']['token_index']})")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.png:
            R.draw(report, Path(args.png))
        return 1 if report["greedy_mismatches"] else 0

    return run_cli(body, debug=args.debug)


def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


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
