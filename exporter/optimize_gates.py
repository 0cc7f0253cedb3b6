"""The optimize stage's gates: every rewritten graph against the raw trace before the swap.

    check_parity        raw vs rewritten graphs on the parity cases (exporter.passes.parity); the base's
                        rows gate (check_rows: a token's logits whatever its call's row count)
    check_one_sequence  the one-sequence graph through the base's gates, and against the base
    time_gain           a rough raw-vs-optimized timing of the base

The rows contract (set_contract, rows_bound, within_bound) is what the runtime and exporter.bench read.
The passes themselves: :mod:`exporter.optimizing`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from exporter.compare_report import TOLERANCES
from exporter.errors import UserError
from exporter.optimize_options import TARGETS, OptimizeOptions
from exporter.plan import is_traced, is_tree_role
from graphs import contract as C
from graphs.manifest import Manifest


def parity_tolerance(opts: OptimizeOptions) -> tuple[float, float]:
    """(atol, rtol) of raw vs rewritten graphs: compare's CPU tolerance for the rewritten dtype."""
    tol = TOLERANCES[("float16" if opts.use_float16 else "float32", "cpu")]
    return tol.atol, tol.rtol


def check_parity(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, opts: OptimizeOptions, log) -> dict:
    """Raw vs rewritten graphs (CPU EP) on the parity cases; raises UserError on a mismatch."""
    from exporter.passes.parity import graph_parity

    atol, rtol = parity_tolerance(opts)
    report = {"strict": opts.quantize == "none" and opts.quant_for("draft") == "none", "atol": atol, "rtol": rtol,
              "graphs": {}}
    for role in [r for r in specs if is_traced(r)]:
        strict = opts.quant_for(role) == "none"
        if is_tree_role(role):
            report["graphs"][role] = _validate_tree(out_dir, tmp, manifest, specs, role, opts, log)
            continue
        try:
            rows = graph_parity(out_dir / manifest.graphs[role].file, tmp / specs[role].file, manifest.graphs[role],
                                specs[role], atol, rtol, vocab=manifest.source["vocab_size"], strict=strict,
                                **dflash_feeds(out_dir, manifest, role))
        except Exception as e:
            report["graphs"][role] = _not_on_cpu(e, role, opts, log)
            continue
        bad = [r for r in rows if not r.ok]
        if role == "base":  # a row's logits whatever its call's row count: greedy speculative == autoregressive
            report["rows"] = check_rows(tmp / specs[role].file, specs[role], manifest.source, opts, atol, log,
                                        provider=rows_provider(opts))
        worst = max((r for r in rows if r.output in (C.LOGITS,)), key=lambda r: r.max_abs)
        top1 = min((r.top1 for r in rows if r.top1 is not None), default=None)
        report["graphs"][role] = {"max_abs_logits": worst.max_abs, "min_top1": top1, "ok": not bad,
                                  "rows": [dataclasses.asdict(r) for r in rows]}
        what = "vs raw" if strict else "vs raw float32 (quantized: reported, not gated)"
        log(f"  [{role}] parity    {what}: max |logits diff| {worst.max_abs:.2e}, top-1 agreement "
            f"{top1 if top1 is None else f'{top1:.3f}'}, {len(rows)} outputs x cases: {'ok' if not bad else 'FAIL'}")
        if bad:
            r = bad[0]
            raise UserError(f"optimized {role} graph disagrees with the raw one: {r.output} in case {r.case} max abs "
                            f"error {r.max_abs:.3g} > {r.limit:.3g}; the export is untouched")
    return report


def dflash_feeds(out_dir: Path, manifest: Manifest, role: str) -> dict:
    """``graph_parity``'s keywords for ``role``: for a DFlash draft graph, its own calls
    (:func:`exporter.passes.parity.dflash_parity_feeds`: the export check's, at batch 2 with a cache,
    holes and the block mask; random base-graph feeds do not fit its contract), else none."""
    spec = manifest.graphs[role]
    if C.CONTEXT_POSITION_IDS not in spec.input_names:
        return {}
    from exporter.passes.parity import dflash_parity_feeds
    from graphs.sessions import make_session

    raw = make_session(out_dir / spec.file, "cpu", 1)
    feeds = dflash_parity_feeds(out_dir / manifest.graphs["base"].file, manifest.graphs["base"], raw, spec,
                                manifest.drafter, manifest.source["vocab_size"])
    return {"feeds": feeds, "raw_session": raw}


