"""Raw float32 vs fused float32 vs int8 vs int4, side by side in one run (``bench --variants``).

    python -m exporter.bench out_dir --variants raw,fused,int8,int4 [--json v.json] [--png v.png]

Copies the (raw) export once per variant into a scratch directory beside it, optimizes each copy
(:func:`exporter.pipeline.optimize_export`), then measures, interleaving the variants so that
machine noise hits them alike:

- verify latency of the base graph at 1, 8, 16 and 32 tree tokens over a 256-token past (random
  non-causal tree masks, batch 1; median of ``repeats`` x 10 runs), and each size's cost relative
  to one token (the number that decides the best tree);
- end to end, when the export has a drafter: tokens/s autoregressive and speculative with the
  default tree (:func:`exporter.benchmark.run.bench`: same prompts, greedy outputs checked equal), and with
  ``sweep`` the best tree of ``exporter.bench``'s sweep per variant; with ``tune`` each variant's
  default tree is first re-tuned for its own graphs (:func:`exporter.pipeline.tune_export`, as
``exporter.optimize`` does).

The scratch copies are deleted afterwards unless ``keep``. JSON-able report; :func:`draw` plots it.
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from exporter.errors import UserError

VARIANTS: dict[str, dict] = {
    "raw": {},  # the export as traced
    "fused": {"quantize": "none"},
    "int8": {"quantize": "int8"},  # optimize's default: accuracy level 4 behind its rows gate
    "int4": {"quantize": "int4"},
    # float32 compute (accuracy level 0): row-consistent on every CPU, slower
    "int8-exact": {"quantize": "int8", "accuracy_level": 0},
    "int4-exact": {"quantize": "int4", "accuracy_level": 0},
    # the concatenating K/V form optimize wrote before K/V in place (for side-by-side runs)
    "fused-concat": {"quantize": "none", "kv_in_place": False},
    # the compact 3-D K/V layout (genai's; fewer nodes, the slower attention per cached token)
    "fused-bsh": {"quantize": "none", "kv_layout": "bsh"},
    # the in-place base alone (no one-sequence GroupQueryAttention graph): every call ONNX Attention
    "fused-attention": {"quantize": "none", "one_sequence_graph": False},
}
TREE_TOKENS = (1, 8, 16, 32)


def prepare(out_dir: Path, names: list[str], work: Path, log=print, tune: bool = False,
            threads: int | None = None) -> dict[str, Path]:
    """One optimized copy of ``out_dir`` per variant under ``work`` (:func:`exporter.pipeline.prepare_variants`)."""
    from exporter.pipeline import prepare_variants

    return prepare_variants(out_dir, {n: VARIANTS[n] for n in names}, work, log, tune=tune, threads=threads)


def verify_latency(dirs: dict[str, Path], tree_tokens=TREE_TOKENS, past: int = 256, repeats: int = 5,
                   runs: int = 10, threads: int | None = None) -> dict:
    """{variant: {tokens: median ms}} of the base graph, variants interleaved."""
    from exporter.passes.parity import Case, random_feed
    from graphs.manifest import Manifest
    from graphs.sessions import InPlaceRun, make_session

    calls, feeds = {}, {}
    for name, d in dirs.items():
        m = Manifest.read(d, verify=False)
        spec = m.graphs["base"]
        file = m.one_sequence_file or spec.file  # batch 1: the graph the runtime calls
        calls[name] = InPlaceRun.caller(make_session(d / file, "cpu", threads), spec)  # as the runtime calls it
        feeds[name] = {t: random_feed(spec, Case("t", 1, t, past), seed=t, vocab=m.source["vocab_size"])
                       for t in tree_tokens}
    times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in tree_tokens} for n in dirs}
    for name, call in calls.items():  # warm-up
        call(feeds[name][tree_tokens[0]])
    for _ in range(repeats):
        for t in tree_tokens:
            for name, call in calls.items():
                for _ in range(runs):
                    t0 = time.perf_counter()
                    call(feeds[name][t])
                    times[name][t].append(time.perf_counter() - t0)
    out = {}
    for name in dirs:
        ms = {t: float(np.median(times[name][t])) * 1e3 for t in tree_tokens}
        out[name] = {"ms": {str(t): v for t, v in ms.items()},
                     "relative_to_1": {str(t): v / ms[tree_tokens[0]] for t, v in ms.items()}}
    return out


def end_to_end(dirs: dict[str, Path], max_new_tokens: int, repeats: int, prompts: int, threads: int | None,
               sweep: bool, log=print, *, tree=None, load_options: dict | None = None,
               prompts_file: str | None = None, logs: str | None = None) -> dict:
    """tokens/s autoregressive and speculative per variant: :func:`exporter.benchmark.run.bench` (its systems
    ours-ar and ours-spec, each in its own process, same prompts, greedy outputs checked equal) on
    each variant's export; with ``sweep`` its tree sweep too (the default tree beside hand-picked ones)."""
    from exporter.benchmark.run import BenchOptions, bench
    from graphs.manifest import Manifest

    out = {}
    for name, d in dirs.items():
        opts = BenchOptions(prompts=prompts, repeats=repeats, max_new_tokens=max_new_tokens, threads=threads,
                            peers=(), sweep=sweep, tree=tree, load_options=dict(load_options or {}),
                            prompts_file=prompts_file, logs=str(Path(logs) / name) if logs else None)
        r = bench(d, opts, log=lambda *a, **k: None)
        by = {e["name"]: e for e in r["systems"]}
        ar, spec = by.get("ours-ar", {}), by.get("ours-spec", {})
        if ar.get("status") != "ok" or spec.get("status") != "ok":  # the logs are kept (bench: on failure)
            raise UserError(f"variant {name}: the bench did not run ({ar.get('reason') or spec.get('reason')}; "
                            f"worker logs: {r['logs']})")
        row = {"autoregressive_tokens_per_s": ar["decode_tokens_per_s"],
               "speculative_tokens_per_s": spec["decode_tokens_per_s"],
               "speedup": spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"],
               "mean_accepted_length": spec["mean_accepted_length"],
               "greedy_mismatches": r["greedy_mismatches"], "tree": Manifest.read(d, verify=False).tree}
        log(f"  {name:6} autoregressive {row['autoregressive_tokens_per_s']:7.1f} tok/s | speculative "
            f"{row['speculative_tokens_per_s']:7.1f} tok/s | {row['speedup']:.2f}x | tau "
            f"{row['mean_accepted_length']:.2f}" + (f" | {r['greedy_mismatches']} MISMATCHES"
                                                   if r["greedy_mismatches"] else ""), flush=True)
        if sweep and r.get("sweep"):
            row["sweep"] = r["sweep"]
            best = max(r["sweep"], key=lambda x: x["speedup"])
            row["best_tree"] = best
            log(f"  {name:6} best tree size {best['tree_size']}{' (the default)' if best.get('default') else ''}: "
                f"{best['decode_tokens_per_s']:.1f} tok/s ({best['speedup']:.2f}x)", flush=True)
        out[name] = row
    return out


