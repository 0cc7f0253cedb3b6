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


def _acceptance(runs: list, with_speed: bool = True) -> dict:
    """tau (tokens per base forward), acceptance per draft position (the share of drafted steps that
    accepted more than k drafts), and decode tokens/s of ``runs``."""
    out: dict = {}
    accepted = [a for r in runs for a in r.get("accepted") or []]
    if accepted:
        out["mean_accepted_length"] = float(np.mean(accepted))
    steps = sum(r.get("speculative_steps", 0) for r in runs)
    per_pos = [r.get("accepted_per_pos") or [] for r in runs]
    if steps:
        width = max(map(len, per_pos))
        out["acceptance_per_position"] = [sum(p[k] for p in per_pos if k < len(p)) / steps for k in range(width)]
    if with_speed:
        decode_s = sum(r["decode_s"] for r in runs)
        tokens = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
        out["decode_tokens_per_s"] = tokens / decode_s if decode_s > 0 else 0.0
        out["runs"] = len(runs)
    return out


def summarize(system, prompts_tokens: list[int], bandwidth: float | None, categories: list[str] | None = None) -> dict:
    """One system's entry of the report (status and reason only, if it did not run).

    ``categories``: each prompt's category; where the prompts have them, ``by_category`` gives each
    one's tokens/s and, for speculative systems, tau and acceptance per draft position."""
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
    if categories and any(categories):
        entry["by_category"] = {c: _acceptance([r for r in runs if categories[r["_prompt"]] == c])
                                for c in sorted(set(categories))}
    entry.update(_acceptance(runs, with_speed=False))
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


def greedy_check(systems: list, n_prompts: int, prompts: list | None = None, threads: int = 1) -> list[dict]:
    """Compare greedy tokens prompt by prompt: each system against ``must_equal`` (a mismatch is an
    error: same graphs, lossless decoding) and ``compare_to`` (reported only: other numerics).

    Returns one row per compared pair: prompts equal, compared, and the first divergence. With
    ``prompts`` (each prompt's token ids), a ``must_equal`` pair that differs is judged by its graphs'
    rows contract (:func:`rows_contract`) and its row gains ``contract``, ``divergences`` (each
    divergent prompt's first differing token, both tokens, and the top-2 margin of the base's logits
    there: :func:`base_margin`) and ``violations`` (the divergences the contract does not explain:
    every one under the exact contract; under the recorded bound, those whose margin exceeds twice
    the bound). :func:`greedy_lines` prints them, :func:`greedy_failures` counts what fails."""
    by_name = {s.name: s for s in systems}
    rows = []
    margins: dict = {}  # out_dir -> decoder, made once per graph set
    for s in systems:
        for ref_name, must in ((s.must_equal, True), (s.compare_to, False)):
            ref = by_name.get(ref_name)
            if ref is None or s.status != "ok" or ref.status != "ok":
                continue
            mine, theirs = _first_tokens(s, n_prompts), _first_tokens(ref, n_prompts)
            equal, compared, first, parted = 0, 0, None, []
            for i in range(n_prompts):
                if i not in mine or i not in theirs:
                    continue
                compared += 1
                a, b = mine[i], theirs[i]
                if a == b:
                    equal += 1
                    continue
                at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                parted.append((i, at, a, b))
                if first is None:
                    first = {"prompt": i, "token_index": at}
            row = {"system": s.name, "reference": ref_name, "must_equal": must, "prompts_equal": equal,
                   "prompts_compared": compared, "first_mismatch": first}
            if must and parted and prompts is not None:
                row.update(_judge(ref, parted, prompts, margins, threads))
            rows.append(row)
    return rows


def rows_contract(out_dir) -> dict | None:
    """The rows contract an export's graphs keep (``exporter.optimizing.set_contract``): ``{"kind":
    "exact" | "recorded bound", "bound": rows_max_abs, "limit": the gate's limit}``, from its manifest.
    An export without a rows record (raw, or optimized without validation) is held to the exact
    contract with bound 0. None where the manifest cannot be read."""
    from graphs.manifest import Manifest

    try:
        m = Manifest.read(out_dir, verify=False)
    except Exception:  # a peer's directory, a removed work copy: no contract to apply
        return None
    bound = float((m.optimization.get("base") or {}).get("rows_max_abs", 0.0))
    rows = ((m.validation or {}).get("optimize") or {}).get("rows") or {}
    limit = float(rows.get("limit", 1e-4))
    return {"kind": "exact" if bound <= limit else "recorded bound", "bound": bound, "limit": limit}


def base_margin(decoder, ids: list[int]) -> dict:
    """The top-2 of the base's logits for the token after ``ids``: one causal prefill through the
    decoder's base graph (the autoregressive step's logits are within the graphs' recorded bound of
    these). Returns ``{"margin": top1 - top2, "top2": [top1 id, top2 id]}``."""
    from graphs.slots import SlotCache

    src = decoder.manifest.source
    n = len(ids)
    kv = SlotCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], decoder.dtype, n,
                   layout=decoder.kv_layout)
    kv.add_row()
    out = decoder.base_forward(kv, np.array([ids], dtype=np.int64), np.arange(n)[None],
                               np.tril(np.ones((1, n, n), dtype=bool)))
    last = out["logits"][0, -1].astype(np.float64)
    top = np.argsort(last)[-2:][::-1]
    return {"margin": float(last[top[0]] - last[top[1]]), "top2": [int(top[0]), int(top[1])]}


