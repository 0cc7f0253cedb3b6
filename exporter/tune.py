"""Tune the draft tree for the machine at hand and record it as the export's default.

    python -m exporter.tune out_dir [--prompts FILE] [--provider cpu] [--threads N] [--budget-s 300]
                                    [--model-dir DIR] [--json report.json]

1. verify cost: one base forward over n = 1..N positions (after a real prompt), median of repeats;
2. acceptance on calibration prompts (greedy, so every run sees the same text):
   Medusa: per-head, per-rank accuracy of the heads' top-k against the base's own continuation;
   EAGLE: for each (topk, depth), one run with every drafted node verified; each step's accepted
   path says how many tokens the (topk, depth, n) tree would have given for every n (EAGLE-2 keeps
   the best n - 1 drafted nodes by score, so that tree is a cut of the full one: graphs.adaptive);
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

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import graphs
from exporter.loading import UserError
from graphs import contract as C
from graphs.adaptive import counterfactual_gain
from graphs.eagle_draft import baked_trees
from graphs.kv import KVCache
from graphs.manifest import Manifest
from graphs.sessions import base_precision
from graphs.trees import expected_accepted, medusa_paths_from_acceptance

DEFAULT_PROMPTS = [
    "def main(",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self",
    "    for i in range(",
    "The quick brown fox",
    "if __name__ == \"__main__\":\n",
]
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
EAGLE_GRID = [(k, d) for d in (1, 2, 3, 4, 5, 6) for k in (1, 2, 3, 4)]  # (topk, depth), cheap first
MAX_TREE = 64


def read_prompts(path) -> list[str]:
    """One prompt per line, or a JSON list of strings."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts {p} does not exist; pass a text file (one prompt per line) or a JSON list")
    text = p.read_text()
    try:
        data = json.loads(text)
        if isinstance(data, list) and all(isinstance(x, str) for x in data):
            return [x for x in data if x]
    except json.JSONDecodeError:
        pass
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompts {p} holds no prompts")
    return prompts


# ------------------------------------------------------------------ measurements


def measure_verify(dec, prompt: list[int], sizes=VERIFY_SIZES, repeats: int = 7) -> dict[int, float]:
    """Seconds per base forward over n new positions after ``prompt`` (median of ``repeats``)."""
    src = dec.manifest.source
    kv = KVCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], dec.dtype)
    s = len(prompt)
    out = dec.base_forward(kv, np.array([prompt]), np.arange(s)[None], np.tril(np.ones((1, s, s), dtype=bool)))
    kv.append(dec.presents(out), np.arange(s)[None], np.array([s]))
    res = {}
    for n in sizes:
        ids = np.full((1, n), int(prompt[-1]))
        pos = s + np.arange(n)[None]
        mask = np.tril(np.ones((1, n, n), dtype=bool))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dec.base_forward(kv, ids, pos, mask)
            times.append(time.perf_counter() - t0)
        res[n] = statistics.median(times)
    return res


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
        kv = KVCache(src["num_layers"], 1, src["num_kv_heads"], src["head_dim"], dec.dtype)
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
    t_full = min(1 + topk + depth * topk * topk, MAX_TREE)
    gains, steps, draft, host = [], 0, 0.0, 0.0
    with dec.watch_verify() as records:
        for p in prompts:
            r = dec.generate(p, max_new_tokens=new, tree={"topk": topk, "depth": depth, "total_tokens": t_full})
            steps += r.stats.steps
            draft += r.stats.time_draft
            host += r.stats.time_host
    for rec in records:
        g = np.full(t_full, np.nan)
        g[: rec.tree.size] = counterfactual_gain(rec.tree, rec.accepted)
        g[rec.tree.size:] = g[rec.tree.size - 1]
        gains.append(g)
    return np.mean(gains, axis=0), draft / max(steps, 1), host / max(steps, 1)


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


# ------------------------------------------------------------------ baking a new EAGLE tree