def rows_provider(opts: OptimizeOptions) -> str:
    """The provider the rows gates call the optimized base on: the target's where this machine has it
    (the rows must be measured on the kernels that will compute them), else the CPU EP (its record
    says which, and the gate says so)."""
    import onnxruntime as ort

    if opts.target != "cpu" and TARGETS[opts.target] in ort.get_available_providers():
        return opts.target
    return "cpu"


def row_seeds(opts: OptimizeOptions) -> int:
    """Chains the rows checks call: more where the base has int8 activations (parity.ROW_SEEDS_INT8)."""
    from exporter.passes.parity import ROW_SEEDS, ROW_SEEDS_INT8

    return ROW_SEEDS_INT8 if int8_activations(opts) else ROW_SEEDS


def int8_activations(opts: OptimizeOptions) -> bool:
    """The base's MatMulNBits quantize their activations to int8 (accuracy level 4)."""
    return opts.quantize != "none" and opts.level("base") == 4


def row_sizes(seed: int) -> tuple:
    """The calls of chain ``seed``: every size for the first ROW_SEEDS, the whole chain (and its
    tree) for the int8 samples after them."""
    from exporter.passes.parity import ROW_SEEDS, ROW_SIZES

    return ROW_SIZES if seed < ROW_SEEDS else (max(ROW_SIZES),)


def check_rows(path: Path, spec: C.GraphSpec, source: dict, opts: OptimizeOptions, limit: float, log,
               provider: str = "cpu") -> dict:
    """The rows gate of the base (:func:`exporter.passes.parity.row_consistency` over
    :func:`row_seeds` chains): calls of 2+ rows must agree within ``limit`` (else refused); a one-row
    call that does not makes the runtime pad one token to two rows (``min_rows`` 2, recorded) where
    trees agree too (:func:`pads_one_row`). Returns the record (the measured bounds, the limit,
    min_rows, the provider that ran it) written to the manifest.

    ``provider``: where the calls run (:func:`rows_provider`: the target's EP where this machine has
    it). On a device, calls of 2+ rows that differ are recorded (the recorded-bound contract), not
    refused: CUDA kernels pick tiles by row count by design (MatMulNBits has an M = 1 and an M = 2..16
    kernel, ONNX Runtime PR #29451), so bit-equal rows across call shapes are not to be expected."""
    from exporter.passes.parity import ROW_SIZES, row_consistency
    from graphs.sessions import make_session

    session = make_session(path, provider, 1)
    dims = (source.get("num_kv_heads"), source.get("head_dim"))
    runs = [row_consistency(path, spec, source["vocab_size"], seed=seed, kv_dims=dims, session=session,
                            sizes=row_sizes(seed), provider=provider) for seed in range(row_seeds(opts))]
    single, multi = max(r["single"] for r in runs), max(r["multi"] for r in runs)
    tree = max(r.get("tree", 0.0) for r in runs)
    quantized = opts.quantize != "none"
    # tree: recorded, not gated -- a tree's ancestors sit at other columns than a chain's past, which
    # moves the attention's rounding; with int8 activations that can be a quantization step
    rec = {"single_max_abs": single, "multi_max_abs": multi, "tree_max_abs": tree, "limit": limit,
           "sizes": list(ROW_SIZES), "chains": len(runs), "min_rows": 1, "provider": provider}
    sizes = "/".join(map(str, rec["sizes"][1:]))
    log(f"  [base] rows      a row alone vs in calls of {sizes} rows: max |logits diff| {single:.1e}; "
        f"between calls of 2+ rows: {multi:.1e} (limit {limit:g}); a chain as a tree's path: {tree:.1e} "
        f"(recorded; {len(runs)} chains, calls of every size on the first 8; {provider} EP)")
    if opts.target != "cpu" and provider == "cpu":
        log(f"  [base] rows      measured on the CPU EP: this machine has no {TARGETS[opts.target]}; optimizing "
            f"on the {opts.target} machine runs this gate on its kernels")
    if multi > limit and provider == "cpu":
        fix = ("quantize with --accuracy-level 0 (float32 compute)" if quantized and opts.level("base") != 0
               else "optimize with --no-fuse")
        if quantized and opts.level("base") == 4 and opts.block_size != 32:
            # MLAS's int8 kernels at block 64/128 round a row by the call's row count; at block 32 they do
            # not (SmolLM2-135M, AVX512-VNNI: 2+ row calls 1.4 logits apart at block 128, 0.0 at 32)
            fix = f"quantize with --block-size 32 (or {fix.removeprefix('quantize with ')})"
        raise UserError(f"optimized base graph gives a token different logits in calls of different sizes "
                        f"({multi:.3g} > {limit:g}), so speculative output could differ from autoregressive; "
                        f"the export is untouched: {fix}")
    if pads_one_row(single, tree, limit):
        rec["min_rows"] = 2
        log("  [base] rows      one-token calls will run as two rows (a padding row): every call then uses the "
            "same kernels")
    elif single > limit:
        log(f"  [base] rows      one-token calls stay one row: a tree's path differs by {tree:.1e} anyway, so two "
            f"rows would not make every call agree (the bound counts both; --accuracy-level 0 is exact)")
    set_contract(rec, rows_bound(single, [multi, tree], rec["min_rows"]), log, "the base graph's calls",
                 fix=LEVEL0_FIX if quantized and opts.level("base") != 0 else "")
    return rec


