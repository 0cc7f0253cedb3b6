"""Soak the engine: many requests with random settings, Python memory (tracemalloc) after each batch.

    python samples/soak_engine.py OUT_DIR --requests 20000 --png docs/soak-memory.png

Each request draws its own temperature (a new one each time: the priors' keys), top-p, top-k, seed,
speculation switch, Medusa tree, stop string, deadline and length; up to ``in_flight`` are live at once.
What must stay flat over uptime: the planner's history, the engine's accepted lengths, the decoder's
priors (issue 39; tests/test_soak.py asserts it on the tiny export).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

TREES = [None, [[0], [0, 0]], [[0], [1], [2], [3]], [[0], [1], [0, 0], [0, 1], [1, 0]]]  # (two heads deep)


def random_params(rng: np.random.Generator) -> dict:
    p = {"max_new_tokens": int(rng.integers(1, 5)), "speculation": str(rng.choice(["on", "off", "adaptive"])),
         "tree": TREES[int(rng.integers(0, len(TREES)))]}
    if rng.random() < 0.7:
        p.update(temperature=float(rng.uniform(1e-4, 2.0)), top_p=float(rng.uniform(0.05, 1.0)),
                 top_k=int(rng.integers(0, 64)), seed=int(rng.integers(0, 2**31)))
    if rng.random() < 0.2:
        p["stop"] = "".join(chr(int(c)) for c in rng.integers(97, 123, size=2))
    if rng.random() < 0.05:
        p["deadline_s"] = float(rng.uniform(1e-6, 1e-3))
    return p


def soak(decoder, requests: int, every: int = 500, in_flight: int = 32, seed: int = 0, config=None,
         trace_from: int = 0) -> list:
    """Run ``requests`` random requests through one engine of ``decoder`` in bursts of ``every``; returns
    [(finished, bytes)] after each burst, the engine idle (its K/V given back: a bounded buffer that
    grows as rows fill is not what is measured): the Python memory allocated since tracemalloc started
    (here, once ``trace_from`` requests have finished) and still held."""
    from graphs.engine import EngineConfig

    rng = np.random.default_rng(seed)
    vocab = decoder.manifest.source["vocab_size"]
    engine = decoder.engine(config or EngineConfig(max_batch=16, max_len=32, prefill_chunk=8))
    curve, done = [], 0
    try:
        while done < requests:
            if done == trace_from:  # (a multiple of every)
                tracemalloc.start()
                curve.append((done, tracemalloc.get_traced_memory()[0]))
            burst, start, added = min(every, requests - done), done, 0
            while added < burst or engine.has_pending_requests():
                while added < burst and added - (done - start) < in_flight:
                    prompt = rng.integers(3, vocab, size=int(rng.integers(1, 9))).tolist()
                    engine.add_request(prompt, **random_params(rng))
                    added += 1
                done += sum(ev.finish_reason is not None for ev in engine.step())
            if tracemalloc.is_tracing():
                curve.append((done, tracemalloc.get_traced_memory()[0]))
    finally:
        tracemalloc.stop()
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="an export (python -m exporter.export)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--png", type=Path, help="the memory curve as a PNG")
    ap.add_argument("--json", type=Path, help="the curve as JSON")
    a = ap.parse_args(argv)
    import graphs

    dec = graphs.load(a.out_dir, provider="cpu", threads=1)
    t0 = time.perf_counter()
    curve = soak(dec, a.requests, a.every)
    seconds = time.perf_counter() - t0
    base = dict(curve).get(2000, curve[0][1])
    growth = max(b for n, b in curve if n >= 2000) - base
    print(f"{a.requests} requests in {seconds:.0f} s; traced memory after 2,000: {base / 2**20:.2f} MiB, "
          f"largest growth since: {growth / 2**10:.0f} KiB; priors {len(dec.priors)}")
    if a.json:
        a.json.write_text(json.dumps({"requests": a.requests, "seconds": seconds, "curve": curve}, indent=1))
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([n for n, _ in curve], [b / 2**20 for _, b in curve], marker=".")
        ax.axvline(2000, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("requests finished")
        ax.set_ylabel("Python memory traced (MiB)")
        ax.set_title(f"engine soak: {a.requests} requests, random settings ({a.out_dir.name})")
        ax.set_ylim(0, max(b for _, b in curve) / 2**20 * 1.2)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
