"""Bounded memory over uptime (issue 39): what the engine keeps for statistics and the adaptive policy
must not grow with the requests it served. It grew by one int per generated token (the engine's
accepted lengths), one per step (the planner's history) and one ~640 B entry per client-chosen
temperature / top-p / top-k / tree (the decoder's priors): +2.2 MB in 150 s of serving.

The soak (samples/soak_engine.py, which draws the curve in docs/soak-memory.png) runs 20,000 requests
with random settings; the fast test checks each bound and that the reported statistics stay exact.
"""

from __future__ import annotations

import numpy as np
import pytest

import graphs
import graphs.adaptive
import graphs.engine
from graphs.adaptive import PRIORS_MAX, Planner, Priors
from graphs.engine import EngineConfig
from graphs.results import Stats
from samples.soak_engine import random_params, soak


@pytest.fixture(scope="module")
def dec(exported):
    return graphs.load(exported("medusa"), provider="cpu", threads=1)


def test_each_bound_holds_and_the_reported_statistics_stay_exact(dec, monkeypatch):
    """3,000 requests with random settings through one engine, the windows shrunk to 64 so that they
    fill: the planner's history and the engine's accepted lengths stay within twice their window, the
    priors within PRIORS_MAX settings; the engine's histogram (so the mean accepted length) is still
    exactly that of every request's own statistics."""
    monkeypatch.setattr(graphs.engine, "ACCEPTED_WINDOW", 64)
    monkeypatch.setattr(graphs.adaptive, "HISTORY_WINDOW", 64)
    rng = np.random.default_rng(1)
    engine = dec.engine(EngineConfig(max_batch=16, max_len=32, prefill_chunk=8))
    vocab = dec.manifest.source["vocab_size"]
    every: list[int] = []  # the accepted lengths of every finished request
    added = done = 0
    while done < 3000:
        while added < 3000 and added - done < 32:
            engine.add_request(rng.integers(3, vocab, size=int(rng.integers(1, 9))).tolist(), **random_params(rng))
            added += 1
        for ev in engine.step():
            if ev.finish_reason is not None:
                done += 1
                every += ev.stats.accepted
        assert len(engine.planner.history) <= 2 * 64 and len(engine.totals.accepted) <= 2 * 64
        assert len(dec.priors) <= PRIORS_MAX
    tot = engine.totals
    assert tot.accepted_counts == np.bincount(every).tolist() and sum(tot.accepted_counts) == len(every) > 128
    assert tot.mean_accepted_length == pytest.approx(np.mean(every), rel=1e-12)
    assert tot.to_json()["accepted_histogram"] == tot.accepted_counts


def test_the_bounded_structures_on_their_own():
    p = Planner()
    for _ in range(3 * graphs.adaptive.HISTORY_WINDOW):
        p.planned_plain()
    assert graphs.adaptive.HISTORY_WINDOW <= len(p.history) <= 2 * graphs.adaptive.HISTORY_WINDOW
    s = Stats()
    for k in range(1000):
        s.add_accepted([1 + k % 3], window=10)
    assert 10 <= len(s.accepted) <= 20 and s.accepted[-1] == 1 + 999 % 3
    assert s.accepted_counts == [0, 334, 333, 333] and s.mean_accepted_length == pytest.approx(1999 / 1000)
    pri = Priors(limit=3)
    for k in range(5):
        pri[k] = (np.zeros(2), 1)
    assert pri.get(2) is not None  # used: the most recent now
    pri[9] = (np.zeros(2), 1)
    assert list(pri) == [4, 2, 9] and pri.get(0) is None
    assert list(Planner().carry(None, pri).priors) == [4, 2, 9]


@pytest.mark.slow
def test_20000_requests_with_random_settings_keep_memory_flat(dec):
    """The soak: 20,000 requests, each its own temperature, top-p, top-k, seed, tree, speculation, stop
    string, length and sometimes a deadline. What is allocated after the first 2,000 and still held
    stays within 1 MB at every sample (it grew steadily, 2.7 MiB by 20,000, before the bounds). Slow:
    about a minute on a shared 2-core machine (tracemalloc doubles the Python's cost)."""
    curve = soak(dec, 20000, every=500, trace_from=2000)
    assert curve[0][0] == 2000 and curve[-1][0] == 20000 and len(curve) == 37
    grown = max(b for _, b in curve)
    assert grown < 2**20, f"Python memory grew by {grown / 2**20:.2f} MiB after 2,000 requests: {curve}"