# what the NOT EXACT line offers a quantized base at another accuracy level (SmolLM2-135M int4: level 4's
# bound 4.08 logits, level 0's 3.7e-4: float32 rounding through 30 layers, just past the 1e-4 limit)
LEVEL0_FIX = "--accuracy-level 0 (float32 compute) leaves float32 rounding only"


def set_contract(rec: dict, bound: float, log, what: str, fix: str = "") -> None:
    """Record in the rows record ``rec`` which contract the runtime's calls keep, and say it when it is
    not the exact one. ``bound``: :func:`rows_bound`, the most a token's logits move between the calls
    the runtime makes. Within ``rec["limit"]`` the contract is ``"exact"`` (greedy speculative ==
    greedy autoregressive, token for token); over it, ``"recorded bound"``: the two may part where the
    base's top-2 margin is within twice the bound (a near-tie the calls' rounding resolves either way:
    :func:`within_bound`), and ``exporter.bench`` prints that margin at each divergence. Over the
    limit is never silent: ``over_limit`` names the figures past it, and a line says so (issue 36: a
    0.83-logit one-row figure over a 1e-4 limit had passed with min_rows 1 and no word)."""
    limit = rec["limit"]
    figures = {"single_max_abs": rec["single_max_abs"] if rec.get("min_rows", 1) == 1 else 0.0,
               "multi_max_abs": rec["multi_max_abs"], "tree_max_abs": rec["tree_max_abs"]}
    for name in ("vs_base_max_abs", "vs_base_tree_max_abs", "one_sequence_single_max_abs",
                 "one_sequence_tree_max_abs"):
        if name in rec:
            figures[name] = rec[name]
    rec["bound"] = bound
    rec["over_limit"] = sorted(k for k, v in figures.items() if v > limit)
    rec["contract"] = "exact" if bound <= limit else "recorded bound"
    if rec["contract"] == "exact":
        return
    if rec["over_limit"]:
        worst = ", ".join(f"{k.removesuffix('_max_abs')} {figures[k]:.2g}" for k in rec["over_limit"]) + " >"
    else:  # each within the limit, their sum along the worst path not
        worst = " + ".join(f"{k.removesuffix('_max_abs')} {v:.2g}" for k, v in figures.items() if v) + " add past"
    log(f"  [base] rows      NOT EXACT ({what}): {worst} limit {limit:g}: the contract is the recorded bound "
        f"({bound:.3g} logits, rows_max_abs): greedy speculative output equals autoregressive except where "
        f"the base's top-2 margin is within {2 * bound:.3g} (twice the bound; exporter.bench prints the margin "
        f"at each divergence){'; ' + fix if fix else ''}")


def within_bound(margin: float, bound: float) -> bool:
    """Whether two calls whose logits differ by at most ``bound`` each (``rows_max_abs``) may pick
    different top-1 tokens where one of them has top-2 ``margin``: a flip moves the difference of two
    logits, each by at most ``bound``, so it needs ``margin <= 2 * bound``."""
    return margin <= 2 * bound


