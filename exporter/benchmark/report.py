"""From workers' replies to the report: per-system numbers, greedy checks, bandwidth, JSON and PNG.

Definitions (the same for every system):
- prefill tokens/s = prompt tokens / time until the first new token is known;
- decode tokens/s = (new tokens - 1) / the rest of the time (the first token comes from the prefill);
- end-to-end tokens/s = new tokens / (prefill + decode);
- mean accepted length = tokens emitted per base forward after the prefill, with its histogram;
- bytes per token = (base weight bytes x base forwards + drafter bytes x drafter calls) / decode
  tokens: each forward streams every weight once;
- bandwidth fraction = bytes per token x decode tokens/s / the machine's measured read bandwidth
  (a multi-threaded copy, counted as read + write). Above 1.0 means the system decodes faster than
  one forward per token could: speculation's whole point.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SCHEMA = "specexport.bench/2"


def copy_bandwidth(threads: int | None = None, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by copying a ``mib`` MiB array in ``threads`` chunks (read + write).

    numpy's copy releases the GIL, so the threads copy in parallel like ORT's intra-op pool reads
    weights; best of ``repeats``."""
    import os

    n = threads or os.cpu_count() or 1
    src = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    chunks = np.array_split(np.arange(src.size), n)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.size]
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def summarize(system, prompts_tokens: list[int], bandwidth: float | None) -> dict:
    """One system's entry of the report (status and reason only, if it did not run)."""
    entry = {"name": system.name, "family": system.family, "precision": system.precision, "status": system.status,
             "reason": system.reason or None, "peak_rss_bytes": system.peak_rss_bytes,
             "weight_bytes": system.info.get("weight_bytes"), "draft_bytes": system.info.get("draft_bytes"),
             "info": system.info}
    runs = [r for r in system.runs if r is not None]
    if system.status != "ok" or not runs:
        return entry
    new = sum(len(r["tokens"]) for r in runs)
    decode_tokens = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
    prefill_s = sum(r["prefill_s"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    prompt_tokens = sum(prompts_tokens[r["_prompt"]] for r in runs)
    accepted = [a for r in runs for a in r.get("accepted") or []]
    forwards = sum(r.get("forwards", 0) for r in runs)
    draft_calls = sum(r.get("draft_calls", 0) for r in runs)
    decode_tps = decode_tokens / decode_s if decode_s > 0 else 0.0
    entry.update({
        "runs": len(runs),
        "new_tokens": new,
        "prefill_tokens_per_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_tokens_per_s": decode_tps,
        "e2e_tokens_per_s": new / (prefill_s + decode_s) if prefill_s + decode_s > 0 else 0.0,
        "mean_accepted_length": float(np.mean(accepted)) if accepted else None,
        "accepted_histogram": np.bincount(accepted).tolist() if accepted else [],
        "base_forwards": forwards,
        "draft_calls": draft_calls,
        # after each run the bench waits for the worker's threads to go idle (systems.Worker.settle)
        "settle_ms_median": float(np.median(system.settle_s)) * 1e3 if system.settle_s else None,
        "time_split": None,
    })
    if all("verify_s" in r for r in runs) and decode_s > 0:
        draft = sum(r["draft_s"] for r in runs)
        verify = sum(r["verify_s"] for r in runs)
        entry["time_split"] = {"draft": draft / decode_s, "verify": verify / decode_s,
                               "host": max(0.0, 1 - (draft + verify) / decode_s)}
    wb, db = entry["weight_bytes"] or 0, entry["draft_bytes"] or 0
    if decode_tokens and wb:
        per_token = (wb * forwards + db * draft_calls) / decode_tokens
        entry["bytes_per_token"] = per_token
        entry["bandwidth_fraction"] = per_token * decode_tps / bandwidth if bandwidth else None
    return entry


def greedy_check(systems: list, n_prompts: int) -> list[dict]:
    """Compare greedy tokens prompt by prompt: each system against ``must_equal`` (a mismatch is an
    error: same graphs, lossless decoding) and ``compare_to`` (reported only: other numerics).

    Returns one row per compared pair: prompts equal, compared, and the first divergence."""
    by_name = {s.name: s for s in systems}
    rows = []
    for s in systems:
        for ref_name, must in ((s.must_equal, True), (s.compare_to, False)):
            ref = by_name.get(ref_name)
            if ref is None or s.status != "ok" or ref.status != "ok":
                continue
            mine, theirs = _first_tokens(s, n_prompts), _first_tokens(ref, n_prompts)
            equal, compared, first = 0, 0, None
            for i in range(n_prompts):
                if i not in mine or i not in theirs:
                    continue
                compared += 1
                a, b = mine[i], theirs[i]
                if a == b:
                    equal += 1
                elif first is None:
                    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    first = {"prompt": i, "token_index": at}
            rows.append({"system": s.name, "reference": ref_name, "must_equal": must, "prompts_equal": equal,
                         "prompts_compared": compared, "first_mismatch": first})
    return rows


def _first_tokens(system, n_prompts: int) -> dict[int, list[int]]:
    """Tokens of the first run of each prompt (repeats of a greedy run are identical by construction)."""
    out = {}
    for r in system.runs:
        if r is not None and r["_prompt"] not in out:
            out[r["_prompt"]] = r["tokens"]
    return out


def speedups(entries: list[dict], anchors: list[str]) -> None:
    """Add ``speedup_vs``: decode tokens/s over each anchor's (that ran), in place."""
    by = {e["name"]: e for e in entries if e.get("decode_tokens_per_s")}
    for e in entries:
        if e.get("decode_tokens_per_s"):
            e["speedup_vs"] = {a: e["decode_tokens_per_s"] / by[a]["decode_tokens_per_s"] for a in anchors if a in by}


def line(e: dict, anchor: str | None = None) -> str:
    """One printed line per system: speedups over the anchor and over our autoregressive run of its precision."""
    if e["status"] != "ok":
        return f"{e['name']:>16}: {e['status'].upper()}: {e['reason']}"
    tau = e.get("mean_accepted_length")
    split = e.get("time_split")
    bw = e.get("bandwidth_fraction")
    rss = e.get("peak_rss_bytes")
    own = "ours-ar" + ("" if e["precision"] == "fp32" else "-" + e["precision"])
    sp = " ".join(f"{v:.2f}x vs {k}" for k, v in (e.get("speedup_vs") or {}).items()
                  if k != e["name"] and k in (anchor, own))
    return (f"{e['name']:>16}: decode {e['decode_tokens_per_s']:7.1f} tok/s | prefill {e['prefill_tokens_per_s']:7.0f}"
            f" tok/s | e2e {e['e2e_tokens_per_s']:7.1f} tok/s"
            + (f" | tau {tau:.2f}" if tau else "")
            + (f" | draft {split['draft']:.0%} verify {split['verify']:.0%} host {split['host']:.0%}" if split else "")
            + (f" | {bw:.0%} of bandwidth" if bw is not None else "")
            + (f" | RSS {rss / 2**20:.0f} MiB" if rss else "")
            + (f" | {sp}" if sp else ""))


def draw(report: dict, path) -> None:
    """One figure: decode speed per system (bars, annotated with τ and speedup over the anchor),
    acceptance histograms of the speculative systems, and the sweep if there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#4477aa", "genai": "#cc6677", "hf": "#228833", "optimum": "#ccbb44"}
    ok = [e for e in report["systems"] if e["status"] == "ok"]
    sweep = report.get("sweep")
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 12, 0.45 * max(len(ok), 4) + 2.2))
    ax = axes[0]
    names = [e["name"] for e in ok][::-1]
    vals = [e["decode_tokens_per_s"] for e in ok][::-1]
    ax.barh(names, vals, color=[colors.get(e["family"], "gray") for e in ok][::-1])
    anchor = report.get("anchor")
    for y, e in enumerate(ok[::-1]):
        label = f" {e['decode_tokens_per_s']:.0f}"
        if anchor and anchor in (e.get("speedup_vs") or {}):
            label += f"  ({e['speedup_vs'][anchor]:.2f}x)"
        if e.get("mean_accepted_length") and e["mean_accepted_length"] > 1.001:
            label += f"  τ {e['mean_accepted_length']:.2f}"
        ax.text(e["decode_tokens_per_s"], y, label, va="center", fontsize=8)
    ax.set_xlim(0, max(vals or [1]) * 1.45)
    ax.set_xlabel("decode tokens/s" + (f" (speedup vs {anchor})" if anchor else ""))
    skipped = [e["name"] for e in report["systems"] if e["status"] != "ok"]
    ax.set_title("speed, same prompts and budget" + (f"\nnot run: {', '.join(skipped)}" if skipped else ""),
                 fontsize=9)
    ax = axes[1]
    drawn = 0
    for e in ok:
        hist = np.asarray(e.get("accepted_histogram") or [], dtype=float)
        if e.get("mean_accepted_length") and e["mean_accepted_length"] > 1.001 and hist.sum():
            # a color and marker per line: several systems of one family (ours-spec, -opt, -int4) share a panel
            ax.plot(range(len(hist)), hist / hist.sum(), "os^Dv<>p"[drawn % 8] + "-", color=f"C{drawn % 10}",
                    label=f"{e['name']} (τ {e['mean_accepted_length']:.2f})", alpha=0.85)
            drawn += 1
    ax.set_xlabel("tokens accepted per base forward")
    ax.set_ylabel("share of steps")
    ax.set_title("acceptance")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if sweep:
        ax = axes[2]
        for r in sweep:  # the export's default (tuned) tree, run beside the hand-picked ones
            if r.get("default"):
                ax.plot([r["tree_size"]], [r["speedup"]], "*", ms=14, color="crimson",
                        label="default tree" + (" (tuned)" if r.get("tuned") else ""))
        sweep = [r for r in sweep if not r.get("default")]
        sizes = [r["tree_size"] for r in sweep]
        ax.plot(sizes, [r["speedup"] for r in sweep], "o-", color=colors["ours"], label="ours-spec / ours-ar")
        ax.axhline(1.0, ls="--", color="gray")
        for x, r in zip(sizes, sweep):
            ax.annotate(f"τ {r['mean_accepted_length']:.2f}", (x, r["speedup"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xlabel("tree size (tokens verified per step)")
        ax.set_ylabel("speedup over autoregressive (run beside it)")
        ax.set_title("where the tree pays")
        ax.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"{report['out_dir']} | {s['prompts']} prompts x {s['repeats']} | {s['max_new_tokens']} new tokens | "
                 f"T={s['temperature']} | {s['threads'] or 'all'} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
