"""The tune stage's decisions and records on scripted measurements (exporter.tuning): no graphs.

A fake decoder returns hand-set stats, verify records and acceptance; a fake clock (the module's
``time``) gives hand-set timings. The tests assert which tree is chosen near each tie, and that every
number the report and the manifest's ``tree["tuned"]`` record is the one measured or computed from
the measurements (not only that it exists or is positive). The tuner measures at batch 1 (one
calibration prompt at a time): there is no batch > 1 decision here.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from exporter import tuning
from graphs import contract as C
from graphs.adaptive import counterfactual_gain
from graphs.runtime import Decoder
from graphs.trees import Tree

QUIET = dict(log=lambda *a, **k: None)


class Clock:
    """A fake ``time`` module: perf_counter returns ``now``; tests advance it."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _stats(**kw):
    base = dict(new_tokens=0, time_total=0.0, time_prefill=0.0, steps=0, draft_calls=0, accepted=[], time_draft=0.0,
                time_host=0.0)
    return SimpleNamespace(**{**base, **kw})


class FakeDec:
    max_positions = 1 << 30
    pad = 0
    verify = Decoder.verify  # the decoder's own verify over the fake's verify_trees / base_forward

    def __init__(self, kind="medusa", stats=None, records=None, heads=2):
        self.kind, self.provider = kind, "cpu"
        self.manifest = SimpleNamespace(source={"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
                                        optimization={"base": {"dtype": "float32", "quantization": {"bits": 4},
                                                               "passes": ["fuse"]}})
        self.drafter = {"num_heads": heads}
        self.calls = []
        self._stats = stats or (lambda kw: _stats())
        self._records = records or []
        self._watching = None

    def generate(self, prompt, **kw):
        self.calls.append((list(prompt), kw))
        if self._watching is not None:
            self._watching.extend(self._records.pop(0) if self._records else [])
        return SimpleNamespace(stats=self._stats(kw), token_ids=[])

    @contextmanager
    def watch_verify(self):
        self._watching = []
        try:
            yield self._watching
        finally:
            self._watching = None


# ----------------------------------------------------------------------------- measurements are recorded as measured


@pytest.mark.parametrize("bound", [True, False])
def test_measure_verify_times_the_engines_calls_after_a_switch_sizes_taking_turns(monkeypatch, bound):
    """The verify cost of each tree size: a one-row SlotCache after the prompt, each size's calls on the
    engine's path (Decoder.verify_trees; base_forward where it has no bound call), WARM untimed calls
    per size and round (the switch from another size fades over a few calls), then TIMED timed ones;
    sizes take turns round by round; the median of the rounds."""
    clock = Clock()
    monkeypatch.setattr(tuning, "time", clock)
    monkeypatch.setattr(tuning, "WARM", 2)
    monkeypatch.setattr(tuning, "TIMED", 2)
    seen = []
    script = {}

    class Dec(FakeDec):
        dtype = np.float32
        kv_layout = "bhsd"

        def _call(self, kv, n, how):
            assert kv.n == 1 and kv.lens.tolist() == [5]  # the prompt committed, nothing after it
            seen.append((how, n))
            if n in script:
                clock.now += script[n].pop(0)

        def base_forward(self, kv, ids, pos, mask):
            n = ids.shape[1]
            if n == 5:  # the prompt: causal, positions 0..4
                assert ids.tolist() == [prompt] and pos.tolist() == [list(range(5))]
                assert np.array_equal(mask[0], np.tril(np.ones((5, 5), dtype=bool)))
                return {}
            assert not bound and ids.tolist() == [[8] * n] and pos.tolist() == [list(range(5, 5 + n))]
            assert np.array_equal(mask[0], np.tril(np.ones((n, n), dtype=bool)))  # a chain of n nodes
            self._call(kv, n, "base_forward")
            return {}

        def presents(self, out):
            return None  # written in place: commit moves only the lengths

        def verify_trees(self, kv, trees, tokens):
            (tree,), (tok,) = trees, tokens
            n = len(tok)
            assert tok.tolist() == [8] * n and tree.parents.tolist() == list(range(-1, n - 1))
            if not bound:
                return None
            self._call(kv, n, "verify_trees")
            return {}

    # one untimed call per size first (its allocations: 9 s here, never counted); then per round and
    # size: two untimed calls (0 s here), then two timed ones (their mean counts)
    script.update({2: [9.0, *(0, 0, 0.5, 1.0), *(0, 0, 0.25, 0.25), *(0, 0, 0.5, 0.5)],
                   3: [9.0, *(0, 0, 2.0, 2.0), *(0, 0, 0.5, 0.5), *(0, 0, 1.0, 1.0)]})
    prompt = [4, 5, 6, 7, 8]
    res = tuning.measure_verify(Dec(), prompt, sizes=(2, 3), repeats=3)
    assert res == {2: 0.5, 3: 1.0}  # the middle round, not the mean or the first
    how = "verify_trees" if bound else "base_forward"
    # sizes take turns: a slow phase hits each alike; the 9 s first calls did not make them "slow"
    assert seen == [(how, 2), (how, 3)] + ([(how, 2)] * 4 + [(how, 3)] * 4) * 3


def test_measure_verify_does_not_warm_up_slow_calls(monkeypatch):
    """A call of SLOW_CALL_S or more hides the switch: one untimed call and one timed per size and round
    (a 7B model's verify would otherwise cost the tuner minutes)."""
    clock = Clock()
    monkeypatch.setattr(tuning, "time", clock)
    seen = []

    class Dec(FakeDec):
        dtype = np.float32
        kv_layout = "bhsd"

        def base_forward(self, kv, ids, pos, mask):
            return {}

        def presents(self, out):
            return None

        def verify_trees(self, kv, trees, tokens):
            seen.append(len(tokens[0]))
            clock.now += 0.05 if len(tokens[0]) == 3 else 0.001  # size 3 slow, size 2 fast
            return {}

    res = tuning.measure_verify(Dec(), [4, 5, 6, 7, 8], sizes=(2, 3), repeats=2)
    assert seen == [2, 3] + ([2] * (tuning.WARM + tuning.TIMED) + [3, 3]) * 2
    assert res == pytest.approx({2: 0.001, 3: 0.05})


def test_interp_is_linear_between_measured_sizes():
    costs = {1: 1.0, 4: 4.0, 8: 6.0}
    assert tuning.interp(costs, 1) == 1.0 and tuning.interp(costs, 2) == 2.0 and tuning.interp(costs, 6) == 5.0
    assert tuning.interp(costs, 100) == 6.0  # past the largest: the largest (np.interp)


def test_medusa_acceptance_counts_each_heads_first_matching_rank(monkeypatch):
    """seq = prompt [1, 2] + greedy [3, 4, 5, 6]; from the prompt's last position t = 1, head h's
    rank-r token is compared with seq[t + h + 2] while that exists (head 0: t = 1..3, head 1: t = 1, 2)."""
    seq = [1, 2, 3, 4, 5, 6]
    ids = np.full((1, 6, 2, 3), 99, dtype=np.int64)
    ids[0, 0] = [[seq[2]] * 3, [seq[3]] * 3]  # t = 0 is before the prompt's end: never counted
    ids[0, 1, 0, 0] = seq[3]  # head 0, t = 1: rank 0
    ids[0, 2, 0, 2] = seq[4]  # head 0, t = 2: rank 2
    ids[0, 1, 1, 1] = seq[4]  # head 1, t = 1: rank 1
    ids[0, 2, 1, [0, 2]] = seq[5]  # head 1, t = 2: ranks 0 and 2 carry it: the first counts
    ids[0, 4, 0, 0] = ids[0, 5, 0, 0] = 1  # past the end: never counted

    made, feeds = [], []

    class KV:
        def __init__(self, *a, layout="bhsd"):
            made.append(a)

        def add_row(self):
            return 0

    monkeypatch.setattr(tuning, "SlotCache", KV)

    class Dec(FakeDec):
        dtype = np.float32
        kv_layout = "bhsd"

        def generate(self, prompt, **kw):
            assert kw == {"max_new_tokens": 4, "mode": "autoregressive"}
            return SimpleNamespace(token_ids=[3, 4, 5, 6])

        def base_forward(self, kv, tokens, pos, mask):
            assert tokens.tolist() == [seq] and pos.tolist() == [list(range(6))]
            assert np.array_equal(mask, np.tril(np.ones((1, 6, 6), dtype=bool)))
            return {C.HIDDEN: np.zeros((1, 6, 2))}

    def run(names, feed):
        feeds.append(feed[C.TOPK_IN].tolist())
        return (ids if feed[C.TOPK_IN][0] == 3 else np.full((1, 6, 2, 8), 99),)

    dec = Dec(heads=2)
    dec.draft = SimpleNamespace(run=run)
    acc = tuning.medusa_acceptance(dec, [[1, 2]], 4, k=3)
    assert acc.tolist() == [[1 / 3, 0.0, 1 / 3], [1 / 2, 1 / 2, 0.0]]
    assert made == [(1, 1, 1, 2, np.float32, 6)] and feeds == [[3]]
    assert tuning.medusa_acceptance(dec, [[1, 2]], 4).shape == (2, 8) and feeds[-1] == [8]  # k = 8 by default


CHAIN4 = Tree.from_parents([-1, 0, 1, 2], score=np.array([0.0, -1, -2, -3]))
CUT2 = Tree.from_parents([-1, 0], score=np.array([0.0, -1]))


def test_eagle_gains_are_the_mean_counterfactual_gains_of_every_verified_row(monkeypatch):
    """Every verified row watched counts once; a cut tree's gains past its size stay at its last."""
    monkeypatch.setattr(tuning, "max_eagle_nodes", lambda k, d: 4)
    rec = lambda tree, acc: SimpleNamespace(tree=tree, accepted=acc)
    records = [[rec(CHAIN4, [0, 1, 2]), rec(CUT2, [0, 1])], [rec(CHAIN4, [0])]]
    stats = iter([_stats(steps=2, time_draft=1.0, time_host=0.5), _stats(steps=1, time_draft=0.5, time_host=1.0)])
    dec = FakeDec("eagle", stats=lambda kw: next(stats), records=records)
    gains, draft, host = tuning.eagle_gains(dec, [[1], [2]], 5, 2, 3)
    want = np.mean([counterfactual_gain(CHAIN4, [0, 1, 2]), [1, 2, 2, 2], counterfactual_gain(CHAIN4, [0])], axis=0)
    assert gains.tolist() == pytest.approx(want.tolist()) and want.tolist() == pytest.approx([1, 5 / 3, 2, 2])
    assert draft == 1.5 / 3 and host == 1.5 / 3  # per step, over all prompts
    assert [c[1] for c in dec.calls] == [{"max_new_tokens": 5, "tree": {"topk": 2, "depth": 3, "total_tokens": 4}}] * 2


def test_eagle_gains_cap_the_full_tree_at_max_tree(monkeypatch):
    monkeypatch.setattr(tuning, "MAX_TREE", 3)
    dec = FakeDec("eagle", stats=lambda kw: _stats(steps=1), records=[[SimpleNamespace(tree=CUT2, accepted=[0])]])
    gains, _, _ = tuning.eagle_gains(dec, [[1]], 5, 4, 6)
    assert gains.tolist() == [1, 1, 1] and dec.calls[0][1]["tree"]["total_tokens"] == 3


def test_measured_run_sums_over_prompts():
    stats = iter([_stats(new_tokens=6, time_total=4.0, time_prefill=1.0, steps=3, draft_calls=6, accepted=[1, 2, 3]),
                  _stats(new_tokens=2, time_total=2.0, time_prefill=1.0, steps=1, draft_calls=2, accepted=[2])])
    r = tuning.measured_run(FakeDec(stats=lambda kw: next(stats)), [[1], [2]], 8, tree={"x": 1})
    assert r == {"tokens_per_s": 8 / 4.0, "mean_accepted_length": 2.0, "draft_calls_per_step": 8 / 4}
    r = tuning.measured_run(FakeDec(stats=lambda kw: _stats()), [[1]], 8)
    assert r == {"tokens_per_s": 0.0, "mean_accepted_length": 0.0, "draft_calls_per_step": 0.0}
    r = tuning.measured_run(FakeDec(stats=lambda kw: _stats(new_tokens=3, time_total=1.5, time_prefill=0.5,
                                                            draft_calls=2)), [[1]], 8)
    assert r["tokens_per_s"] == 3.0 and r["draft_calls_per_step"] == 2.0  # no steps: divided by 1


# ----------------------------------------------------------------------------- Medusa: which grown tree wins


def _medusa(monkeypatch, tau: dict[int, float], verify: dict[int, float], draft=0.5, host=0.25, steps=2,
            grown: dict[int, int] | None = None):
    """Candidates of sizes 2.. with scripted tau (by node count) and the paths' count by size."""
    monkeypatch.setattr(tuning, "medusa_acceptance", lambda dec, ids, new: np.array([[0.5]]))
    grown = grown or {}
    monkeypatch.setattr(tuning, "medusa_paths_from_acceptance",
                        lambda acc, size: [[i] for i in range(grown.get(size, size - 1))])
    monkeypatch.setattr(tuning, "expected_accepted", lambda paths, acc: tau[len(paths) + 1])
    dec = FakeDec(stats=lambda kw: _stats(steps=steps, time_draft=draft * steps, time_host=host * steps))
    report = {"candidates": []}
    lines = []
    paths = tuning._tune_medusa(dec, [[1, 2], [3]], verify, 6, report, log=lambda *a, **k: lines.append(a[0]))
    assert dec.calls == [([1, 2], {"max_new_tokens": 6})]  # the default tree's run on the first prompt
    assert f"best: {len(paths) + 1} nodes" in lines[-1]  # the log names the winner's size
    return paths, report


@pytest.mark.parametrize(("eps", "winner"), [(-1e-9, 3), (0.0, 2), (1e-9, 2)])
def test_medusa_picks_the_best_predicted_rate_ties_to_the_smaller(monkeypatch, eps, winner):
    """rate(n) = tau(n) / (verify(n) + draft + host): sizes 2 and 3 tie at eps = 0 (the first, smaller,
    one is kept), a hair cheaper 3-node verify makes 3 win, a hair dearer still leaves 2 (and 3 wins
    only when it is cheaper)."""
    # per-step overhead 0.75; rate(2) = 2 / (1.25 + .75) = 1; rate(3) = 3 / (verify(3) + .75): 1 at 2.25
    verify = {1: 1.0, 2: 1.25, 3: 2.25 + eps, 4: 10.0}
    tau = {2: 2.0, 3: 3.0, 4: 3.0}
    paths, report = _medusa(monkeypatch, tau, verify, grown={5: 2})  # size 5 grows only 2 paths: stop there
    assert len(paths) + 1 == winner
    cands = report["candidates"]
    assert [c["size"] for c in cands] == [2, 3, 4]
    for c in cands:
        assert c["expected_accepted"] == tau[c["size"]]
        assert c["predicted_tokens_per_s"] == pytest.approx(tau[c["size"]] / (verify[c["size"]] + 0.75), rel=1e-12)
    best = report["best"]
    assert best["predicted_tokens_per_s"] == max(c["predicted_tokens_per_s"] for c in cands)
    assert best["expected_accepted"] == tau[winner] and best["medusa_paths"] == paths


def test_medusa_stops_growing_when_no_more_paths_come(monkeypatch):
    """A size whose paths are fewer than size - 1 ends the sweep (size 2 never does)."""
    verify = {n: 1.0 for n in range(1, 65)}
    tau = {n: 1.0 + 0.01 * n for n in range(1, 66)}
    _, report = _medusa(monkeypatch, tau, verify, grown={2: 0, 6: 4})
    assert [c["size"] for c in report["candidates"]] == [1, 3, 4, 5]  # size 2 grew none: kept, listed as 1 node
    _, report = _medusa(monkeypatch, tau, verify, grown={7: 5})  # size 7 grew 5 < 6 paths: the end
    assert [c["size"] for c in report["candidates"]] == [2, 3, 4, 5, 6]
    _, report = _medusa(monkeypatch, tau, verify)
    assert [c["size"] for c in report["candidates"]] == list(range(2, tuning.MAX_TREE + 1))


def test_medusa_draft_and_host_are_per_step(monkeypatch):
    verify = {1: 1.0, 2: 1.0}
    _, report = _medusa(monkeypatch, {2: 2.0, 3: 2.0}, verify, draft=0.5, host=0.25, steps=4, grown={3: 1})
    assert report["candidates"][0]["predicted_tokens_per_s"] == 2.0 / (1.0 + 0.5 + 0.25)
    _, report = _medusa(monkeypatch, {2: 2.0, 3: 2.0}, verify, draft=0.5, host=0.25, steps=1, grown={3: 1})
    assert report["candidates"][0]["predicted_tokens_per_s"] == 2.0 / (1.0 + 0.5 + 0.25)  # one step: not halved
    _, report = _medusa(monkeypatch, {2: 2.0, 3: 2.0}, verify, draft=0.5, host=0.25, steps=0, grown={3: 1})
    assert report["candidates"][0]["predicted_tokens_per_s"] == 2.0 / 1.0  # no steps: no time (not a division by 0)


# ----------------------------------------------------------------------------- EAGLE: which (topk, depth, n) wins


def _eagle(monkeypatch, gains: dict, *, baked=(), can_bake=False, verify=None, budget_s=100.0, cost_s=None,
           one=(0.5, 0.25), two=2.0, grid=((1, 1), (2, 1)), steps=1):
    """gains: (k, d) -> (gains (T,), step-wise draft s/step, host s/step). ``one``: the baked tree's
    one-call (draft, host) per step, ``two`` its step-wise draft per step. ``cost_s``: the clock's
    advance per (k, d) measured."""
    clock = Clock()
    clock.now = 100.0  # the sweep measures elapsed time from its own start
    monkeypatch.setattr(tuning, "time", clock)
    monkeypatch.setattr(tuning, "EAGLE_GRID", list(grid))
    monkeypatch.setattr(tuning, "baked_trees", lambda manifest: list(baked))
    measured = []

    def eagle_gains(dec, ids, new, k, d):
        measured.append((k, d))
        clock.now += (cost_s or {}).get((k, d), 0.0)
        g, draft, host = gains[(k, d)]
        return np.asarray(g, dtype=float), draft, host

    monkeypatch.setattr(tuning, "eagle_gains", eagle_gains)
    stepwise = FakeDec("eagle", stats=lambda kw: _stats(steps=steps, time_draft=steps * two, time_host=0.0))
    loads = []
    monkeypatch.setattr(tuning, "graphs", SimpleNamespace(load=lambda *a, **k: loads.append(k) or stepwise))
    dec = FakeDec("eagle", stats=lambda kw: _stats(steps=steps, time_draft=steps * one[0], time_host=steps * one[1]))
    report = {"candidates": []}
    verify = verify or {n: 1.0 for n in range(1, 65)}
    LINES.clear()
    lines = LINES
    cfg = tuning._tune_eagle(dec, [[1, 2]], verify, 6, report, budget_s, can_bake, "out", 1,
                             log=lambda *a, **k: lines.append(a[0]))
    assert loads == [{"provider": "cpu", "threads": 1, "eagle_draft": "stepwise", "adaptive": False}]
    return cfg, report, measured


LINES: list[str] = []  # the last _eagle run's log


def test_eagle_candidates_record_the_rate_from_the_measurements(monkeypatch):
    """Step-wise trees cost their measured step-wise draft and host; a baked tree its draft scaled by
    the one-call/step-wise ratio measured on a baked tree (0.5 / 2.0) and the one-call host time."""
    gains = {(2, 1): ([1.0, 2.0, 2.5], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)}
    verify = {1: 1.0, 2: 1.25, 3: 1.5}
    cfg, report, measured = _eagle(monkeypatch, gains, baked=[(2, 1, 3)], verify=verify)
    assert measured == [(2, 1), (1, 1)]  # the baked (topk, depth) first, then the grid, each once
    by = {(c["topk"], c["depth"], c["total_tokens"]): c for c in report["candidates"]}
    assert list(by) == [(2, 1, 2), (2, 1, 3), (1, 1, 2)]
    assert by[(2, 1, 3)]["drafting"] == "one_call" and by[(2, 1, 3)]["baked"] is True
    assert by[(2, 1, 3)]["predicted_tokens_per_s"] == pytest.approx(2.5 / (1.5 + 0.8 * 0.25 + 0.25))
    assert by[(2, 1, 2)]["drafting"] == "stepwise" and by[(2, 1, 2)]["baked"] is False
    assert by[(2, 1, 2)]["predicted_tokens_per_s"] == pytest.approx(2.0 / (1.25 + 0.8 + 0.2))
    assert by[(1, 1, 2)]["predicted_tokens_per_s"] == pytest.approx(1.5 / (1.25 + 0.4 + 0.1))
    assert all(by[k]["expected_accepted"] == gains[k[:2]][0][k[2] - 1] for k in by)
    assert cfg == (2, 1, 3) and report["best"] is by[(2, 1, 3)]


def test_eagle_logs_the_gains_and_whether_the_winner_is_baked(monkeypatch):
    gains = {(2, 1): ([1.0, 2.0, 2.5], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)}
    _eagle(monkeypatch, gains, baked=[(2, 1, 3)])
    assert any("(2, 1): tokens/step at n = 2..3: 2.00 2.50" in x for x in LINES)
    best = [x for x in LINES if x.startswith("[3/4] best")]
    assert best and "(new: baking it)" not in best[0] and "drafted one-call" in best[0]  # baked already
    _eagle(monkeypatch, {(2, 1): ([1.0, 3.0], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)}, can_bake=True)
    assert "(new: baking it)" in next(x for x in LINES if x.startswith("[3/4] best"))
    _eagle(monkeypatch, {(2, 1): ([1.0, 3.0], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)})
    best = next(x for x in LINES if x.startswith("[3/4] best"))
    assert "(new: baking it)" not in best and "drafted stepwise" in best


def test_eagle_can_bake_prices_every_tree_as_one_call(monkeypatch):
    gains = {(2, 1): ([1.0, 2.0, 2.5], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)}
    _, report, _ = _eagle(monkeypatch, gains, baked=[(2, 1, 3)], can_bake=True)
    assert all(c["drafting"] == "one_call" for c in report["candidates"])
    c = next(c for c in report["candidates"] if c["total_tokens"] == 2 and c["topk"] == 1)
    assert c["predicted_tokens_per_s"] == pytest.approx(1.5 / (1.0 + 0.4 * 0.25 + 0.25)) and not c["baked"]


def test_eagle_without_baked_trees_uses_the_stepwise_host_and_no_ratio(monkeypatch):
    gains = {(2, 1): ([1.0, 2.0], 0.8, 0.2), (1, 1): ([1.0, 1.5], 0.4, 0.1)}
    _, report, _ = _eagle(monkeypatch, gains, can_bake=True)
    assert [c["predicted_tokens_per_s"] for c in report["candidates"]] == pytest.approx([2.0 / 2.0, 1.5 / 1.5])


@pytest.mark.parametrize(("eps", "winner"), [(-1e-9, (1, 1, 2)), (0.0, (1, 1, 2)), (1e-9, (2, 1, 2))])
def test_eagle_picks_the_best_rate_ties_to_the_first(monkeypatch, eps, winner):
    """(1, 1, 2) and (2, 1, 2) priced to tie: (1, 1, 2), measured first, keeps a tie; a hair fewer
    tokens for it and (2, 1, 2) wins."""
    gains = {(2, 1): ([1.0, 2.0], 0.5, 0.5), (1, 1): ([1.0, 2.0 - eps], 0.5, 0.5)}
    cfg, report, _ = _eagle(monkeypatch, gains)
    assert cfg == winner
    assert report["best"]["predicted_tokens_per_s"] == max(c["predicted_tokens_per_s"] for c in report["candidates"])


@pytest.mark.parametrize(("spent", "more"), [(0.5, True), (1.0, True), (1.5, False)])
def test_eagle_sweep_stops_once_the_budget_is_spent(monkeypatch, spent, more):
    """The budget is checked before each (topk, depth) after the first: elapsed > budget stops."""
    gains = {(1, 1): ([1.0, 2.0], 0.5, 0.5), (2, 1): ([1.0, 3.0], 0.5, 0.5)}
    cfg, _, measured = _eagle(monkeypatch, gains, budget_s=1.0, cost_s={(1, 1): spent})
    assert measured == ([(1, 1), (2, 1)] if more else [(1, 1)])
    assert cfg == ((2, 1, 2) if more else (1, 1, 2))


# ----------------------------------------------------------------------------- choose, confirm, record


def test_choose_tree_reports_what_was_measured(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(tuning, "time", clock)
    monkeypatch.setattr(tuning, "measure_verify", lambda dec, p: {1: 0.02, 2: 0.03})
    monkeypatch.setattr(tuning, "measured_run", lambda dec, ids, new, **kw: {"tokens_per_s": 123.0, "kw": kw})
    monkeypatch.setattr(tuning, "_tune_medusa", lambda *a, **k: [[0], [1]])
    dec = FakeDec("medusa")
    lines = []
    r = tuning.choose_tree(dec, [[1]], out_dir="o", threads=2, budget_s=5.0, can_bake=False, max_new_tokens=4,
                           log=lambda *a, **k: lines.append(a[0]))
    assert "1: 20.00 ms, 2: 30.00 ms" in lines[1]  # the measured verify costs, in ms
    assert r["verify_ms"] == pytest.approx({1: 20.0, 2: 30.0})
    assert r["autoregressive"]["kw"] == {"mode": "autoregressive"}
    assert r["winner"] == r["tree"] == [[0], [1]] and r["bake"] is None and r["threads"] == 2


@pytest.mark.parametrize(("drafting", "baked", "bake"), [("one_call", False, True), ("one_call", True, False),
                                                         ("stepwise", False, False)])
def test_choose_tree_bakes_only_a_new_one_call_winner(monkeypatch, drafting, baked, bake):
    clock = Clock()
    clock.now = 10.0
    monkeypatch.setattr(tuning, "time", clock)
    monkeypatch.setattr(tuning, "measure_verify", lambda dec, p: (clock.__setattr__("now", 12.0), {1: 0.001})[1])
    monkeypatch.setattr(tuning, "measured_run", lambda dec, ids, new, **kw: {"tokens_per_s": 1.0})
    budgets = []

    def fake(dec, ids, verify, new, report, budget_s, can_bake, out_dir, threads, log):
        budgets.append(budget_s)
        report["best"] = {"drafting": drafting, "baked": baked}
        return (2, 3, 7)

    monkeypatch.setattr(tuning, "_tune_eagle", fake)
    r = tuning.choose_tree(FakeDec("eagle"), [[1]], out_dir="o", threads=1, budget_s=5.0, can_bake=True,
                           max_new_tokens=4, **QUIET)
    assert r["tree"] == {"topk": 2, "depth": 3, "total_tokens": 7} and r["winner"] == (2, 3, 7)
    assert r["bake"] == ((2, 3, 7) if bake else None)
    assert budgets == [5.0 - 2.0]  # the sweep gets what the verify measurement left


@pytest.mark.parametrize(("measured", "note"), [(9.99, True), (10.0, False), (10.01, False)])
def test_confirm_records_measured_and_predicted_and_notes_a_loss(monkeypatch, measured, note):
    clock = Clock()
    clock.now = 7.0
    monkeypatch.setattr(tuning, "time", clock)
    runs = []

    def run(dec, ids, new, **kw):
        runs.append(kw)
        return {"tokens_per_s": measured, "mean_accepted_length": 2.25, "draft_calls_per_step": 1.5}

    monkeypatch.setattr(tuning, "measured_run", run)
    report = {"tree": {"topk": 1}, "best": {"predicted_tokens_per_s": 42.5}, "autoregressive": {"tokens_per_s": 10.0}}
    lines = []
    tuned = tuning.confirm(FakeDec(), [[1]], report, threads=3, max_new_tokens=4, t_start=2.0,
                           log=lambda *a, **k: lines.append(a[0]))
    assert runs == [{"tree": {"topk": 1}}]
    assert tuned == {"predicted_tokens_per_s": 42.5, "measured_tokens_per_s": measured,
                     "autoregressive_tokens_per_s": 10.0, "mean_accepted_length": 2.25, "draft_calls_per_step": 1.5,
                     "provider": "cpu", "threads": 3, "seconds": 5.0,
                     "graphs": {"dtype": "float32", "quantization": "int4", "passes": ["fuse"]}}
    assert report["confirmed"] is tuned
    assert any("no tree beats plain decoding" in x for x in lines) is note


def test_record_tree_writes_the_winner_and_the_tuned_record():
    for kind, key, winner, tree in (("medusa", "medusa_paths", [[0]], [[0]]),
                                    ("eagle", "eagle", (1, 2, 3), {"topk": 1, "depth": 2, "total_tokens": 3})):
        m = SimpleNamespace(tree={})
        tuning.record_tree(m, {"kind": kind, "winner": winner, "tree": tree, "confirmed": {"x": 1}})
        assert m.tree == {key: tree, "tuned": {"x": 1}}


@pytest.mark.parametrize("steps", [1, 3])
def test_eagle_ratio_with_millisecond_drafts(monkeypatch, steps):
    """Real drafts take milliseconds: the ratio is 2 ms / 4 ms per step, not clamped by the 1e-9 guard."""
    gains = {(2, 1): ([1.0, 2.0, 2.5], 0.008, 0.001), (1, 1): ([1.0, 1.5], 0.004, 0.001)}
    _, report, _ = _eagle(monkeypatch, gains, baked=[(2, 1, 3)], one=(0.002, 0.0005), two=0.004, steps=steps)
    c = next(c for c in report["candidates"] if (c["topk"], c["total_tokens"]) == (2, 3))
    assert c["predicted_tokens_per_s"] == pytest.approx(2.5 / (1.0 + 0.008 * 0.5 + 0.0005))


# ----------------------------------------------------------------------------- the command line


def test_tune_cli_forwards_its_documented_defaults_and_writes_the_report(monkeypatch, tmp_path):
    from exporter import tune as tune_cli

    got = []
    monkeypatch.setattr(tune_cli, "tune", lambda out, **kw: got.append((out, kw)) or {"best": {"x": 1.5}})
    assert tune_cli.main([str(tmp_path)]) == 0
    assert got == [(str(tmp_path), {"prompts": None, "provider": "auto", "threads": None, "budget_s": 300.0,
                                     "model_dir": None, "max_new_tokens": 48})]
    report = tmp_path.parent / f"{tmp_path.name}-report.json"
    assert tune_cli.main([str(tmp_path), "--threads", "2", "--budget-s", "7", "--max-new-tokens", "5",
                          "--provider", "cpu", "--json", str(report)]) == 0
    assert got[-1][1] == {"prompts": None, "provider": "cpu", "threads": 2, "budget_s": 7.0, "model_dir": None,
                          "max_new_tokens": 5}
    assert report.read_text() == '{\n  "best": {\n    "x": 1.5\n  }\n}\n'


def test_measure_verify_keeps_the_widest_call_inside_the_models_positions(monkeypatch):
    """A calibration prompt near max_position_embeddings: its end is used, so that the widest verify's
    positions stay the model's (they ran past the limit, measured without a word)."""
    monkeypatch.setattr(tuning, "time", Clock())
    positions = []

    class Dec(FakeDec):
        dtype = np.float32
        kv_layout = "bhsd"
        max_positions = 20

        def base_forward(self, kv, ids, pos, mask):
            positions.append(int(pos.max()))
            return {}

        def presents(self, out):
            return None

        def verify_trees(self, kv, trees, tokens):
            positions.append(int(kv.lens[0]) + len(tokens[0]) - 1)
            return {}

    tuning.measure_verify(Dec(), list(range(30)), sizes=(1, 8), repeats=1)
    assert positions[0] == 11 and max(positions) == 19  # the prompt's last 12 tokens, then calls up to 8