def pads_one_row(single: float, trees: float, limit: float) -> bool:
    """Whether one-token calls run as two rows (``min_rows`` 2): where the one-row call alone rounds
    otherwise (``single`` over ``limit``) and a tree's path agrees with the chain (``trees``, every
    tree figure measured, within it). A padding row buys exactness only where trees are exact too;
    with int8 activations a tree's path differs anyway, so the step stays one row (two rows cost
    1.3-1.5x a one-token step at 1.1B int4) and the bound counts both (rows_bound)."""
    return single > limit and trees <= limit


def rows_bound(single: float, others: list[float], min_rows: int, across: float = 0.0) -> float:
    """The recorded bound on a token's logits across the calls the runtime makes (``rows_max_abs``),
    the sum along the worst path from an autoregressive step to a verify: the one-row figure where
    one-token steps run alone (``min_rows`` 1: a step within ``single`` of its graph's chain call),
    ``across`` (the two graphs' chain calls apart, where there are two), and the worst of the other
    several-row figures (calls of 2+ rows, a tree's path). Measured maxima over the sampled chains,
    not a proof: a rarer quantization step can exceed them."""
    return max(others, default=0.0) + across + (single if min_rows == 1 else 0.0)


def check_one_sequence(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, records: dict,
                       opts: OptimizeOptions, log, rows_record: dict | None = None) -> dict | None:
    """The one-sequence graph (``records["base"]["one_sequence"]``) through the base's gates: parity
    with the raw trace on the calls it takes (a tree after a past with holes, one token per row of a
    batch, a causal prefill), its own rows check, and the same logits as the base for every call
    size the runtime makes (so it does not matter which of the two a token is computed with). A
    graph that fails is removed (our own file, not yet the export's) with a line saying why: the base
    alone is complete. Updates the base's ``min_rows`` and ``rows_max_abs``; returns the record."""
    from exporter.passes.parity import ONE_SEQUENCE_CASES, consistency, graph_parity, row_logits
    from graphs.sessions import make_session

    base = records.get("base") or {}
    one = base.get("one_sequence")
    if not one:
        return None
    path = tmp / one["file"]
    atol, rtol = parity_tolerance(opts)
    strict = opts.quantize == "none"
    source = manifest.source
    dims = (source.get("num_kv_heads"), source.get("head_dim"))
    raw = out_dir / manifest.graphs["base"].file
    try:
        s_raw = make_session(raw, "cpu", 1)  # both parity runs below: the raw trace loaded once
        rows = graph_parity(raw, path, manifest.graphs["base"], specs["base"], atol, rtol, vocab=source["vocab_size"],
                            strict=strict, cases=ONE_SEQUENCE_CASES, raw_session=s_raw)
        # quantized: the base on the same cases, the distance from the float trace this graph may not exceed
        theirs_raw = (None if strict else
                      graph_parity(raw, tmp / specs["base"].file, manifest.graphs["base"], specs["base"], atol, rtol,
                                   vocab=source["vocab_size"], strict=False, cases=ONE_SEQUENCE_CASES,
                                   raw_session=s_raw))
        # the rows check's calls (chains after a past, their first M tokens, as a tree's path) on both graphs
        device = rows_provider(opts)  # the rows checks on the target's kernels where this machine has them
        s_mine, s_theirs = make_session(path, device, 1), make_session(tmp / specs["base"].file, device, 1)
        pairs = [(row_logits(path, specs["base"], source["vocab_size"], kv_dims=dims, seed=seed, session=s_mine,
                             sizes=row_sizes(seed)),
                  row_logits(tmp / specs["base"].file, specs["base"], source["vocab_size"], kv_dims=dims, seed=seed,
                             session=s_theirs, sizes=row_sizes(seed))) for seed in range(row_seeds(opts))]
    except Exception as e:  # a kernel this onnxruntime lacks, or one that refuses this model's shapes
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _drop_one_sequence(path, base, f"ONNX Runtime cannot run it here: {detail}", log)
    worst = max(r.max_abs for r in rows if r.output == C.LOGITS)
    bad = [r for r in rows if not r.ok]
    if bad:
        r = bad[0]
        return _drop_one_sequence(path, base, f"{r.output} in case {r.case} differs from the raw trace by "
                                              f"{r.max_abs:.3g} > {r.limit:.3g}", log)
    ceiling = None
    if theirs_raw is not None:
        # int8 activations gate nothing below on the two graphs' distance (another kernel is another
        # last bit, now and then a quantization step), so a graph that computes something else is
        # caught here: no further from the float trace than the quantized base is, on the same calls
        ceiling = 2 * max(r.max_abs for r in theirs_raw if r.output == C.LOGITS) + atol
        if worst > ceiling:
            return _drop_one_sequence(path, base, f"its logits are {worst:.3g} from the raw float32 trace, more than "
                                                  f"twice the quantized base's distance ({ceiling:.3g})", log)
    min_rows = base.get("min_rows", 1)
    owns = [consistency(mine) for mine, _ in pairs]
    single, multi = max(o["single"] for o in owns), max(o["multi"] for o in owns)
    own_tree = max(o["tree"] for o in owns)
    if multi > atol and device == "cpu":  # a device's kernels pick tiles by row count: recorded (check_rows)
        return _drop_one_sequence(path, base, f"a token's logits differ by {multi:.3g} between its calls of 2+ rows",
                                  log)
    theirs_rec = rows_record or {}
    cross_tree = max(float(np.abs(mine["tree"] - theirs["tree"]).max()) for mine, theirs in pairs)
    trees = max(own_tree, cross_tree, theirs_rec.get("tree_max_abs", 0.0))
    if min_rows == 1 and pads_one_row(single, trees, atol):
        min_rows = 2
    # the two graphs on the same calls (chains from min_rows rows, and the tree), gated as the rows
    # check gates chains; with int8 activations recorded (parity.ROW_SEEDS_INT8), the ceiling above
    # standing for the gate
    cross = max(float(np.abs(mine[m] - theirs[m]).max()) for mine, theirs in pairs for m in mine
                if m != "tree" and m >= min_rows)
    if max(cross, cross_tree) > atol and not int8_activations(opts) and device == "cpu":
        return _drop_one_sequence(path, base, f"a token's logits differ from the base's by "
                                              f"{max(cross, cross_tree):.3g} > {atol:g}", log)
    top1 = min((r.top1 for r in rows if r.top1 is not None), default=None)
    one.update({"parity_max_abs_logits": worst, "min_top1": top1, "single_max_abs": single, "multi_max_abs": multi,
                "tree_max_abs": own_tree, "vs_base_max_abs": cross, "vs_base_tree_max_abs": cross_tree,
                "chains": len(pairs), "rows_provider": device,
                **({} if ceiling is None else {"vs_raw_ceiling": ceiling})})
    base["min_rows"] = min_rows
    # the bound a token's logits obey whichever call computes them (calls alternate between the graphs):
    # a one-row step on either graph, across to the other graph's chain, to a tree there
    # (``rows_record``: the base's rows check, whose one-row figure is the same kind as this graph's)
    base["rows_max_abs"] = rows_bound(max(single, theirs_rec.get("single_max_abs", 0.0)),
                                      [theirs_rec.get("multi_max_abs", 0.0), theirs_rec.get("tree_max_abs", 0.0),
                                       multi, own_tree, cross_tree], min_rows, across=cross)
    if rows_record is not None:  # the contract now covers both graphs' calls
        rows_record.update({"one_sequence_single_max_abs": single if min_rows == 1 else 0.0,
                            "one_sequence_tree_max_abs": own_tree, "vs_base_max_abs": cross,
                            "vs_base_tree_max_abs": cross_tree, "min_rows": min_rows})
        set_contract(rows_record, base["rows_max_abs"], log, "both graphs' calls",
                     fix=LEVEL0_FIX if int8_activations(opts) else "")
    log(f"  [base] one-seq   vs raw{'' if strict else ' float32 (quantized: reported)'}: max |logits diff| "
        f"{worst:.2e}; rows: alone {single:.1e}, 2+ rows {multi:.1e}, a tree's path {own_tree:.1e}; vs the base "
        f"{cross:.1e}, a tree's path {cross_tree:.1e} ({'recorded' if int8_activations(opts) else f'limit {atol:g}'}; "
        f"{len(pairs)} chains, calls of every size on the first 8): ok")
    return one