def _judge(ref, parted: list, prompts: list, decoders: dict, threads: int) -> dict:
    """Each divergence of a ``must_equal`` pair against the reference graphs' rows contract."""
    from exporter.optimizing import within_bound

    out_dir = (ref.spec or {}).get("out_dir")
    contract = rows_contract(out_dir) if out_dir else None
    divergences, violations = [], 0
    for i, at, mine, theirs in parted:
        d = {"prompt": i, "token_index": at, "token": mine[at] if at < len(mine) else None,
             "reference_token": theirs[at] if at < len(theirs) else None, "margin": None, "top2": None,
             "within_bound": False}
        if contract is not None and d["token"] is not None and d["reference_token"] is not None:
            try:
                if out_dir not in decoders:
                    import graphs

                    decoders[out_dir] = graphs.load(out_dir, provider="cpu", threads=threads, adaptive=False)
                d.update(base_margin(decoders[out_dir], list(prompts[i]) + list(theirs[:at])))
            except Exception as e:  # reported, never fatal: the divergence stays unexplained
                d["margin_error"] = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if d["margin"] is not None and contract["kind"] == "recorded bound":
            d["within_bound"] = within_bound(d["margin"], contract["bound"])
        violations += not d["within_bound"]
        divergences.append(d)
    return {"contract": contract, "divergences": divergences, "violations": violations}


def greedy_failures(rows: list[dict]) -> int:
    """The compared pairs that fail: a ``must_equal`` pair with a divergence its contract does not
    explain (without a contract judged, i.e. no ``violations`` key: any divergence)."""
    return sum(1 for g in rows if g["must_equal"]
               and g.get("violations", g["prompts_compared"] - g["prompts_equal"]) > 0)


def greedy_lines(g: dict) -> list[str]:
    """The printed lines of one greedy row: equal, or a mismatch with, where it was judged, the
    contract and at each divergence the base's top-2 margin against twice the recorded bound (a near
    tie the calls' rounding may resolve either way, or a bug)."""
    pair = f"{g['system']} vs {g['reference']}"
    n, equal = g["prompts_compared"], g["prompts_equal"]
    if equal == n:
        return [f"greedy tokens equal: {g['system']} = {g['reference']} on {n} prompts"]
    first = g["first_mismatch"]
    where = f"(first at prompt {first['prompt']}, token {first['token_index']})"
    if not g["must_equal"]:
        return [f"note: greedy tokens differ: {pair} on {n - equal}/{n} prompts {where}"]
    if "divergences" not in g:
        return [f"GREEDY MISMATCH: {pair} on {n - equal}/{n} prompts {where}"]
    c = g["contract"]
    if c is None:
        terms = "no rows contract recorded"
    elif c["kind"] == "exact":
        terms = f"exact contract: rows bound {c['bound']:.3g} <= limit {c['limit']:g}"
    else:
        terms = (f"recorded-bound contract: rows bound {c['bound']:.3g} logits > limit {c['limit']:g}, so a "
                 f"divergence is allowed where the base's top-2 margin <= {2 * c['bound']:.3g}")
    head = ("GREEDY MISMATCH" if g["violations"] else "greedy tokens differ within the recorded bound")
    lines = [f"{head}: {pair} on {n - equal}/{n} prompts ({terms})"]
    for d in g["divergences"]:
        at = f"  prompt {d['prompt']}, token {d['token_index']}: {d['token']} vs {d['reference_token']}"
        if d["margin"] is None:
            why = d.get("margin_error", "one output ended first" if d["token"] is None or
                        d["reference_token"] is None else "no contract to judge it by")
            lines.append(f"{at}; the base's top-2 margin unknown ({why}): not explained")
            continue
        tie = set(d["top2"]) == {d["token"], d["reference_token"]}
        which = "the two tokens" if tie else f"tokens {d['top2'][0]} and {d['top2'][1]}"
        verdict = ("a near tie within the recorded bound" if d["within_bound"] else
                   "beyond the recorded bound: a bug" if c and c["kind"] == "recorded bound" else
                   "the exact contract allows none: a bug")
        lines.append(f"{at}; the base's top-2 margin there {d['margin']:.3g} logits ({which}): {verdict}")
    return lines


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


def category_lines(report: dict) -> list[str]:
    """tau and acceptance per draft position by prompt category, one line per (speculative system,
    category); tokens/s per category for every system that ran."""
    out = []
    for e in report["systems"]:
        cats = e.get("by_category") or {}
        for c, a in cats.items():
            tau = a.get("mean_accepted_length")
            pos = a.get("acceptance_per_position")
            out.append(f"{e['name']:>16} {c:>14}: {a['decode_tokens_per_s']:7.1f} tok/s"
                       + (f" | tau {tau:.2f}" if tau and tau > 1.001 else "")
                       + (" | accepted per position " + " ".join(f"{x:.2f}" for x in pos) if pos else ""))
    return out


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
