"""The adaptive speculation policy (graphs.adaptive) on synthetic gains and costs: no graphs needed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from graphs.adaptive import (
    IDLE,
    SPEC_ADAPTIVE,
    SPEC_OFF,
    SPEC_ON,
    AdaptiveConfig,
    Costs,
    Planner,
    RowGains,
    counterfactual_gain,
    cut_tree,
    sub_tree,
)
from graphs.sampling import greedy_accept
from graphs.trees import Tree

# root; 1 (-.1); 2 (-.9); 3 (-.3, child of 1); 4 (-1.2, child of 3); 5 (-1.0, child of 2)
TREE = Tree.from_parents([-1, 0, 0, 1, 3, 2], score=np.array([0, -0.1, -0.9, -0.3, -1.2, -1.0]))


def test_counterfactual_gain_worked_example():
    # ranks by score: 1 -> 1, 3 -> 2, 2 -> 3, 5 -> 4, 4 -> 5
    assert counterfactual_gain(TREE, [0, 1, 3]).tolist() == [1, 2, 3, 3, 3, 3]
    assert counterfactual_gain(TREE, [0, 1, 3, 4]).tolist() == [1, 2, 3, 3, 3, 4]
    assert counterfactual_gain(TREE, [0, 2, 5]).tolist() == [1, 1, 1, 2, 3, 3]
    assert counterfactual_gain(TREE, [0]).tolist() == [1] * 6


@pytest.mark.parametrize("n", range(1, 7))
def test_cut_tree_keeps_the_best_nodes_ancestor_closed(n):
    keep = cut_tree(TREE, n)
    assert keep.size == n and keep[0] == 0 and np.all(np.diff(keep) > 0)
    sub = sub_tree(TREE, keep)
    assert set(keep.tolist()) - {0} == set((np.argsort(-TREE.score[1:], kind="stable")[: n - 1] + 1).tolist())
    assert np.all(sub.parents[1:] >= 0)  # every kept node's parent was kept
    assert np.array_equal(sub.mask, TREE.mask[np.ix_(keep, keep)])
    assert np.array_equal(sub.score, TREE.score[keep])


@pytest.mark.parametrize("seed", range(5))
def test_greedy_walk_in_a_cut_tree_is_the_predicted_prefix(seed):
    """What counterfactual_gain predicts is what greedy acceptance does on the cut tree."""
    rng = np.random.default_rng(seed)
    tokens = np.array([9, 1, 2, 3, 4, 5])
    logits = rng.standard_normal((6, 10))
    logits[np.arange(6), rng.integers(0, 6, 6)] += 5  # often a child's token
    full, _ = greedy_accept(TREE, tokens, logits)
    gain = counterfactual_gain(TREE, full)
    for n in range(1, 7):
        keep = cut_tree(TREE, n)
        got, _ = greedy_accept(sub_tree(TREE, keep), tokens[keep], logits[keep])
        assert len(got) == gain[n - 1]


def _run(planner: Planner, t: int, steps: int, gain_of, cost_of, draft: float, rows: int = 1) -> list[int]:
    """Drive the planner with a synthetic model: ``rows`` adaptive requests whose full chain of ``t``
    nodes accepts gain_of(step) tokens; a call over rows x width tokens costs cost_of(rows * width)."""
    chain = Tree.from_parents(list(range(-1, t - 1)), score=-np.arange(t, dtype=float))
    gains = [RowGains(t) for _ in range(rows)]
    modes, full = np.full(rows, SPEC_ADAPTIVE), np.full(rows, t)
    widths = []
    for i in range(steps):
        sizes = planner.plan(modes, full, [g.predicted() for g in gains])
        w = int(sizes.max())
        widths.append(w)
        planner.costs.add_verify(rows * w, cost_of(rows * w))
        planner.costs.add_host(w > 1, 0.0, rows)
        if w > 1:
            planner.costs.add_draft(rows, draft)
            for g, n in zip(gains, sizes):
                g.observe(sub_tree(chain, cut_tree(chain, int(n))), list(range(min(gain_of(i), int(n)))))
    return widths


def test_speculates_when_it_pays():
    sizes = _run(Planner(), 6, 30, gain_of=lambda i: 5, cost_of=lambda n: 1.0 + 0.05 * n, draft=0.2)
    # a probe of the full trees (probe_steps drafted steps in a row: the first is cold), then plain
    # steps to measure their cost (the first is cold: the second counts)
    assert sizes[:5] == [6, 6, 6, 1, 1]
    assert all(s > 1 for s in sizes[5:])


def test_falls_back_to_plain_steps_and_probes_less_and_less():
    p = Planner(AdaptiveConfig(probe_every=2, max_probe_every=8, probe_steps=1))  # one-step probes: the gaps
    sizes = _run(p, 6, 60, gain_of=lambda i: 1, cost_of=lambda n: 1.0 + 0.1 * n, draft=0.5)
    assert sizes.count(1) > 45
    probes = [i for i, s in enumerate(sizes) if s > 1][1:]
    gaps = np.diff(probes)
    assert np.all(gaps[1:] >= gaps[:-1]) and gaps[-1] == 8 + 1  # doubling waits, capped


def test_grows_back_when_the_text_becomes_predictable():
    p = Planner(AdaptiveConfig(probe_every=2, max_probe_every=4))
    sizes = _run(p, 6, 60, gain_of=lambda i: 1 if i < 20 else 6, cost_of=lambda n: 1.0 + 0.05 * n, draft=0.2)
    assert sizes[10:20].count(1) >= 7
    assert all(s > 1 for s in sizes[35:])


def test_picks_a_smaller_tree_when_the_tail_does_not_pay():
    """Acceptance stops at 3 tokens while each node costs a lot: a 3-node tree is the best buy, with
    the full tree once every widen_every + 1 drafted steps to learn the sizes past the cut."""
    sizes = _run(Planner(AdaptiveConfig(probe_steps=1)), 6, 40, gain_of=lambda i: 3,
                 cost_of=lambda n: 1.0 + 0.3 * (n - 1), draft=0.1)
    assert sizes[:3] == [6, 1, 1] and sizes[-1] == 3
    wide = [i for i in range(3, 40) if sizes[i] == 6]
    assert wide == [19, 36] and all(sizes[i] == 3 for i in range(3, 40) if i not in wide)


def test_a_tree_cut_early_grows_back_through_the_wide_probes():
    """The first trees accept 2 tokens, so the policy cuts them to 2 nodes; then the chain accepts 7
    of 8 every step. A cut tree never sees the sizes past it: without the full trees every
    widen_every drafted steps the width stays 2 for good; with them it grows to the full chain."""
    def run(widen):
        return _run(Planner(AdaptiveConfig(widen_every=widen, probe_steps=1)), 8, 80,
                    gain_of=lambda i: 2 if i < 8 else 7, cost_of=lambda n: 1.0 + 0.02 * n, draft=0.05)

    sizes = run(16)
    assert sizes[:3] == [8, 1, 1] and set(sizes[3:19]) == {2} and sizes[19] == 8  # cut, then the wide probe
    assert all(s >= 7 for s in sizes[-10:])
    assert set(run(10**6)[3:]) == {2}  # never widened: stuck at the first trees' cut


def test_trees_shrink_smoothly_as_the_batch_grows():
    """Load-aware: the same requests and a compute-bound cost per token row pick narrower trees as
    more rows share the call, down to plain steps, one width at a time (no cliff)."""
    def cost(tokens):  # fixed cost, then compute-bound past 16 token rows
        return 1.0 + 0.02 * tokens + 0.1 * max(0, tokens - 16)

    last = []
    for rows in (1, 2, 3, 4, 8, 16):  # accepted chains of 1..6 tokens, in turn
        last.append(_run(Planner(AdaptiveConfig(max_probe_every=1000, probe_steps=1)), 8, 60,
                         gain_of=lambda i: i % 6 + 1, cost_of=cost, draft=0.05, rows=rows)[-1])
    assert last[0] >= 4 and last[-1] == 1
    assert all(a >= b for a, b in itertools.pairwise(last))  # never wider with more load
    assert any(1 < w < last[0] for w in last)  # a narrower tree before plain steps: no cliff


def test_on_and_off_rows_keep_their_setting():
    """SPEC_ON rows always verify their full tree (the width is at least theirs), SPEC_OFF rows one
    token, idle (prefilling) rows nothing; adaptive rows take min(width, their tree)."""
    p = Planner()
    p.costs.add_verify(4, 1.0)
    p.costs.add_verify(40, 100.0)  # wide calls are ruinous: adaptive alone would go plain
    p.costs.add_draft(4, 0.1)
    p.costs.add_host(False, 0.0)
    p.costs.add_host(False, 0.0)  # (twice: a shape's first measurement is cold)
    p.costs.add_host(True, 0.0)
    modes = np.array([SPEC_ON, SPEC_OFF, IDLE, SPEC_ADAPTIVE])
    full = np.array([3, 1, 1, 8])
    g = np.arange(1, 9, dtype=float)
    sizes = p.plan(modes, full, [g, None, None, g])
    assert sizes.tolist()[:3] == [3, 1, 0] and 1 < sizes[3] <= 8
    assert p.plan(np.array([SPEC_ADAPTIVE]), np.array([8]), [np.ones(8)]).tolist() == [1]  # nothing gained


def _priced(verify: dict, draft: float = 0.0, rows: int = 1, host_plain: float = 0.0, host_spec: float = 0.0,
            cfg: AdaptiveConfig | None = None) -> Planner:
    p = Planner(cfg or AdaptiveConfig(probe_every=64, max_probe_every=64))
    for tokens, t in verify.items():
        p.costs.add_verify(tokens, t)
        p.costs.add_verify(tokens, t)  # (twice: a shape's first measurement may be cold)
    p.costs.add_draft(rows, draft)
    p.costs.add_host(False, host_plain, rows)
    p.costs.add_host(False, host_plain, rows)  # (twice: a shape's first measurement is cold)
    p.costs.add_host(True, host_spec, rows)
    return p


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("eps", "want"), [(-1e-3, 3), (1e-3, 4)])
def test_the_best_width_wins_at_its_boundary(rows, eps, want):
    """Widths 3 and 4 priced to tie, then one nudged past the other: the planner picks the better one,
    for one row and for a batch (the cost is by token rows: rows x width)."""
    gains = np.array([1.0, 2.0, 3.0, 4.0])  # every node accepted: tokens = width
    # rate(3) = 3 / c3, rate(4) = 4 / c4: tie at c4 = 4/3 c3; c3 = 1 + eps tips it
    p = _priced({rows: 1.0, 3 * rows: 1.0 + eps, 4 * rows: 4 / 3}, rows=rows)
    sizes = p.plan(np.full(rows, SPEC_ADAPTIVE), np.full(rows, 4), [gains] * rows)
    assert sizes.tolist() == [want] * rows


@pytest.mark.parametrize("rows", [1, 4])
def test_the_margin_boundary_for_a_batch(rows):
    margin = 1.05
    for gain, spec in ((2 * margin * 1.001, True), (2 * margin * 0.999, False)):
        p = _priced({rows: 1.0, 2 * rows: 2.0}, rows=rows, cfg=AdaptiveConfig(margin=margin, probe_every=64,
                                                                               max_probe_every=64))
        sizes = p.plan(np.full(rows, SPEC_ADAPTIVE), np.full(rows, 2), [np.array([1.0, gain])] * rows)
        assert bool(sizes.max() == 2) is spec and len(set(sizes.tolist())) == 1


@pytest.mark.parametrize("wait", [2, 5])
def test_a_probe_comes_right_after_the_wait(wait):
    """plain_run counts plain decisions; at plain_run == wait the step is still plain, the next probes."""
    p = _priced({1: 1.0, 3: 3.0}, draft=1.0, cfg=AdaptiveConfig(probe_every=wait, max_probe_every=64, probe_steps=1))
    modes, full, g = np.array([SPEC_ADAPTIVE]), np.array([3]), [np.array([1.0, 1.0, 1.0])]
    widths = [int(p.plan(modes, full, g)[0]) for _ in range(wait + 1)]
    assert widths == [1] * wait + [3] and p.probing
    assert int(p.plan(modes, full, g)[0]) == 1 and p.wait == 2 * wait  # the probe lost: wait twice as long


def test_verify_cost_estimates_interpolate_and_extrapolate():
    c = Costs()
    c.add_verify(2, 1.0)
    c.add_verify(10, 3.0)
    assert c.verify_cost(6) == pytest.approx(2.0)  # linear between measured points
    assert c.verify_cost(20) == pytest.approx(6.0)  # past the largest: proportional (compute-bound)
    assert c.verify_cost(1) == pytest.approx(1.0)  # below the smallest: the smallest
    assert np.allclose(c.verify_cost(np.array([2, 6, 20])), [1.0, 2.0, 6.0])
    c.add_verify(2, 0.8)  # the second measurement replaces a higher first (a shape's first call is cold)
    assert c.verify[2] == 0.8
    c.add_verify(2, 1.2)  # then an average, weighted ema to the newest
    assert c.verify[2] == pytest.approx(0.85 * 0.8 + 0.15 * 1.2)
    c.add_verify(10, 4.0)  # a higher second one does not (one sample says little: the lower stands)
    assert c.verify[10] == 3.0


def test_unobserved_sizes_grow_by_the_last_measured_increment():
    g = RowGains(6)
    assert g.predicted().tolist() == [1, 2, 3, 4, 5, 6]  # nothing known: optimistic, so it is measured
    g.observe(Tree.from_parents([-1, 0, 1], score=np.array([0.0, -1, -2])), [0, 1])  # a 3-node cut: gains 1, 2, 2
    assert g.predicted().tolist() == [1, 2, 2, 2, 2, 2]  # the tail adds what the last node added: nothing
    g = RowGains(5, prior=np.array([1.0, 1.5, 1.75]))
    assert g.predicted().tolist() == [1.0, 1.5, 1.75, 2.0, 2.25]
    g = RowGains(4, prior=np.array([1.0, 1.5]))  # the shortest known prefix that has an increment
    assert g.predicted().tolist() == [1.0, 1.5, 2.0, 2.5]


def test_a_noisy_cost_table_never_makes_a_wider_call_cheaper():
    c = Costs()
    for tokens, t in ((8, 6.8), (16, 5.8), (64, 9.9)):
        c.add_verify(tokens, t)
    assert c.verify_cost(16) == pytest.approx(6.8)  # not 5.8: 16 token rows cost at least what 8 did
    assert c.verify_cost(12) == pytest.approx(6.8)
