"""Latency of the one-call EAGLE draft-tree graphs, several exports side by side, JSON.

    python samples/bench_draft_tree.py EXPORT [EXPORT ...] [--roles draft_tree.2-3-6 ...] [--threads 2]
        [--batch 1] [--rows 3] [--past 128] [--repeats 200] --json r.json

Every export must hold the same tree roles (a raw trace, the same export optimized, a re-export
with another exporter version...). Calls rotate between the exports so machine noise hits all of
them alike. Per export and role: median and p10/p90 latency of one call (ms), node count, and
whether its outputs equal the first export's (tokens, parents, depths, mask identical; scores'
max abs difference) on the same random inputs: ``rows`` newly accepted context rows over a
drafter cache of ``past`` rows, as a decode step feeds it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.plan import is_tree_role
from graphs import contract as C
from graphs.manifest import Manifest
from graphs.sessions import make_session, use_shared_thread_pool


def feed_for(spec: C.GraphSpec, batch: int, rows: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A decode step's feed: ``rows`` causal context rows after ``past`` cached rows."""
    rng = np.random.default_rng(seed)
    sizes = {C.BATCH: batch, C.SEQ: rows, C.PAST: past, C.TOTAL: past + rows}
    feed = {}
    for t in spec.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == C.ATTENTION_MASK:
            causal = np.tril(np.ones((rows, rows), bool))
            feed[t.name] = np.broadcast_to(np.concatenate([np.ones((rows, past), bool), causal], 1),
                                           shape).copy()
        elif t.name == C.POSITION_IDS:
            feed[t.name] = np.broadcast_to(past + np.arange(rows), shape).astype(np.int64)
        elif t.name == C.ROOT_INDEX:
            feed[t.name] = np.full(shape, rows - 1, np.int64)
        elif t.dtype == "int64":
            feed[t.name] = rng.integers(0, 64, shape).astype(np.int64)
        else:
            feed[t.name] = (rng.standard_normal(shape) * 0.5).astype(t.dtype)
    return feed


def node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python samples/bench_draft_tree.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", nargs="+", help="export directories (manifest.json with draft_tree.* graphs)")
    ap.add_argument("--roles", nargs="*", help="tree roles to time (default: every one in the first export)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rows", type=int, default=3, help="context rows per call (accepted tokens of a step)")
    ap.add_argument("--past", type=int, default=128, help="drafter cache length")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    use_shared_thread_pool(args.threads)
    mans = [Manifest.read(Path(e)) for e in args.exports]
    roles = args.roles or [r for r in mans[0].graphs if is_tree_role(r)]
    result = {"command": sys.argv, "machine": platform.processor() or platform.machine(), "threads": args.threads,
              "batch": args.batch, "rows": args.rows, "past": args.past, "repeats": args.repeats, "roles": {}}
    for role in roles:
        sess, feeds, paths = [], [], []
        for e, m in zip(args.exports, mans):
            spec = m.graphs[role]
            paths.append(Path(e) / spec.file)
            sess.append(make_session(paths[-1], "cpu", args.threads))
            feeds.append(feed_for(spec, args.batch, args.rows, args.past))
        outs = [s.run(None, f) for s, f in zip(sess, feeds)]
        times = [[] for _ in sess]
        for _ in range(10):  # warm up
            for s, f in zip(sess, feeds):
                s.run(None, f)
        for r in range(args.repeats):
            for i in [(r + j) % len(sess) for j in range(len(sess))]:
                t0 = time.perf_counter()
                sess[i].run(None, feeds[i])
                times[i].append(time.perf_counter() - t0)
        rows = {}
        for e, p, ts, o in zip(args.exports, paths, times, outs):
            ms = np.array(ts) * 1e3
            same = all(np.array_equal(a, b) for k, (a, b) in enumerate(zip(outs[0][:5], o[:5])) if k != 3)
            rows[e] = {"file": str(p), "nodes": node_count(p), "median_ms": float(np.median(ms)),
                       "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
                       "tree_equal_to_first": bool(same),
                       "scores_max_abs_vs_first": float(np.abs(outs[0][3].astype(np.float64) - o[3]).max()),
                       "kv_max_abs_vs_first": max(float(np.abs(a.astype(np.float64) - b).max())
                                                  for a, b in zip(outs[0][5:], o[5:]))}
        first = rows[args.exports[0]]["median_ms"]
        for v in rows.values():
            v["speedup_vs_first"] = first / v["median_ms"]
        result["roles"][role] = rows
        print(role, "  ".join(f"{Path(e).name}: {v['nodes']} nodes {v['median_ms']:.3f} ms "
                              f"({v['speedup_vs_first']:.2f}x, tree equal {v['tree_equal_to_first']})"
                              for e, v in rows.items()), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