def _drop_one_sequence(path: Path, base: dict, why: str, log) -> dict:
    path.unlink(missing_ok=True)
    del base["one_sequence"]
    base["files"] = [f for f in base.get("files", []) if f != path.name]
    log(f"  [base] one-seq   dropped: {why}; every call runs the base graph")
    return {"dropped": why}


def _not_on_cpu(e: Exception, role: str, opts: OptimizeOptions, log) -> dict:
    """A parity run that raised: a float16 graph the CPU EP has no kernels for is left to the GPU check
    (the returned record says so); anything else is an error and the export stays untouched."""
    if not opts.use_float16 or "NOT_IMPLEMENTED" not in str(e):
        raise UserError(f"optimized {role} graph does not run on ONNX Runtime's CPU EP "
                        f"({str(e).splitlines()[0][:200]}); the export is untouched") from None
    log(f"  [{role}] parity    skipped: the CPU EP has no float16 kernels for it (check on the GPU)")
    return {"skipped": "no float16 CPU kernels; check on the GPU with python -m exporter.compare --provider cuda"}


def _validate_tree(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, role: str, opts: OptimizeOptions,
                   log) -> dict:
    """Raw vs rewritten one-call tree graph. float32: the same tree (tokens, parents, depths, mask
    identical), scores and drafter K/V within 1e-4. float16: the context rows' drafter K/V within
    2e-2, the tree reported (float16 log-probs may order near-ties otherwise). Quantized: reported,
    not gated (another drafter). Drafts never change greedy output: the base verifies them."""
    from exporter.passes.parity import tree_parity

    quantized = opts.quant_for(role) != "none"
    strict = not quantized and not opts.use_float16
    atol, rtol = parity_tolerance(opts)
    try:
        rows = tree_parity(out_dir / manifest.graphs[role].file, tmp / specs[role].file, manifest.graphs[role],
                           specs[role], atol, rtol, vocab=manifest.source["vocab_size"], strict=strict,
                           strict_kv=not quantized)
    except Exception as e:
        return _not_on_cpu(e, role, opts, log)
    bad = [r for r in rows if not r.ok]
    tokens = min(r.top1 for r in rows if r.output == C.TREE_TOKENS)
    scores = max(r.max_abs for r in rows if r.output == C.TREE_SCORES)
    what = ("vs raw" if strict else "vs raw float32 (K/V gated, tree reported)" if not quantized
            else "vs raw float32 (quantized: reported, not gated)")
    log(f"  [{role}] parity    {what}: tree tokens equal {tokens:.3f}, max |scores diff| {scores:.2e}, "
        f"{len(rows)} outputs x cases: {'ok' if not bad else 'FAIL'}")
    if bad:
        r = bad[0]
        raise UserError(f"optimized {role} graph drafts another tree than the raw one: {r.output} in case {r.case} "
                        f"(max abs error {r.max_abs:.3g} > {r.limit:.3g}); the export is untouched")
    return {"tree_tokens_equal": tokens, "max_abs_scores": scores, "ok": not bad,
            "rows": [dataclasses.asdict(r) for r in rows]}


