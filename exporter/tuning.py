"""The tune stage: measure the draft trees of an export on the machine at hand and pick the fastest.

Measures through the runtime's decoder (:mod:`graphs.runtime`); writes nothing: the pipeline
(:func:`exporter.pipeline.tune_export`) bakes a new winner, records it and writes through the writer.

1. verify cost: an n-node verify for n = 1..N after a real prompt, on the engine's own bound calls,
   sizes taking turns, each after untimed calls of its own size (:func:`measure_verify`);
2. acceptance on calibration prompts (greedy, so every run sees the same text):
   Medusa: per-head, per-rank accuracy of the heads' top-k against the base's own continuation;
   EAGLE: for each (topk, depth), one run with every drafted node verified; each step's accepted
   path says how many tokens the (topk, depth, n) tree would have given for every n (EAGLE-2 keeps
   the best n - 1 drafted nodes by score, so that tree is a cut of the full one: graphs.adaptive);
   DFlash: the same for each topk (1: the chain), the block's top-k tree at its largest (its best-n
   nodes by path probability are a cut of it: graphs.dflash_tree), one drafter call a step;
3. predicted tokens/s = tokens per step / (verify(T) + draft + host) for every candidate tree;
   Medusa's trees grown greedily from the measured accuracies (the Medusa paper's construction);
4. the winner (EAGLE: baked as a one-call graph when new and ``--model-dir`` is given; without it, a
   tree that is not baked competes with the step-wise draft's measured cost) is confirmed
   with a measured run and written into ``manifest.json`` as the default tree, with its predicted and
   measured tokens/s (``tree["tuned"]``); the manifest is rehashed.

Greedy output is the same whatever tree is chosen; only speed changes. A GPU gives other costs, so
the same command there picks larger trees.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import graphs
from exporter.errors import UserError
from graphs import contract as C
from graphs.adaptive import counterfactual_gain
from graphs.eagle_draft import baked_trees
from graphs.limits import max_eagle_nodes
from graphs.sessions import base_precision
from graphs.slots import SlotCache
from graphs.trees import Tree, expected_accepted, medusa_paths_from_acceptance

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
EAGLE_GRID = [(k, d) for d in (1, 2, 3, 4, 5, 6) for k in (1, 2, 3, 4)]  # (topk, depth), cheap first
MAX_TREE = 64
WARM, TIMED = 4, 2  # measure_verify: calls per size and round before timing, and timed
# measure_verify: a call this slow makes the switch cost (~0.5 ms) noise: one untimed call, one timed
# (else a 7B model's 64-token verify at ~1 s would take the tuner 6 x 7 x 15 calls)
SLOW_CALL_S = 0.02


TUNABLE = ("medusa", "eagle", "dflash")  # the drafter kinds whose trees steps 1-4 measure
DFLASH_TOPK = (1, 2, 3, 4)  # DFlash: the chain, then trees of the block's per-slot top-k


def untunable(drafter: dict | None) -> str | None:
    """Why the tree of an export with ``drafter`` (the manifest's entry) is not tuned here, or None
    (a kind the tuner does not know: its default tree stays)."""
    kind = (drafter or {}).get("kind")
    if kind is None or kind in TUNABLE:
        return None
    return (f"the tuner measures {' and '.join(TUNABLE)} trees, not yet a {kind} drafter's (the engine's {kind} "
            f"proposer comes first); the manifest's default tree stays")


# ------------------------------------------------------------------ measurements


def measure_verify(dec, prompt: list[int], sizes=VERIFY_SIZES, repeats: int = 7) -> dict[int, float]:
    """Seconds per verify of an n-node tree after ``prompt`` (median of ``repeats``), on the engine's
    own call path: a one-row :class:`graphs.slots.SlotCache` and :meth:`graphs.runtime.Decoder.verify`
    (arrays bound to the session once, or ``base_forward`` where the graphs take no bound call, as the
    engine does) (a per-call binding, as before, measured 4-5% more per call on the 19M int4 model:
    0.265 vs 0.254 ms at one token, 0.577 vs 0.550 ms at four).

    Each size's cost is that of a call after calls of the same size, as the decode loop makes them: a
    call after one of another size pays for the switch, and it fades over a few calls (one-token calls
    after a 64-token one, 19M int4 model: 1.03, 0.78, 0.66, 0.56, 0.51 ms), so, after one untimed call
    of every size (its allocations), each size runs ``WARM`` unmeasured calls, then ``TIMED`` measured
    ones, per round (one and one where a call takes ``SLOW_CALL_S`` or more: the switch is noise
    there, and large models keep the tuner's time). The sizes take turns round by round: a shared or
    virtual machine runs at one speed for seconds, then at another (the same step at 0.65 ms, then at
    0.30 ms), and measured one size after another, the curve moved with the phases (five such runs put
    an 8-token call at 2.7x-4.1x one token)."""
    src = dec.manifest.source
    widest = max(sizes)
    room = dec.max_positions - widest  # the widest call's positions stay the model's
    if room < 1:
        raise ValueError(f"measure_verify: a {widest}-token verify does not fit the model's "
                         f"{dec.max_positions} positions")
    prompt = list(prompt)[-room:]  # a long calibration prompt's end: its last positions would pass the limit
    s = len(prompt)
    kv = SlotCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], dec.dtype, s + widest,
                   headroom=widest, layout=dec.kv_layout)
    kv.add_row()
    out = dec.base_forward(kv, np.array([prompt]), np.arange(s)[None], np.tril(np.ones((1, s, s), dtype=bool)))
    kv.commit(dec.presents(out), np.arange(s)[None], np.array([s]))

    # per size: a one-row chain of n nodes (its arguments to Decoder.verify)
    calls = {n: ([Tree.from_parents(np.arange(n) - 1)], [np.full(n, int(prompt[-1]), dtype=np.int64)])
             for n in sizes}
    for args in calls.values():  # each shape's first call (its allocations), not timed
        dec.verify(kv, *args)
    times = {n: [] for n in sizes}
    for _ in range(repeats):
        for n, args in calls.items():
            t0 = time.perf_counter()
            dec.verify(kv, *args)  # the switch from the last size
            fast = time.perf_counter() - t0 < SLOW_CALL_S  # a slow call hides the switch: no more warm-up
            for _ in range(WARM - 1 if fast else 0):
                dec.verify(kv, *args)
            timed = TIMED if fast else 1
            t0 = time.perf_counter()
            for _ in range(timed):
                dec.verify(kv, *args)
            times[n].append((time.perf_counter() - t0) / timed)
    return {n: statistics.median(t) for n, t in times.items()}


def interp(costs: dict[int, float], n: int) -> float:
    xs = sorted(costs)
    return float(np.interp(n, xs, [costs[x] for x in xs]))


def medusa_acceptance(dec, prompts: list[list[int]], new: int, k: int = 8) -> np.ndarray:
    """(heads, K) how often head h's rank-r token is the base's next-but-h+1 greedy token."""
    heads = dec.drafter["num_heads"]
    hits = np.zeros((heads, k))
    total = np.zeros(heads)
    src = dec.manifest.source
    for p in prompts:
        toks = dec.generate(p, max_new_tokens=new, mode="autoregressive").token_ids
        seq = list(p) + list(toks)
        s = len(seq)
        kv = SlotCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], dec.dtype, s, layout=dec.kv_layout)
        kv.add_row()
        out = dec.base_forward(kv, np.array([seq]), np.arange(s)[None], np.tril(np.ones((1, s, s), dtype=bool)))
        (ids,) = dec.draft.run([C.TOPK_IDS], {C.HIDDEN: out[C.HIDDEN], C.TOPK_IN: np.array([k])})  # (1, S, h, K)
        for t in range(len(p) - 1, s):
            for h in range(heads):
                if t + h + 2 < s:
                    total[h] += 1
                    r = np.flatnonzero(ids[0, t, h] == seq[t + h + 2])
                    if r.size:
                        hits[h, r[0]] += 1
    return hits / np.maximum(total, 1)[:, None]


def eagle_gains(dec, prompts: list[list[int]], new: int, topk: int, depth: int) -> tuple[np.ndarray, float, float]:
    """Mean tokens per step of the (topk, depth, n) tree for n = 1..T (step-wise drafting, every drafted
    node verified), the step-wise draft seconds per step and the host seconds per step."""
    t_full = min(max_eagle_nodes(topk, depth), MAX_TREE)
    return tree_gains(dec, prompts, new, {"topk": topk, "depth": depth, "total_tokens": t_full}, t_full)


def tree_gains(dec, prompts: list[list[int]], new: int, tree: dict, full: int) -> tuple[np.ndarray, float, float]:
    """Mean tokens per step of ``tree`` cut to its best n = 1..``full`` nodes (every drafted node verified:
    ``dec`` loaded with adaptive=False), the draft seconds per step and the host seconds per step."""
    gains, steps, draft, host = [], 0, 0.0, 0.0
    with dec.watch_verify() as records:
        for p in prompts:
            r = dec.generate(p, max_new_tokens=new, tree=tree)
            steps += r.stats.steps
            draft += r.stats.time_draft
            host += r.stats.time_host
    for rec in records:
        g = np.full(full, np.nan)
        g[: rec.tree.size] = counterfactual_gain(rec.tree, rec.accepted)
        g[rec.tree.size:] = g[rec.tree.size - 1]
        gains.append(g)
    return np.mean(gains, axis=0), draft / max(steps, 1), host / max(steps, 1)


def dflash_full(topk: int, block: int) -> int:
    """The nodes of the largest DFlash tree worth measuring: the whole block's top-k tree, at most MAX_TREE."""
    return min(sum(topk ** d for d in range(block)), MAX_TREE)


def measured_run(dec, prompts, new: int, **kw) -> dict:
    """tokens/s over all prompts (decode only), tokens per step, draft calls per step."""
    tokens, t, steps, calls, acc = 0, 0.0, 0, 0, []
    for p in prompts:
        r = dec.generate(p, max_new_tokens=new, **kw)
        s = r.stats
        tokens += s.new_tokens
        t += s.time_total - s.time_prefill
        steps += s.steps
        calls += s.draft_calls
        acc += s.accepted
    return {"tokens_per_s": tokens / t if t else 0.0, "mean_accepted_length": float(np.mean(acc)) if acc else 0.0,
            "draft_calls_per_step": calls / max(steps, 1)}


def _tune_medusa(dec, ids, verify, new, report, log) -> list[list[int]]:
    log("[2/4] Medusa heads: per-head, per-rank acceptance", flush=True)
    acc = medusa_acceptance(dec, ids, new)
    report["medusa_acceptance"] = acc.tolist()
    log("[3/4] trees grown from it, scored by predicted tokens/s", flush=True)
    # draft and host seconds per step, from a run of the current default tree
    s = dec.generate(ids[0], max_new_tokens=new).stats
    draft, host = s.time_draft / max(s.steps, 1), s.time_host / max(s.steps, 1)
    best = None
    for size in range(2, MAX_TREE + 1):
        paths = medusa_paths_from_acceptance(acc, size)
        if len(paths) < size - 1 and size > 2:
            break
        tau = expected_accepted(paths, acc)
        rate = tau / (interp(verify, len(paths) + 1) + draft + host)
        report["candidates"].append({"size": len(paths) + 1, "expected_accepted": tau, "predicted_tokens_per_s": rate})
        if best is None or rate > best[0]:
            best = (rate, paths, tau)
    report["best"] = {"medusa_paths": best[1], "expected_accepted": best[2], "predicted_tokens_per_s": best[0]}
    log(f"      best: {len(best[1]) + 1} nodes, tau {best[2]:.2f}, predicted {best[0]:.0f} tok/s", flush=True)
    return best[1]


def _tune_eagle(dec, ids, verify, new, report, budget_s, can_bake: bool, out_dir, threads,
                log) -> tuple[int, int, int]:
    log("[2/4] EAGLE drafter: acceptance of (topk, depth, n) trees", flush=True)
    baked = baked_trees(dec.manifest)
    stepwise = graphs.load(out_dir, provider=dec.provider, threads=threads, eagle_draft="stepwise", adaptive=False)
    # the one-call graph's draft time against the step-wise path's (1 + depth calls), on a baked tree
    ratio, host_one = 1.0, None
    if baked:
        k, d, t = next(iter(baked))
        tree = {"topk": k, "depth": d, "total_tokens": t}
        one = dec.generate(ids[0], max_new_tokens=new, tree=tree).stats
        two = stepwise.generate(ids[0], max_new_tokens=new, tree=tree).stats
        ratio = (one.time_draft / max(one.steps, 1)) / max(two.time_draft / max(two.steps, 1), 1e-9)
        host_one = one.time_host / max(one.steps, 1)
    t0 = time.perf_counter()
    best = None
    grid = list(dict.fromkeys([(k, d) for k, d, _ in baked] + EAGLE_GRID))  # the baked ones first
    for k, d in grid:
        if best is not None and time.perf_counter() - t0 > budget_s:
            log(f"      budget spent: stopped before ({k}, {d})", flush=True)
            break
        gains, draft_sw, host_sw = eagle_gains(stepwise, ids, new, k, d)
        for n in range(2, gains.size + 1):
            # a baked tree (or one tune may bake: --model-dir) drafts in one call; any other runs step-wise
            one_call = (k, d, n) in baked or can_bake
            draft = draft_sw * ratio if one_call else draft_sw
            host = (host_one if host_one is not None else host_sw) if one_call else host_sw
            rate = gains[n - 1] / (interp(verify, n) + draft + host)
            cand = {"topk": k, "depth": d, "total_tokens": n, "expected_accepted": float(gains[n - 1]),
                    "predicted_tokens_per_s": float(rate), "baked": (k, d, n) in baked,
                    "drafting": "one_call" if one_call else "stepwise"}
            report["candidates"].append(cand)
            if best is None or rate > best["predicted_tokens_per_s"]:
                best = cand
        log(f"      ({k}, {d}): tokens/step at n = 2..{gains.size}: " + " ".join(f"{g:.2f}" for g in gains[1:]),
            flush=True)
    report["best"] = best
    cfg = (best["topk"], best["depth"], best["total_tokens"])
    log(f"[3/4] best: {cfg}, tau {best['expected_accepted']:.2f}, predicted {best['predicted_tokens_per_s']:.0f} "
        f"tok/s, drafted {best['drafting'].replace('_', '-')}"
        f"{' (new: baking it)' if best['drafting'] == 'one_call' and not best['baked'] else ''}", flush=True)
    return cfg


def _tune_dflash(dec, ids, verify, new, report, budget_s, log) -> dict:
    """The chain and the block's top-k trees, each measured once at its largest (every node verified);
    a cut to n nodes is what the engine verifies at size n, so one run scores every size."""
    log("[2/4] DFlash drafter: acceptance of the chain and of top-k trees of the block", flush=True)
    block = int(dec.drafter["block_size"])
    best = None
    t0 = time.perf_counter()
    for k in DFLASH_TOPK:
        if best is not None and time.perf_counter() - t0 > budget_s:
            log(f"      budget spent: stopped before topk {k}", flush=True)
            break
        full = dflash_full(k, block)
        gains, draft, host = tree_gains(dec, ids, new, {"topk": k, "total_tokens": full}, full)
        for n in range(2, full + 1):
            rate = gains[n - 1] / (interp(verify, n) + draft + host)
            cand = {"topk": k, "total_tokens": n, "expected_accepted": float(gains[n - 1]),
                    "predicted_tokens_per_s": float(rate)}
            report["candidates"].append(cand)
            if best is None or rate > best["predicted_tokens_per_s"]:
                best = cand
        log(f"      topk {k}: tokens/step at n = 2..{full}: " + " ".join(f"{g:.2f}" for g in gains[1:]), flush=True)
    report["best"] = best
    log(f"[3/4] best: topk {best['topk']}, {best['total_tokens']} nodes, tau {best['expected_accepted']:.2f}, "
        f"predicted {best['predicted_tokens_per_s']:.0f} tok/s", flush=True)
    return {"topk": best["topk"], "total_tokens": best["total_tokens"]}


# ------------------------------------------------------------------ the stage


def choose_tree(dec, ids: list[list[int]], *, out_dir, threads: int | None, budget_s: float, can_bake: bool,
                max_new_tokens: int, log=print) -> dict:
    """Steps 1-3: measure the export ``dec`` was loaded from and pick the fastest tree; returns the
    report (``best``; ``winner``: Medusa paths or an EAGLE (topk, depth, total_tokens); ``bake``: the
    EAGLE winner when it is to be baked as a new one-call graph, else None)."""
    why = untunable({"kind": dec.kind})
    if why:
        raise UserError(f"{out_dir}: {why}")
    t_start = time.perf_counter()
    log(f"[1/4] verify cost against tree size ({len(VERIFY_SIZES)} sizes)", flush=True)
    verify = measure_verify(dec, ids[0])
    log("      " + ", ".join(f"{n}: {1e3 * s:.2f} ms" for n, s in verify.items()), flush=True)
    ar = measured_run(dec, ids, max_new_tokens, mode="autoregressive")
    report = {"out_dir": str(out_dir), "provider": dec.provider, "threads": threads, "kind": dec.kind,
              "verify_ms": {n: 1e3 * s for n, s in verify.items()}, "autoregressive": ar, "candidates": []}
    if dec.kind == "medusa":
        report["winner"] = _tune_medusa(dec, ids, verify, max_new_tokens, report, log)
        report["tree"] = report["winner"]
        report["bake"] = None
    elif dec.kind == "dflash":
        report["winner"] = report["tree"] = _tune_dflash(dec, ids, verify, max_new_tokens, report,
                                                         budget_s - (time.perf_counter() - t_start), log)
        report["bake"] = None
    else:
        cfg = _tune_eagle(dec, ids, verify, max_new_tokens, report, budget_s - (time.perf_counter() - t_start),
                          can_bake, out_dir, threads, log)
        best = report["best"]
        report["winner"] = cfg
        report["tree"] = dict(zip(("topk", "depth", "total_tokens"), cfg))
        report["bake"] = cfg if best["drafting"] == "one_call" and not best["baked"] else None
    return report


def confirm(dec, ids: list[list[int]], report: dict, *, threads: int | None, max_new_tokens: int, t_start: float,
            log=print) -> dict:
    """Step 4: a measured run of the chosen tree; returns the manifest's ``tree["tuned"]`` record."""
    log("[4/4] confirm with a measured run", flush=True)
    confirmed = measured_run(dec, ids, max_new_tokens, tree=report["tree"])
    best, ar = report["best"], report["autoregressive"]
    tuned = {"predicted_tokens_per_s": best["predicted_tokens_per_s"],
             "measured_tokens_per_s": confirmed["tokens_per_s"],
             "autoregressive_tokens_per_s": ar["tokens_per_s"],
             "mean_accepted_length": confirmed["mean_accepted_length"],
             "draft_calls_per_step": confirmed["draft_calls_per_step"],
             "provider": dec.provider, "threads": threads, "seconds": time.perf_counter() - t_start,
             # the base graphs it was measured on: graphs.load warns when they change under the tree
             "graphs": base_precision(dec.manifest.optimization, dec.manifest.source.get("dtype", "float32"))}
    report["confirmed"] = tuned
    if tuned["measured_tokens_per_s"] < ar["tokens_per_s"]:
        log("note: on this machine no tree beats plain decoding; graphs.load(adaptive=True) falls back to "
            "one-token steps where speculation does not pay", flush=True)
    return tuned


def record_tree(manifest, report: dict) -> None:
    """The chosen tree becomes the manifest's default, with its ``tuned`` record."""
    if report["kind"] == "medusa":
        manifest.tree["medusa_paths"] = report["winner"]
    elif report["kind"] == "dflash":
        manifest.tree["dflash"] = report["tree"]
    else:
        manifest.tree["eagle"] = report["tree"]
    manifest.tree["tuned"] = report["confirmed"]
