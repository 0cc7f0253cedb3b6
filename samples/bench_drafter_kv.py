"""The EAGLE drafter's cost per call against context: its K/V written in place vs concatenated.

    python samples/bench_drafter_kv.py IN_PLACE_OUT CONCAT_OUT [--contexts 128,512,2048] [--new-tokens 32]
                                       [--rounds 3] [--threads 2] [--json F]

IN_PLACE_OUT: an EAGLE export optimized with the defaults (``python -m exporter.optimize OUT
--no-tune``: the drafter's graphs write their K/V in place); CONCAT_OUT: the same export optimized
with ``--no-kv-in-place``. For each drafting mode (the one-call tree graph, step-wise) and context
length, one random prompt of that length is decoded speculatively by both, interleaved, ``--rounds``
times; the report is the median drafter seconds per drafter call (``Stats.time_draft /
draft_calls``) and per decode step. The greedy tokens of both are checked equal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("in_place")
    ap.add_argument("concat")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import graphs
    from graphs.sessions import use_shared_thread_pool

    use_shared_thread_pool(args.threads)
    dirs = {"in-place": args.in_place, "concat": args.concat}
    report = {}
    for draft in ("one_call", "stepwise"):
        decs = {k: graphs.load(v, provider="cpu", threads=args.threads, eagle_draft=draft, adaptive=False)
                for k, v in dirs.items()}
        vocab = next(iter(decs.values())).manifest.source["vocab_size"]
        for ctx in (int(c) for c in args.contexts.split(",")):
            prompt = np.random.default_rng(ctx).integers(0, vocab, ctx).tolist()
            runs = {k: [] for k in decs}
            for _ in range(args.rounds):
                for k, dec in decs.items():
                    r = dec.generate(prompt, max_new_tokens=args.new_tokens, mode="speculative")
                    s = r.stats
                    runs[k].append((s.time_draft / max(s.draft_calls, 1) * 1e3,
                                    (s.time_total - s.time_prefill) / s.steps * 1e3, r.token_ids))
            if runs["in-place"][0][2] != runs["concat"][0][2]:
                raise SystemExit(f"{draft}, context {ctx}: the two exports decoded different tokens")
            row = {k: {"draft_ms_per_call": float(np.median([x[0] for x in v])),
                       "ms_per_step": float(np.median([x[1] for x in v]))} for k, v in runs.items()}
            report[f"{draft}/{ctx}"] = row
            cells = [f"{k} {v['draft_ms_per_call']:.2f} ms/draft call, {v['ms_per_step']:.2f} ms/step"
                     for k, v in row.items()]
            print(f"{draft:8s} context {ctx:5d}: " + ", ".join(cells), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
