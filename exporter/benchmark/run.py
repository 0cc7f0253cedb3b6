"""One benchmark run: the systems of ``python -m exporter.bench``, prepared, measured interleaved, reported.

    bench(out_dir, BenchOptions(...)) -> report (JSON-able; :mod:`exporter.benchmark.report` draws it)
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from exporter.benchmark import report as R
from exporter.benchmark import systems as S
from exporter.benchmark.prompts import build_prompts
from exporter.errors import UserError

PEERS = ("genai", "hf", "optimum", "llamacpp")
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
    # our optimized precisions' default tree re-tuned for their own graphs, as `python -m exporter.optimize`
    # ships them (int4's best tree is far smaller than float32's): None (default) where there is a drafter
    # and no ``tree``; True: asked for (an error where nothing can be re-tuned); False: the export's tree
    tune: bool | None = None
    work: str | None = None  # keep peers' builds here (default: a temporary directory)
    logs: str | None = None  # the workers' and builds' logs (default: kept in a temporary directory on failure)
    # raw exports of the same base with other drafters: each runs as ours-spec-<kind> at every precision,
    # beside the main export's systems (Medusa against EAGLE-3 in one run)
    also: tuple = ()
    # more trees of the main export, each its own system ours-spec-<name> beside ours-spec at every precision:
    # ((name, tree), ...), e.g. DFlash's chain (ours-spec, the manifest's) and a top-k tree side by side
    also_trees: tuple = ()

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise UserError(msg)

        # every path resolved here: the workers run in another working directory, and a relative
        # --model-dir that is not a directory there was taken as a hub id (the network)
        for name in ("model_dir", "draft_model"):
            v = getattr(self, name)
            if v is not None:
                flag = "--" + name.replace("_", "-")
                need(Path(v).is_dir(), f"{flag} {v} is not a directory; pass a local Hugging Face model directory")
                setattr(self, name, str(Path(v).absolute()))
        self.also = tuple(str(Path(d).absolute()) for d in self.also)
        self.also_trees = tuple((str(n), t) for n, t in self.also_trees)
        names = [n for n, _ in self.also_trees]
        for n in names:
            need(n.replace("-", "").replace("_", "").isalnum() and names.count(n) == 1,
                 f"--also-tree {n}: a name is letters, digits, - or _, once each (the system is ours-spec-NAME)")
        for d in self.also:
            need((Path(d) / "manifest.json").is_file(), f"--also {d} is not an export directory (no manifest.json); "
                                                        f"pass a raw export of the same base with another drafter")
        for name in ("prompts_file", "work", "logs"):
            if getattr(self, name) is not None:
                setattr(self, name, str(Path(getattr(self, name)).absolute()))
        if self.optimum_python is not None and os.sep in self.optimum_python:
            self.optimum_python = str(Path(self.optimum_python).absolute())
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


def tunes(opts: BenchOptions, manifest) -> bool:
    """Whether this run re-tunes our optimized copies' trees (the report's ``settings.tune``): some
    precision is optimized, the export has a drafter, no ``tree`` fixes the tree, and not turned off."""
    return (opts.tune is not False and opts.tree is None and bool(manifest.drafter)
            and any(p != "fp32" for p in opts.precisions))


def check_writable(path, flag: str, *reads) -> None:
    """Fail before the run, not after it, if a report cannot be written where asked (or would land
    inside a directory the run reads): :func:`exporter.cli.check_output`."""
    from exporter.cli import check_output

    check_output(path, flag, *reads)


def raw_source(out_dir: Path, manifest, opts: BenchOptions, work: Path, log=print) -> Path:
    """What our variants are optimized from: the export itself, or, where it is optimized already (the
    main job's is), a raw export of ``--model-dir`` made here (the passes apply to the raw trace only)."""
    if not manifest.optimization or all(p == "fp32" for p in opts.precisions):
        return out_dir
    if not opts.model_dir:
        raise UserError(f"{out_dir} is optimized already, and --precisions {','.join(opts.precisions)} needs the raw "
                        f"trace to optimize from: pass --model-dir (bench re-exports it) or bench a raw export")
    from exporter.pipeline import export

    raw = work / "raw-export"
    if (raw / "manifest.json").is_file():
        log(f"  reusing the raw export {raw}")
        return raw
    log(f"  {out_dir} is optimized: re-exporting {opts.model_dir} raw -> {raw} (the variants' source)")
    export(opts.model_dir, raw, log=lambda *a, **k: None, overwrite=raw.exists())
    return raw


def plan(out_dir: Path, manifest, opts: BenchOptions, work: Path, log=print) -> list[S.System]:
    """The systems of this run, their models prepared (or the reason each is skipped)."""
    systems = []
    ours_base = {"runner": "ours", "threads": opts.threads, "load_options": opts.load_options}
    if opts.tune and not manifest.drafter:  # never silently ignored
        raise UserError(f"--tune: {out_dir} has no drafter, so there is no tree to re-tune; drop --tune")
    tune = tunes(opts, manifest)
    source = raw_source(out_dir, manifest, opts, work, log)
    for prec in opts.precisions:
        sfx = "" if prec == "fp32" else f"-{prec}"
        path, why = (out_dir, "") if prec == "fp32" else S.ours_variant(
            source, PRECISIONS[prec], work, log, tune=tune, threads=opts.threads)
        ar = S.System(f"ours-ar{sfx}", "ours", {**ours_base, "out_dir": str(path), "mode": "autoregressive"},
                      precision=prec)
        mine = [ar]
        if manifest.drafter:
            mine.append(S.System(f"ours-spec{sfx}", "ours", {**ours_base, "out_dir": str(path),
                                 "mode": "speculative", "tree": opts.tree}, precision=prec, must_equal=ar.name))
            mine += [S.System(f"ours-spec-{name}{sfx}", "ours", {**ours_base, "out_dir": str(path),
                              "mode": "speculative", "tree": tree}, precision=prec, must_equal=ar.name)
                     for name, tree in opts.also_trees]
        for s in mine:
            if not path:
                s.skip(why)
        systems += mine
        systems += _also_systems(opts, prec, ar.name, work, log, tune)
    peers = [p for p in opts.peers]
    if not peers:
        return systems
    names = {"genai": [f"genai{'' if p == 'fp32' else '-' + p}" for p in opts.precisions if p in GENAI_PRECISIONS],
             "hf": ["hf", "hf-pld"] + (["hf-assisted"] if opts.draft_model else []), "optimum": ["optimum"],
             "llamacpp": list(S.LLAMACPP_SPEC)}
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
            elif p == "llamacpp":  # the GGUF itself (its own quantization), by llama.cpp's llama-server
                spec, why2 = S.llamacpp_spec(n, Path(opts.model_dir), opts.threads, 4096, opts.prompt_lookup)
                s.spec.update(spec or {})
                model, s.precision = spec and spec["gguf"], "gguf"
                s.compare_to = "ours-ar" if n == "llamacpp" else "llamacpp"
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


def _also_systems(opts: BenchOptions, prec: str, ar_name: str, work: Path, log, tune: bool) -> list[S.System]:
    """``--also`` exports at one precision: ``ours-spec-<kind>`` beside the main export's ``ours-ar``
    (the same base, so the same greedy tokens; a divergence is judged by the rows contract)."""
    from graphs.manifest import Manifest

    sfx = "" if prec == "fp32" else f"-{prec}"
    out = []
    for d in opts.also:
        m = Manifest.read(Path(d))
        if not m.drafter:
            raise UserError(f"--also {d} has no drafter; pass an export with a drafter (its base is the main one's)")
        if m.optimization and prec != "fp32":
            raise UserError(f"--also {d} is optimized already and --precisions {prec} optimizes from the raw trace: "
                            f"pass a raw export (python -m exporter.export MODEL DIR)")
        path, why = (Path(d), "") if prec == "fp32" else S.ours_variant(
            Path(d), PRECISIONS[prec], work, log, tune=tune, threads=opts.threads)
        s = S.System(f"ours-spec-{m.drafter['kind']}{sfx}", "ours",
                     {"runner": "ours", "threads": opts.threads, "load_options": opts.load_options,
                      "out_dir": str(path), "mode": "speculative", "tree": None}, precision=prec, must_equal=ar_name)
        if not path:
            s.skip(why)
        out.append(s)
    return out


def _tree_sizes(kind: str, drafter: dict) -> list:
    """Trees of growing size for ``--sweep``: Medusa paths, EAGLE settings, or DFlash's: the chain cut to
    2 .. block nodes, then top-k trees of up to 4 blocks' nodes."""
    from graphs.trees import default_medusa_paths

    if kind == "dflash":
        b = int(drafter["block_size"])
        chains = sorted({min(n, b) for n in (2, 4, 8, b)})
        trees = [(k, t) for k, t in ((2, b), (4, b), (4, 2 * b), (4, 4 * b)) if t <= 64]
        return ([{"topk": 1, "total_tokens": n} for n in chains]
                + [{"topk": k, "total_tokens": t} for k, t in trees])

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
    # verified before anything of it is used (the tokenizer, its chat template): hashed once, then
    # the proof record stands in for the workers' own checks
    manifest = Manifest.read(out_dir, verify=True)
    tokenizer = Tokenizer.from_file(str(out_dir / manifest.tokenizer)) if manifest.tokenizer else None
    prompts = build_prompts(out_dir, tokenizer, opts.prompts_file, opts.prompts, opts.seed,
                            manifest.source["vocab_size"],
                            frozenset(manifest.generation.get("eos_token_ids") or []) | {0})
    own_work, own_logs = opts.work is None, opts.logs is None
    work = Path(tempfile.mkdtemp(prefix="bench-")) if own_work else Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-")) if own_logs else Path(opts.logs)
    logs.mkdir(parents=True, exist_ok=True)
    report = None
    try:
        report = _bench(out_dir, manifest, prompts, opts, work, logs, log)
    finally:
        for f in sorted(work.rglob("*.log")):  # the builds' logs (peers' models), beside the workers'
            if f.is_file() and not f.is_symlink():
                shutil.copyfile(f, logs / f.name)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
        # our own temporary: removed when nothing failed or was skipped (every reason printed names a
        # log in it, so it stays whenever there is a reason to read)
        unread = report is not None and (report["failed"] or any(e.get("reason") for e in report["systems"]))
        if own_logs and report is not None and not unread:
            shutil.rmtree(logs, ignore_errors=True)
    report["logs"] = str(logs) if (unread or not own_logs) else None
    for e in report["systems"]:
        if e.get("reason"):
            e["reason"] = e["reason"].replace(str(work), str(logs))
    return report


def _fail_early(systems, logs: Path) -> None:
    """Our own systems failing to start is the user's input (a bad --tree or --load-option, a variant the
    optimize stage refuses, ...), whatever the precision: one line naming it and the worker's log, before
    any run (a skipped ours-ar-int4 used to leave bench at exit 0)."""
    for s in systems:
        if s.family == "ours" and s.status in ("failed", "skipped"):
            reason = (s.reason or "").strip().splitlines()
            log_file = logs / (s.name + ".log")
            where = f"worker log: {log_file}" if log_file.is_file() else "no worker was started"
            raise UserError(f"{s.name} could not start: {reason[0] if reason else 'no reason given'} ({where})")


def check_ours(out_dir: Path, tree=None, load_options: dict | None = None) -> None:
    """``--tree`` and ``--load-option`` against the export, in this process (``bench --variants`` checks
    them before it prepares any variant, instead of failing after the optimize runs): one UserError
    naming the flag."""
    import inspect

    import graphs
    from graphs.errors import InputError

    options = dict(load_options or {})
    accepted = set(inspect.signature(graphs.load).parameters) - {"out_dir"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise UserError(f"--load-option {unknown[0]}: graphs.load() takes no {unknown[0]}; drop it (accepted: "
                        f"{', '.join(sorted(accepted))})")
    try:
        dec = graphs.load(out_dir, provider="cpu", threads=1, **options)
    except InputError as e:
        raise UserError(f"--load-option {', '.join(options) or '(none)'}: {e}") from None
    if tree is not None:
        try:
            dec.generate([1], max_new_tokens=1, tree=tree, mode="speculative")
        except InputError as e:
            raise UserError(f"--tree: {e}") from None


def _bench(out_dir, manifest, prompts, opts: BenchOptions, work: Path, logs: Path, log) -> dict:
    t_start = time.perf_counter()
    log(f"measuring copy bandwidth ({opts.threads or os.cpu_count()} threads)")
    bandwidth = R.copy_bandwidth(opts.threads)
    log("planning systems")
    systems = plan(out_dir, manifest, opts, work, log)
    try:
        # ours first: failing to start is the user's input (_fail_early), said before any peer starts
        for s in sorted(systems, key=lambda s: s.family != "ours"):
            log(f"  starting {s.name}")
            S.start(s, logs, log)
            if s.status == "ok":  # warm-up: first runs allocate
                S.run(s, _request(prompts[0].ids, opts, 8, None))
            if s.status != "ok":
                log(f"  {s.name}: {s.status}: {s.reason}")
            if s.family == "ours":
                _fail_early([s], logs)
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
    entries = [R.summarize(s, n_tokens, bandwidth, [p.category for p in prompts]) for s in systems]
    ok = {e["name"] for e in entries if e["status"] == "ok"}
    anchor = next((a for a in ("genai", "ours-ar") if a in ok), None)
    R.speedups(entries, [a for a in ("genai", "ours-ar", "ours-ar-opt", "genai-int4", "ours-ar-int4", "hf") if a in ok])
    # the prompts' ids: a must_equal pair that differs is judged by its graphs' rows contract, with the
    # base's top-2 margin at each divergence (report.greedy_check)
    greedy = (R.greedy_check(systems, len(prompts), prompts=[p.ids for p in prompts], threads=opts.threads or 1)
              if opts.temperature == 0 else [])
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
                     "precisions": list(opts.precisions), "tune": tunes(opts, manifest),
                     "load_options": opts.load_options,
                     "drafter": manifest.drafter["kind"] if manifest.drafter else None,
                     "tree": opts.tree or manifest.tree},
        "anchor": anchor,
        "systems": entries,
        "greedy": greedy if opts.temperature == 0 else "not checked: sampling (temperature > 0)",
        "failed": [e["name"] for e in entries if e["status"] == "failed"],
        "greedy_mismatches": R.greedy_failures(greedy),
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
    kind = manifest.drafter["kind"]
    default = manifest.tree.get("medusa_paths" if kind == "medusa" else kind)
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