def run_variants(out_dir, names=("raw", "fused", "int8", "int4"), *, tree_tokens=TREE_TOKENS, past: int = 256,
                 max_new_tokens: int = 64, repeats: int = 2, prompts: int = 4, threads: int | None = None,
                 e2e: bool = True, sweep: bool = False, tune: bool = False, keep: bool = False,
                 tree=None, load_options: dict | None = None, prompts_file: str | None = None,
                 logs: str | None = None, log=print) -> dict:
    """Measure ``names`` (keys of :data:`VARIANTS`) of the raw export ``out_dir``; returns the report.

    ``tree``, ``load_options``, ``prompts_file``: the end-to-end runs' (bench's ``--tree``,
    ``--load-option``, ``--prompts-file``), checked against the raw export before any variant is
    prepared; ``logs``: keep the workers' logs there (one directory per variant)."""
    from exporter.benchmark.run import check_ours
    from graphs.manifest import Manifest

    out_dir = Path(out_dir).absolute()
    names = list(names)
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise UserError(f"unknown variant(s) {bad}; accepted: {', '.join(VARIANTS)}")
    manifest = Manifest.read(out_dir, verify=True)  # a tampered file named in the user's export, not a copy's
    prompts_file = str(Path(prompts_file).absolute()) if prompts_file else None
    logs = str(Path(logs).absolute()) if logs else None
    if e2e and manifest.drafter:
        check_ours(out_dir, tree, load_options)  # before the optimize runs, not after them
    elif tree is not None or load_options:
        raise UserError(f"--tree and --load-option apply to the end-to-end runs, and {out_dir} has no drafter: "
                        f"drop them")
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.variants-", dir=out_dir.parent))
    t0 = time.perf_counter()
    try:
        dirs = prepare(out_dir, names, work, log, tune=tune and e2e, threads=threads)
        log(f"verify latency (past {past}, tree tokens {', '.join(map(str, tree_tokens))}) ...", flush=True)
        lat = verify_latency(dirs, tree_tokens, past, threads=threads)
        for n, r in lat.items():
            log(f"  {n:6} " + "  ".join(f"{t:>2} tok {ms:7.2f} ms ({r['relative_to_1'][t]:.2f}x)"
                                        for t, ms in r["ms"].items()), flush=True)
        report = {"out_dir": str(out_dir), "variants": names, "past": past, "threads": threads,
                  "machine": platform.processor() or platform.machine(), "verify_latency": lat}
        base = lat.get("raw")
        if base:
            report["speedup_vs_raw"] = {n: {t: base["ms"][t] / r["ms"][t] for t in r["ms"]} for n, r in lat.items()}
        if e2e and manifest.drafter:
            log(f"end to end ({prompts} prompts x {repeats}, {max_new_tokens} new tokens) ...", flush=True)
            report["end_to_end"] = end_to_end(dirs, max_new_tokens, repeats, prompts, threads, sweep, log, tree=tree,
                                              load_options=load_options, prompts_file=prompts_file, logs=logs)
        report["sizes_bytes"] = {n: sum(f.stat().st_size for f in d.rglob("*.onnx*")) for n, d in dirs.items()}
        report["seconds"] = time.perf_counter() - t0
        return report
    finally:
        if keep:
            log(f"variant exports kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def draw(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e2e = report.get("end_to_end")
    fig, axes = plt.subplots(1, 2 if e2e else 1, figsize=(11 if e2e else 5.5, 4))
    axes = np.atleast_1d(axes)
    for name, r in report["verify_latency"].items():
        ts = [int(t) for t in r["ms"]]
        axes[0].plot(ts, list(r["ms"].values()), "o-", label=name)
    axes[0].set_xlabel("tree tokens verified in one call")
    axes[0].set_ylabel("base graph latency (ms)")
    axes[0].set_title(f"verify latency, past {report['past']}")
    axes[0].legend()
    if e2e:
        names = list(e2e)
        x = np.arange(len(names))
        axes[1].bar(x - 0.2, [e2e[n]["autoregressive_tokens_per_s"] for n in names], 0.4, label="autoregressive")
        axes[1].bar(x + 0.2, [e2e[n]["speculative_tokens_per_s"] for n in names], 0.4, label="speculative")
        axes[1].set_xticks(x, names)
        axes[1].set_ylabel("tokens/s")
        axes[1].set_title("end to end (default tree)")
        axes[1].legend()
    fig.suptitle(report["out_dir"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