def bake_tree(out_dir: Path, model_dir, cfg: tuple[int, int, int], log=print) -> str:
    """Trace the one-call graph for ``cfg`` into ``out_dir``, check it against PyTorch, list it in the manifest."""
    import shutil
    import tempfile

    import torch

    from exporter.compare import TOLERANCES, compare_arrays, run_case
    from exporter.eagle_tree import graph_for_role, tree_cases, tree_graph_specs
    from exporter.export import _trace_one
    from exporter.loading import load_model
    from exporter.trace import OPSET
    from graphs.sessions import make_session

    manifest = Manifest.read(out_dir)
    model = load_model(model_dir)
    dtype = manifest.source["dtype"]
    if dtype != "float32":
        raise UserError(f"tune bakes new trees into float32 exports only ({out_dir} is {dtype}); re-export with "
                        f"--eagle-trees {','.join(map(str, cfg))}")
    specs = tree_graph_specs(model, dtype, [cfg])
    role, spec = next(iter(specs.items()))
    def past(g):
        return [t for t in g.inputs if t.name.startswith("past_key_values.")]

    if past(spec) != past(manifest.graphs["draft"]):
        raise UserError(f"--model-dir {model_dir} is not the model exported to {out_dir}")
    tmp = Path(tempfile.mkdtemp(prefix=".tune-", dir=out_dir))
    try:
        _trace_one(model, role, spec, tmp, OPSET)
        session = make_session(tmp / spec.file, provider="cpu")
        module = graph_for_role(model, role)
        tol = TOLERANCES[(dtype, "cpu")]
        for case, inputs in tree_cases(model, spec):
            with torch.no_grad():
                ref = [t.numpy() for t in module(*inputs)]
            for o, r, g in zip(spec.outputs, ref, run_case(session, spec, inputs)):
                row = compare_arrays(r, g, tol, o.name)
                if not row["ok"]:
                    raise UserError(f"the baked {role} graph disagrees with PyTorch ({o.name}, {case}): not written")
        del session
        for f in tmp.iterdir():
            shutil.move(str(f), out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    manifest.graphs[role] = spec
    entries = manifest.tree.setdefault("eagle_trees", [])
    entries.append({"topk": cfg[0], "depth": cfg[1], "total_tokens": cfg[2], "graph": role})
    manifest.write(out_dir)
    log(f"baked {role} into {out_dir}")
    return role


# ------------------------------------------------------------------ the tuner


def tune(out_dir, prompts: list[str] | None = None, provider: str = "cpu", threads: int | None = None,
         budget_s: float = 300.0, model_dir=None, max_new_tokens: int = 48, log=print) -> dict:
    """Measure, pick and record the fastest tree for ``out_dir`` on this machine; returns the report."""
    out_dir = Path(out_dir)
    t_start = time.perf_counter()
    dec = graphs.load(out_dir, provider=provider, threads=threads, adaptive=False)
    if not dec.kind:
        raise UserError(f"{out_dir} has no drafter: there is no tree to tune")
    ids = [dec.encode(p) for p in (prompts or DEFAULT_PROMPTS)]
    log(f"[1/4] verify cost against tree size ({len(VERIFY_SIZES)} sizes)", flush=True)
    verify = measure_verify(dec, ids[0])
    log("      " + ", ".join(f"{n}: {1e3 * s:.2f} ms" for n, s in verify.items()), flush=True)
    ar = measured_run(dec, ids, max_new_tokens, mode="autoregressive")
    report = {"out_dir": str(out_dir), "provider": dec.provider, "threads": threads, "kind": dec.kind,
              "verify_ms": {n: 1e3 * s for n, s in verify.items()}, "autoregressive": ar, "candidates": []}
    if dec.kind == "medusa":
        winner = _tune_medusa(dec, ids, verify, max_new_tokens, report, log)
        tree_kw = {"tree": winner}
    else:
        winner = _tune_eagle(dec, ids, verify, max_new_tokens, report, budget_s - (time.perf_counter() - t_start),
                             model_dir, out_dir, threads, log)
        dec = graphs.load(out_dir, provider=provider, threads=threads, adaptive=False)  # sees a newly baked tree
        tree_kw = {"tree": dict(zip(("topk", "depth", "total_tokens"), winner))}
    log("[4/4] confirm with a measured run", flush=True)
    confirmed = measured_run(dec, ids, max_new_tokens, **tree_kw)
    best = report["best"]
    tuned = {"predicted_tokens_per_s": best["predicted_tokens_per_s"],
             "measured_tokens_per_s": confirmed["tokens_per_s"],
             "autoregressive_tokens_per_s": ar["tokens_per_s"],
             "mean_accepted_length": confirmed["mean_accepted_length"],
             "draft_calls_per_step": confirmed["draft_calls_per_step"],
             "provider": dec.provider, "threads": threads, "seconds": time.perf_counter() - t_start,
             # the base graphs it was measured on: graphs.load warns when they change under the tree
             "graphs": base_precision(dec.manifest.optimization, dec.manifest.source.get("dtype", "float32"))}
    report["confirmed"] = tuned
    report["tree"] = tree_kw["tree"]  # what became the default: Medusa paths or an EAGLE setting
    if tuned["measured_tokens_per_s"] < ar["tokens_per_s"]:
        log("note: on this machine no tree beats plain decoding; graphs.load(adaptive=True) falls back to "
            "one-token steps where speculation does not pay", flush=True)
    manifest = Manifest.read(out_dir)
    if dec.kind == "medusa":
        manifest.tree["medusa_paths"] = winner
    else:
        manifest.tree["eagle"] = tree_kw["tree"]
    manifest.tree["tuned"] = tuned
    manifest.write(out_dir)
    log(f"default tree: {tree_kw['tree']}; predicted {tuned['predicted_tokens_per_s']:.0f} tok/s, measured "
        f"{tuned['measured_tokens_per_s']:.0f} tok/s (autoregressive {ar['tokens_per_s']:.0f}); written to "
        f"{out_dir / 'manifest.json'}", flush=True)
    return report


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


def _tune_eagle(dec, ids, verify, new, report, budget_s, model_dir, out_dir, threads,
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
            one_call = (k, d, n) in baked or model_dir is not None
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
    if best["drafting"] == "one_call" and not best["baked"]:
        bake_tree(out_dir, model_dir, cfg, log)
    return cfg


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="an export directory (holds manifest.json)")
    ap.add_argument("--prompts", help="calibration prompts: a text file (one per line) or a JSON list "
                                      "(default: the built-in set)")
    ap.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="cpu",
                    help="ONNX Runtime provider to tune for")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="time for the EAGLE (topk, depth) sweep")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt")
    ap.add_argument("--model-dir", help="EAGLE: the model_dir of the export, to bake a new winning tree "
                         "(default: trees not baked yet compete as step-wise drafts)")
    ap.add_argument("--json", help="write the full report (every candidate) to this file (default: not written)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)

    def body():
        prompts = read_prompts(args.prompts) if args.prompts else None
        report = tune(args.out_dir, prompts=prompts, provider=args.provider, threads=args.threads,
                      budget_s=args.budget_s, model_dir=args.model_dir, max_new_tokens=args.max_new_tokens)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        return 0

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