def time_gain(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, log) -> dict:
    """Median latency of the raw and the rewritten base graph at 1 and 8 tokens over a 64-token past."""
    from exporter.passes.parity import Case, random_feed, rewritten_feed
    from graphs.sessions import make_session

    gains = {}
    try:
        raw, new = (make_session(out_dir / manifest.graphs["base"].file, "cpu"),
                    make_session(tmp / specs["base"].file, "cpu"))
    except Exception:
        return {"skipped": "the rewritten base does not run on the CPU EP"}
    from graphs.sessions import InPlaceRun

    calls = (InPlaceRun.caller(raw, manifest.graphs["base"]), InPlaceRun.caller(new, specs["base"]))
    for t in (1, 8):
        feed = random_feed(manifest.graphs["base"], Case("t", 1, t, 64), vocab=manifest.source["vocab_size"])
        new_feed, _ = rewritten_feed(feed, specs["base"])
        ms = []
        for run, f in zip(calls, (feed, new_feed)):
            run(f)
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                run(f)
                ts.append(time.perf_counter() - t0)
            ms.append(float(np.median(ts)) * 1e3)
        gains[f"{t}_tokens"] = {"raw_ms": ms[0], "optimized_ms": ms[1], "speedup": ms[0] / ms[1]}
    log("  [base] gain      " + ", ".join(f"{k.replace('_', ' ')}: {v['raw_ms']:.2f} -> {v['optimized_ms']:.2f} ms "
                                           f"({v['speedup']:.2f}x)" for k, v in gains.items())
        + " (CPU EP, one rough timing)")
    return gains
