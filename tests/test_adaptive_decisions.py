"""The adaptive planner's decisions near each boundary, on hand-set costs and gains (graphs.adaptive).

test_adaptive.py drives the policy over many steps; here each decision is pinned where it flips:
the margin, the plain host term, the fast window's margin, the reuse and fast windows' lengths and
keys, the probe wait's doubling, halving and reset, SPEC_ON/SPEC_OFF rows' tokens, the cost
estimates' boundaries, and the setting means (priors). Batch 1 and batch > 1 where the decision
depends on the batch (costs are by token rows and by batch rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from graphs.adaptive import (
    COLD_SKIPS,
    IDLE,
    OUTLIER,
    SPEC_ADAPTIVE,
    SPEC_OFF,
    SPEC_ON,
    AdaptiveConfig,
    Costs,
    Planner,
    RowGains,
    chain_ceiling,
    counterfactual_gain,
    cut_tree,
    plain_inputs,
    static_scores,
    sub_tree,
    tree_ceiling,
)
from graphs.trees import HEAD_DECAY, RANK_DECAY, TOP1, Tree, medusa_tree


def _planner(verify: dict, draft: float = 0.0, rows: int = 1, host_plain: float = 0.0, host_spec: float = 0.0,
             **cfg) -> Planner:
    cfg = {"probe_every": 64, "max_probe_every": 64, "probe_steps": 1, **cfg}  # one-step probes: the waits
    p = Planner(AdaptiveConfig(**cfg))
    for tokens, t in verify.items():
        p.costs.add_verify(tokens, t)
        p.costs.add_verify(tokens, t)  # (twice: a shape's first measurement may be cold)
    p.costs.add_draft(rows, draft)
    p.costs.add_host(False, host_plain, rows)
    p.costs.add_host(False, host_plain, rows)  # (twice: a shape's first measurement is cold)
    p.costs.add_host(True, host_spec, rows)
    return p


def _adaptive(rows: int, full: int):
    return np.full(rows, SPEC_ADAPTIVE), np.full(rows, full)


class Counted:
    """Gains as a callable (the engine's form): counts the decisions that asked for them."""

    def __init__(self, gains):
        self.gains, self.calls = gains, 0

    def __call__(self):
        self.calls += 1
        return self.gains


# ----------------------------------------------------------------------------- the config's bounds


@pytest.mark.parametrize("kw", [dict(ema=0.0), dict(ema=1.0001), dict(margin=0.0), dict(margin=-1.0),
                                dict(probe_every=0), dict(probe_every=5, max_probe_every=4), dict(recheck_every=0),
                                dict(plain_recheck_every=0), dict(widen_every=0)])
def test_config_refuses_values_past_its_bounds(kw):
    with pytest.raises(ValueError):
        AdaptiveConfig(**kw)


@pytest.mark.parametrize("kw", [dict(ema=1.0), dict(ema=1e-6), dict(margin=1e-6),
                                dict(probe_every=1, max_probe_every=1),
                                dict(probe_every=4, max_probe_every=4), dict(recheck_every=1)])
def test_config_accepts_values_at_its_bounds(kw):
    AdaptiveConfig(**kw)


def test_config_defaults_are_the_documented_ones():
    c = AdaptiveConfig()
    assert (c.ema, c.margin, c.probe_every, c.max_probe_every, c.recheck_every, c.plain_recheck_every,
            c.fast_margin, c.widen_every) == (0.15, 1.05, 4, 64, 8, None, 1.25, 16)
    assert Costs().ema == 0.15 and RowGains(3).ema == 0.15


# ----------------------------------------------------------------------------- trees and gains


def test_static_scores_are_the_log_path_probabilities():
    tree = medusa_tree([[0], [1], [0, 0], [0, 1]])
    s = static_scores(tree)
    f = lambda h, r: np.log(TOP1 * HEAD_DECAY**h * RANK_DECAY**r)
    want = {(0,): f(0, 0), (1,): f(0, 1), (0, 0): f(0, 0) + f(1, 0), (0, 1): f(0, 0) + f(1, 1)}
    assert s[0] == 0.0
    got = sorted(s[1:].tolist())
    assert got == pytest.approx(sorted(want.values()))


def test_static_scores_need_heads_and_ranks():
    tree = medusa_tree([[0], [1]])
    for head, rank in ((None, tree.rank), (tree.head, None), (None, None)):
        bare = Tree(tree.parents, tree.depth, tree.mask, tree.children, head=head, rank=rank)
        with pytest.raises(ValueError, match="not a Medusa tree"):
            static_scores(bare)


@pytest.mark.parametrize("bsz", [1, 3])
def test_plain_inputs_verify_each_root_alone(bsz):
    root = np.arange(7, 7 + bsz)
    trees, cand, (depth, mask) = plain_inputs(root)
    assert len(trees) == bsz and all(t.size == 1 for t in trees)
    assert cand.tolist() == [[r] for r in root.tolist()] and cand.dtype == np.int64
    assert depth.shape == (bsz, 1) and not depth.any() and mask.shape == (bsz, 1, 1) and mask.all()


def test_sub_tree_keeps_only_kept_children():
    tree = Tree.from_parents([-1, 0, 0, 1, 3, 2], score=np.array([0, -0.1, -0.9, -0.3, -1.2, -1.0]))
    sub = sub_tree(tree, cut_tree(tree, 3))  # root, 1, 3
    assert sub.parents.tolist() == [-1, 0, 1]
    assert [c.tolist() for c in sub.children] == [[1], [2], []]
    sub = sub_tree(tree, cut_tree(tree, 4))  # root, 1, 2, 3
    assert [c.tolist() for c in sub.children] == [[1, 2], [3], [], []]


def test_counterfactual_gain_by_node_order_without_scores():
    tree = Tree.from_parents([-1, 0, 0, 1])  # no scores: node order is the rank
    assert counterfactual_gain(tree, [0, 1, 3]).tolist() == [1, 2, 2, 3]
    assert counterfactual_gain(tree, [0, 2]).tolist() == [1, 1, 2, 2]


def test_row_gains_prior_of_exactly_the_tree_size_is_used():
    assert RowGains(3, prior=np.array([1.0, 1.5, 1.75])).gain.tolist() == [1.0, 1.5, 1.75]
    assert np.isnan(RowGains(3, prior=np.array([1.0, 1.5, 1.75, 2.0])).gain[1:]).all()  # too long: ignored


def test_row_gains_average_by_ema_and_extend_past_a_cut():
    g = RowGains(4, ema=0.25)
    chain = Tree.from_parents([-1, 0, 1, 2], score=np.array([0.0, -1, -2, -3]))
    assert g.observe(chain, [0, 1, 2, 3]).tolist() == [1, 2, 3, 4]
    assert g.observe(chain, [0]).tolist() == [1, 1, 1, 1]
    assert g.gain.tolist() == [1.0, 0.75 * 2 + 0.25, 0.75 * 3 + 0.25, 0.75 * 4 + 0.25]
    g = RowGains(4)
    cut = sub_tree(chain, cut_tree(chain, 2))
    assert g.observe(cut, [0, 1]).tolist() == [1, 2]  # a 2-node cut measures sizes 1 and 2 only
    assert g.gain[:2].tolist() == [1, 2] and np.isnan(g.gain[2:]).all()
    assert g.predicted().tolist() == [1, 2, 3, 4]  # grows by the last increment


def test_row_gains_never_predict_fewer_tokens_for_a_larger_tree():
    g = RowGains(4, prior=np.array([1.0, 2.0, 1.5, 1.75]))
    assert g.predicted().tolist() == [1.0, 2.0, 2.0, 2.0]
    g = RowGains(5, prior=np.array([1.0, 2.0, 1.5]))  # a falling increment extrapolates flat
    assert g.predicted().tolist() == [1.0, 2.0, 2.0, 2.0, 2.0]


# ----------------------------------------------------------------------------- cost estimates


def test_cost_estimate_boundaries():
    c = Costs()
    assert np.isnan(c.verify_cost(3)) and np.isnan(c.verify_cost(np.array([1, 2]))).all()
    assert c.verify_cost(np.array([1, 2])).shape == (2,)
    assert c.host_cost(True, 4) == 0.0 and c.host_cost(False, 4) == 0.0  # unmeasured host time: nothing
    c.add_verify(4, 2.0)
    c.add_verify(8, 3.0)
    assert c.verify_cost(8) == 3.0 and c.verify_cost(4) == 2.0  # at the measured points: the measurement
    assert c.verify_cost(9) == pytest.approx(3.0 * 9 / 8)  # just past the largest: proportional
    assert c.verify_cost(3) == 2.0 and c.verify_cost(5) == pytest.approx(2.25)
    c.add_host(True, 0.5, rows=2)
    c.add_host(False, 0.25, rows=2)
    assert c.host_cost(True, 2) == 0.5 and c.host_cost(False, 2) == 0.25 and c.host_cost(True, 4) == 1.0
    c.add_draft(2, 1.0)
    assert c.draft_cost(1) == 1.0 and c.draft_cost(3) == pytest.approx(1.5)


def test_cost_tables_refresh_after_a_new_measurement_and_copies_are_independent():
    c = Costs(ema=0.5)
    c.add_verify(2, 1.0)
    assert c.verify_cost(4) == 2.0
    c.add_verify(4, 3.0)  # the cached (xs, ys) must be rebuilt
    assert c.verify_cost(4) == 3.0
    c.add_verify(4, 1.0)
    assert c.verify[4] == 1.0  # the second measurement replaces the first (cold)
    c.add_verify(4, 2.0)
    assert c.verify[4] == 1.5  # then ema 0.5
    d = c.copy()
    d.add_verify(2, 0.6)  # the copy knows 2 was measured once: replaced
    assert d.verify[2] == 0.6 and c.verify[2] == 1.0
    d.add_verify(4, 10.0)
    d.add_draft(1, 1.0)
    d.add_host(True, 1.0)
    d.add_host(False, 1.0)
    assert c.verify == {2: 1.0, 4: 1.5} and not c.draft and not c.host_spec and not c.host_plain
    assert d.ema == 0.5 and d.verify[4] == 0.5 * 1.5 + 0.5 * OUTLIER * 1.5  # (10.0: a stall)


# ----------------------------------------------------------------------------- the margin and the plain host term


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("gain", "spec"), [(2.1 * 0.999, False), (2.1, True), (2.1 * 1.001, True)])
def test_margin_just_below_at_and_above(rows, gain, spec):
    """rate(2) = gain / 2 against margin x rate(1) = 1.05: speculate at the margin and above."""
    p = _planner({rows: 1.0, 2 * rows: 2.0}, rows=rows, margin=1.05)
    sizes = p.plan(*_adaptive(rows, 2), [np.array([1.0, gain])] * rows)
    assert sizes.tolist() == [2 if spec else 1] * rows


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("host_plain", "spec"), [(0.0, False), (1.0, True)])
def test_the_plain_step_pays_its_own_host_time(rows, host_plain, spec):
    """rate(1) = 1 / (verify(rows) + host_plain(rows)), without the drafter and the drafted host time:
    gain 1.6 over a 3 s drafted step beats a 1 s plain step only if the plain step's host time is 1 s."""
    p = _planner({rows: 1.0, 2 * rows: 3.0}, rows=rows, draft=0.0, host_plain=host_plain, host_spec=0.0)
    assert p.plan(*_adaptive(rows, 2), [np.array([1.0, 1.6])] * rows).tolist() == [2 if spec else 1] * rows


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("which", ["draft", "host_spec"])
def test_a_drafted_step_adds_the_drafter_and_its_host_time(rows, which):
    """gain 1.5 at width 2 over verify 1 and 0.6 s more (drafter or drafted host time): 0.94 x a plain
    step, below the margin (had the 0.6 s been taken off, 3.75 x); 0.3 s more: 1.15 x, above it."""
    g = [np.array([1.0, 1.5])] * rows
    p = _planner({rows: 1.0, 2 * rows: 1.0}, rows=rows, **{which: 0.6})
    assert p.plan(*_adaptive(rows, 2), g).tolist() == [1] * rows
    p = _planner({rows: 1.0, 2 * rows: 1.0}, rows=rows, **{which: 0.3})
    assert p.plan(*_adaptive(rows, 2), g).tolist() == [2] * rows


@pytest.mark.parametrize("rows", [1, 2])
def test_a_drafted_step_pays_the_drafter_and_its_host_time(rows):
    """gain 3 at width 2 over verify 1: pays unless draft or host_spec add 2 s (rate 1 < margin)."""
    g = [np.array([1.0, 3.0])] * rows
    assert _planner({rows: 1.0, 2 * rows: 1.0}, rows=rows).plan(*_adaptive(rows, 2), g).max() == 2
    assert _planner({rows: 1.0, 2 * rows: 1.0}, rows=rows, draft=2.0).plan(*_adaptive(rows, 2), g).max() == 1
    assert _planner({rows: 1.0, 2 * rows: 1.0}, rows=rows, host_spec=2.0).plan(*_adaptive(rows, 2), g).max() == 1


def test_rate_formula():
    p = _planner({1: 1.0, 4: 2.0, 2: 1.5}, rows=2, draft=0.5, host_plain=0.25, host_spec=0.75)
    assert p.rate(1, 2, 3.0) == 3.0 / (1.5 + 0.25)
    assert p.rate(2, 2, 3.0) == 3.0 / (2.0 + 0.5 + 0.75)


def test_below_a_margin_of_1_the_plain_step_still_wins_when_it_is_best():
    """margin 0.5: speculation needs only half a plain step's rate, but the best width must be > 1."""
    p = _planner({1: 1.0, 2: 2.0}, margin=0.5)
    assert p.plan(*_adaptive(1, 2), [np.array([1.0, 1.98])]).tolist() == [1] and p.plain_run == 1
    p = _planner({1: 1.0, 2: 2.0}, margin=0.5)
    assert p.plan(*_adaptive(1, 2), [np.array([1.0, 2.02])]).tolist() == [2] and p.plain_run == 0


# ----------------------------------------------------------------------------- modes


def test_spec_on_rows_set_the_narrowest_width_and_skip_the_margin():
    """An ON row of 2 nodes and an adaptive row of 4: widths 2..4, the best by rate wins even below
    the margin (speculation is on anyway), and a plain step is never an option."""
    modes, full = np.array([SPEC_ON, SPEC_ADAPTIVE]), np.array([2, 4])
    g = [np.array([1.0, 2.0]), np.array([1.0, 2.0, 2.9, 3.0])]
    # tokens: width 2 -> 4, width 3 -> 4.9, width 4 -> 5; verify(4) = verify(6) = verify(8) = 1
    p = _planner({2: 0.01, 4: 1.0, 6: 1.0, 8: 1.0}, rows=2, margin=10.0)
    assert p.plan(modes, full, g).tolist() == [2, 4]
    # verify(8) dearer: width 3 (4.9 / 1) beats width 4 (5 / 1.03) and width 2 (4 / 1) although the
    # cheap plain call (4 tokens / 0.01 s) would have won had it been allowed
    p = _planner({2: 0.01, 4: 1.0, 6: 1.0, 8: 1.03}, rows=2, margin=10.0)
    assert p.plan(modes, full, g).tolist() == [2, 3]


def test_an_on_rows_tokens_are_its_full_trees():
    """An ON row (3 nodes, gains [1, 1, 4]) adds its full tree's 4 tokens to every width, which makes
    the cheaper width 3 win over 4 (7 / 1 against 9.5 / 1.5); at 1 token (its 2-node gain) width 4
    would (4 / 1 against 6.5 / 1.5)."""
    modes, full = np.array([SPEC_ON, SPEC_ADAPTIVE]), np.array([3, 4])
    g = [np.array([1.0, 1.0, 4.0]), np.array([1.0, 2.0, 3.0, 5.5])]
    p = _planner({2: 1.0, 6: 1.0, 8: 1.5}, rows=2)
    assert p.plan(modes, full, g).tolist() == [3, 3]


@pytest.mark.parametrize(("gain", "spec"), [(1.5, False), (1.7, True)])
def test_off_rows_count_one_token_each(gain, spec):
    """One adaptive row and two SPEC_OFF rows: tokens(1) = 3, tokens(2) = gain + 2, over verify(3) = 1
    and verify(6) = 1.2 at margin 1: width 2 pays from gain 1.6 (were OFF rows not counted, from 1.2)."""
    modes, full = np.array([SPEC_ADAPTIVE, SPEC_OFF, SPEC_OFF]), np.array([2, 1, 1])
    p = _planner({3: 1.0, 6: 1.2}, rows=3, margin=1.0)
    assert p.plan(modes, full, [np.array([1.0, gain]), None, None]).tolist() == [2 if spec else 1, 1, 1]


def test_idle_rows_take_no_part():
    modes, full = np.array([IDLE, SPEC_ADAPTIVE]), np.array([4, 2])
    p = _planner({2: 1.0, 4: 1.0}, rows=2)
    assert p.plan(modes, full, [None, np.array([1.0, 2.0])]).tolist() == [0, 2]


def test_no_adaptive_row_or_nothing_to_choose_returns_the_on_width():
    p = _planner({1: 1.0})
    assert p.plan(np.array([SPEC_ON, SPEC_OFF]), np.array([3, 1]), [np.ones(3), None]).tolist() == [3, 1]
    # the adaptive row's tree is no larger than the ON row's: nothing to decide
    assert p.plan(np.array([SPEC_ON, SPEC_ADAPTIVE]), np.array([3, 3]), [np.ones(3)] * 2).tolist() == [3, 3]
    assert list(p.history) == [3, 3]
    assert p.plan(np.array([SPEC_OFF]), np.array([1]), [None]).tolist() == [1]


def test_adaptive_rows_without_a_tree_to_cut_are_not_a_plain_run():
    """Adaptive rows whose full tree is the root alone: nothing to decide, so no plain run counts
    towards a probe and no reuse window opens."""
    p = _losing()
    g = Counted([np.array([1.0])])
    for _ in range(3):
        assert p.plan(np.array([SPEC_ADAPTIVE]), np.array([1]), g).tolist() == [1]
    assert p.plain_run == 0 and not p.probing and p.wait == 64
    assert g.calls == 0  # nothing to choose: the rows' gains are not even computed
    p = _losing()
    modes, full = np.array([SPEC_ON, SPEC_ADAPTIVE]), np.array([3, 3])
    for _ in range(2):
        assert p.plan(modes, full, Counted([np.ones(3)] * 2)).tolist() == [3, 3]
    assert p.plain_run == 0 and not p.probing


def test_first_a_drafted_probe_then_plain_steps_to_measure():
    p = Planner()
    modes, full, g = *_adaptive(2, 4), [np.arange(1.0, 5.0)] * 2
    for _ in range(p.cfg.probe_steps):  # nothing drafted yet: the full trees, probe_steps in a row
        assert p.plan(modes, full, g).tolist() == [4, 4] and p.probing
        p.costs.add_draft(2, 0.1)
        p.costs.add_verify(8, 0.1)
    assert p.plan(modes, full, g).tolist() == [1, 1] and not p.probing  # no plain step measured yet
    p.costs.add_host(False, 0.0, 2)
    p.costs.add_verify(2, 1.0)
    assert p.plan(modes, full, g).tolist() == [1, 1]  # measured once: cold, one more
    p.costs.add_host(False, 0.0, 2)
    p.costs.add_verify(2, 1.0)
    assert p.plan(modes, full, g).tolist() == [4, 4]


# ----------------------------------------------------------------------------- the probe wait


def _losing(**cfg):
    """A planner where speculation never pays (gains 1): plain unless probing."""
    return _planner({1: 1.0, 3: 3.0}, draft=1.0, **cfg)


LOSE = [np.array([1.0, 1.0, 1.0])]
WIN = [np.array([1.0, 2.0, 3.0])]
ONE = (np.array([SPEC_ADAPTIVE]), np.array([3]))


@pytest.mark.parametrize(("wait", "after"), [(4, 8), (32, 64), (64, 64)])
def test_a_lost_probe_doubles_the_wait_up_to_the_cap(wait, after):
    p = _losing(probe_every=2, max_probe_every=64)
    p.wait, p.probing = wait, True
    assert p.plan(*ONE, LOSE).tolist() == [1] and p.wait == after and not p.probing


@pytest.mark.parametrize(("wait", "after"), [(16, 8), (4, 2), (2, 2), (3, 2)])
def test_a_won_probe_halves_the_wait_down_to_probe_every(wait, after):
    p = _planner({1: 1.0, 3: 1.0}, probe_every=2, max_probe_every=64)
    p.wait, p.probing, p.last_width = wait, True, 3
    assert p.plan(*ONE, WIN).tolist() == [3] and p.wait == after and not p.probing


@pytest.mark.parametrize("last", [2, 3])
def test_drafted_steps_that_keep_paying_reset_the_wait(last):
    p = _planner({1: 1.0, 3: 1.0}, probe_every=2, max_probe_every=64)
    p.wait, p.last_width = 16, last  # the step before drafted (any width above 1)
    p.plan(*ONE, WIN)
    assert p.wait == 2
    p = _planner({1: 1.0, 3: 1.0}, probe_every=2, max_probe_every=64)
    p.wait, p.last_width = 16, 1  # the step before was plain: not "drafted steps in a row"
    p.plan(*ONE, WIN)
    assert p.wait == 16


def test_a_paying_decision_resets_the_plain_run():
    p = _planner({1: 1.0, 3: 1.0})
    p.plain_run = 5
    p.plan(*ONE, WIN)
    assert p.plain_run == 0


@pytest.mark.parametrize("wait", [2, 5])
def test_probe_exactly_after_wait_plain_steps_deciding_every_step(wait):
    """plain_recheck_every 1 (no reuse window): every step decides; still plain while plain_run <= wait."""
    p = _losing(probe_every=wait, plain_recheck_every=1)
    g = Counted(LOSE)
    widths = [int(p.plan(*ONE, g)[0]) for _ in range(wait + 1)]
    assert widths == [1] * wait + [3] and g.calls == wait + 1


@pytest.mark.parametrize("rows", [1, 3])
def test_probe_exactly_after_wait_plain_steps_with_reuse(rows):
    """plain_run counts plain steps, decided or reused: with wait 3 the 4th step probes even inside a
    reuse window, and only two decisions are made (the first and the probe)."""
    p = _planner({rows: 1.0, 3 * rows: 3.0}, draft=1.0, rows=rows, probe_every=3, max_probe_every=64)
    g = Counted([np.array([1.0, 1.0, 1.0])] * rows)
    widths = [int(p.plan(*_adaptive(rows, 3), g).max()) for _ in range(4)]
    assert widths == [1, 1, 1, 3] and g.calls == 2 and p.probing and p.plain_run == 0
    assert list(p.history) == widths


def test_tree_ceiling_is_the_deepest_kept_path_plus_the_bonus():
    tree = medusa_tree([[0], [1], [2], [0, 0]])  # ranks by static score: [0], [0, 0], [1], [2]
    assert tree_ceiling(tree).tolist() == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert tree_ceiling(tree) is tree_ceiling(tree)  # once per tree
    for n in range(1, 6):  # the deepest node that cut_tree keeps, on the scored tree the proposer verifies
        scored = dataclasses.replace(tree, score=static_scores(tree))
        assert tree_ceiling(scored)[n - 1] == 1 + tree.depth[cut_tree(scored, n)].max()
    plain = Tree.from_parents([-1, 0, 0, 1])  # no scores, no heads: node order
    assert tree_ceiling(plain).tolist() == [1.0, 2.0, 2.0, 3.0]
    assert chain_ceiling(5, 2).tolist() == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert chain_ceiling(2, 4).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("rows", [1, 2])
def test_where_no_width_can_pay_the_probe_waits_the_longest(rows):
    """_losing's full tree costs 4 plain steps and can emit at most 3 tokens (the ceiling): no gains
    could make it pay, so the first plain decision holds for max_probe_every steps, not probe_every."""
    p = _planner({rows: 1.0, 3 * rows: 3.0}, draft=1.0, rows=rows, probe_every=4, max_probe_every=64)
    g, caps = Counted([np.array([1.0, 1.0, 1.0])] * rows), [np.array([1.0, 2.0, 3.0])] * rows
    widths = [int(p.plan(*_adaptive(rows, 3), g, caps).max()) for _ in range(65)]
    assert widths == [1] * 64 + [3] and g.calls == 2 and p.wait == 4
    p = _planner({rows: 1.0, 3 * rows: 3.0}, draft=1.0, rows=rows, probe_every=4, max_probe_every=64)
    p.plan(*_adaptive(rows, 3), g, caps)
    assert p.due == 64 and p.plain_ahead() == 63  # the engine's plain run may take them all


# a full tree of 3 costs two plain steps (verify flat, drafter one step): it pays at 2.1 tokens
# (margin 1.05); it can emit 3. Gains g at width 3 must climb f = (2.1 - g) / (3 - g) of their room
@pytest.mark.parametrize(("gain", "cap", "due"), [
    (2.09, 3.0, 4),    # f ~ 0.01: probe as soon as the wait says
    (1.2, 3.0, 16),    # f = 0.5: 4 * 16 ** 0.5
    (1.0, 3.0, 18),    # f = 0.55: 4 * 16 ** 0.55 = 18.4
    (1.0, 2.1, 64),    # the best case only just pays (f = 1): the longest wait
    (1.0, 2.0, 64),    # the best case cannot pay
])
def test_the_probe_wait_grows_with_the_distance_from_paying(gain, cap, due):
    p = _planner({1: 1.0, 3: 1.0}, draft=1.0, probe_every=4, max_probe_every=64)
    assert p.plan(*ONE, [np.array([1.0, 1.0, gain])], [np.array([1.0, 2.0, cap])]).tolist() == [1]
    assert p.due == due


def test_the_probe_wait_is_the_doubling_one_without_ceilings_or_where_it_is_longer():
    p = _losing(probe_every=4, max_probe_every=64)
    p.plan(*ONE, LOSE)  # no ceilings (unknown): the wait
    assert p.due == 4
    p = _losing(probe_every=4, max_probe_every=64)
    p.plan(*ONE, LOSE, [None])  # a row's ceiling unknown
    assert p.due == 4
    p = _planner({1: 1.0, 3: 1.0}, draft=1.0, probe_every=4, max_probe_every=64)
    p.wait = 32  # lost probes doubled it past the distance's 4
    p.plan(*ONE, [np.array([1.0, 1.0, 2.09])], [np.array([1.0, 2.0, 3.0])])
    assert p.due == 32


def test_a_probe_that_wins_ends_the_long_wait():
    p = _planner({1: 1.0, 3: 1.0}, draft=1.0, probe_every=4, max_probe_every=64)
    lose, caps = [np.array([1.0, 1.0, 1.0])], [np.array([1.0, 2.0, 2.0])]
    assert [int(p.plan(*ONE, lose, caps)[0]) for _ in range(65)] == [1] * 64 + [3] and p.probing
    assert p.plan(*ONE, [np.array([1.0, 2.0, 3.0])], [np.array([1.0, 2.0, 3.0])]).tolist() == [3]  # predictable
    assert p.due == p.wait == 4 and p.plain_ahead() == 0


# ----------------------------------------------------------------------------- the reuse and fast windows


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("recheck", [1, 3, 8])
def test_plain_decisions_are_reused_for_plain_recheck_every_steps(rows, recheck):
    p = (_losing(plain_recheck_every=recheck) if rows == 1
         else _planner({2: 1.0, 6: 3.0}, draft=1.0, rows=2, plain_recheck_every=recheck))
    g = Counted([np.array([1.0, 1.0, 1.0])] * rows)
    for i in range(3 * recheck):
        assert p.plan(*_adaptive(rows, 3), g).tolist() == [1] * rows
        assert g.calls == i // recheck + 1, i  # a decision every plain_recheck_every steps
        assert not p.fast
    assert p.plain_run == 3 * recheck


@pytest.mark.parametrize("wait", [4, 64])
def test_a_plain_decision_holds_until_the_probe_by_default(wait):
    """plain_recheck_every None: the first plain decision after a plain step holds (plain_ahead says
    so, for the engine's run) until the probe decides again; recheck_every does not bound it."""
    p = _losing(probe_every=wait, max_probe_every=64, recheck_every=2)
    g = Counted(LOSE)
    widths = [int(p.plan(*ONE, g)[0]) for _ in range(wait + 1)]
    assert widths == [1] * wait + [3] and g.calls == 2  # the first decision and the probe
    p = _losing(probe_every=wait, max_probe_every=64)
    p.plan(*ONE, g)
    p.plan(*ONE, g)  # decided after a plain step: the window opens
    assert p.plain_ahead() == wait - 2


def test_a_plain_decision_is_not_reused_for_other_rows():
    p = _losing(recheck_every=8)
    g = Counted(LOSE)
    p.plan(*ONE, g)
    p.plan(np.array([SPEC_ADAPTIVE]), np.array([2]), Counted([np.array([1.0, 1.0])]))  # another tree size
    p.plan(*ONE, g)
    assert g.calls == 2
    g2 = Counted(LOSE * 2)
    p.plan(np.array([SPEC_ADAPTIVE, SPEC_OFF]), np.array([3, 1]), g2)  # another mode mix
    assert g2.calls == 1


def test_the_first_plain_decision_is_reused_only_after_a_plain_run():
    """The measuring plain step (no plain host time yet) opens no reuse window."""
    p = _planner({1: 1.0, 3: 3.0}, draft=1.0)
    p.costs.host_plain.clear()
    g = Counted(LOSE)
    p.plan(*ONE, g)  # the measuring plain step: plain_run stays 0
    p.costs.add_host(False, 0.0)
    p.plan(*ONE, g)
    assert g.calls == 2


def _paying(fast_margin=1.25, rows=1, ratio=2.0):
    """Full trees (3 nodes, all accepted) at `ratio` x the plain step's rate (2 tokens/s)."""
    return _planner({rows: 0.5, 3 * rows: 1.5 / ratio}, rows=rows, fast_margin=fast_margin)


@pytest.mark.parametrize("rows", [1, 2])
def test_full_trees_that_clearly_pay_are_kept_recheck_every_steps(rows):
    p = _paying(rows=rows)
    g = Counted([np.array([1.0, 2.0, 3.0])] * rows)
    fast = []
    for _ in range(17):
        assert p.plan(*_adaptive(rows, 3), g).tolist() == [3] * rows
        fast.append(p.fast)
    assert fast == [False] + [True] * 7 + [False] + [True] * 7 + [False]
    assert g.calls == 3


@pytest.mark.parametrize(("ratio", "kept"), [(1.25 * 0.999, False), (1.25, True), (1.25 * 1.001, True)])
def test_the_fast_margin_just_below_at_and_above(ratio, kept):
    p = _paying(ratio=ratio)
    g = Counted(WIN)
    p.plan(*ONE, g)
    p.plan(*ONE, g)
    assert p.fast is kept and g.calls == (1 if kept else 2)


def test_the_fast_window_needs_the_full_trees():
    """A clearly paying cut (best width below the full tree) is decided again every step."""
    p = _planner({1: 1.0, 2: 0.5, 3: 3.0})
    g = Counted([np.array([1.0, 2.0, 2.0])])
    assert p.plan(*ONE, g).tolist() == [2]
    assert p.plan(*ONE, g).tolist() == [2] and g.calls == 2 and not p.fast


def test_end_fast_and_other_rows_end_the_window():
    p = _paying()
    g = Counted(WIN)
    p.plan(*ONE, g)
    p.plan(*ONE, g)
    assert p.fast
    p.end_fast()  # a wholly rejected draft
    p.plan(*ONE, g)
    assert not p.fast and g.calls == 2
    p.plan(*ONE, g)
    assert p.fast
    p.plan(np.array([SPEC_ADAPTIVE]), np.array([2]), Counted([np.array([1.0, 2.0])]))
    assert not p.fast


def test_a_fast_window_keeps_the_last_width_for_spec_on_rows_too():
    """In the window the width is reused as it was; the sizes still follow each row's mode."""
    modes, full = np.array([SPEC_ADAPTIVE, SPEC_OFF]), np.array([3, 1])
    g = Counted([np.array([1.0, 2.0, 3.0]), None])
    p2 = _planner({2: 1.0, 6: 0.5}, rows=2)
    assert p2.plan(modes, full, g).tolist() == [3, 1]
    assert p2.plan(modes, full, g).tolist() == [3, 1] and p2.fast and p2.last_width == 3


def test_a_decision_clears_both_windows():
    p = _paying()
    g = Counted(WIN)
    p.plan(*ONE, g)
    assert p._fast_left == 7
    p.plan(np.array([SPEC_ADAPTIVE]), np.array([2]), Counted([np.array([1.0, 1.0])]))  # decided: plain
    assert p._fast_left == 0


# ----------------------------------------------------------------------------- setting means (priors)


def test_learn_is_a_plain_mean_of_the_first_50_then_a_slow_average():
    p = Planner()
    for i in range(50):
        p.learn("k", np.array([1.0, float(i)]))
    mean, n = p.priors["k"]
    assert n == 50 and mean[1] == pytest.approx(24.5)
    p.learn("k", np.array([1.0, 100.0]))
    assert p.priors["k"][0][1] == pytest.approx(0.98 * 24.5 + 0.02 * 100.0)


def test_learn_extends_the_mean_to_longer_gains_and_prior_is_a_copy():
    p = Planner()
    p.learn("k", np.array([1.0, 2.0]))
    p.learn("k", np.array([1.0, 3.0, 4.0]))
    mean, n = p.priors["k"]
    assert n == 2 and mean.tolist() == [1.0, 2.5, 4.0]
    got = p.prior("k")
    got[1] = 99.0
    assert p.prior("k").tolist() == [1.0, 2.5, 4.0] and p.prior("other") is None


def test_carry_copies_costs_and_priors():
    a = Planner()
    a.costs.add_verify(2, 1.0)
    a.learn("k", np.array([1.0, 2.0]))
    b = Planner().carry(a.costs, a.priors)
    assert b.costs is not a.costs and b.costs.verify == {2: 1.0} and b.prior("k").tolist() == [1.0, 2.0]
    b.costs.add_verify(2, 3.0)
    b.learn("k", np.array([1.0, 4.0]))
    assert a.costs.verify == {2: 1.0} and a.prior("k").tolist() == [1.0, 2.0]
    c = Planner().carry(None)
    assert not c.costs.verify and c.priors == {}


def test_cost_estimates_are_numpys_to_the_last_bit():
    """Costs._estimate computes a number in plain Python (each numpy call is slow right after a graph
    call): the same value as numpy's interpolation, to the last bit, so the policy's ties break as
    they did (a measured size, one between two, below the smallest, past the largest)."""
    import random

    from graphs.adaptive import Costs

    rng = random.Random(0)
    for _ in range(3000):
        table = {k: rng.random() * 1e-2 for k in rng.sample(range(1, 40), rng.randint(1, 6))}
        costs = Costs()
        costs.verify = table
        x = rng.choice([rng.randint(0, 60), rng.random() * 60, max(table)])
        xs = np.array(sorted(table), dtype=np.float64)
        ys = np.maximum.accumulate(np.array([table[k] for k in sorted(table)]))
        want = float(np.where(x > xs[-1], ys[-1] * x / xs[-1], np.interp(x, xs, ys)))
        assert costs.verify_cost(x) == want, (table, x)
        assert costs.verify_cost(np.array([x]))[0] == want


def test_a_tie_between_widths_goes_to_the_narrower():
    """Two widths that emit the same tokens at the same measured cost: the narrower one, as the numpy
    policy chose (regression: the plain-Python estimate at the largest measured size once rounded
    c * 3 / 3 != c and took the wider width, which changes a sampled request's random stream)."""
    from graphs.adaptive import SPEC_ADAPTIVE, Planner

    c = next(v for v in np.linspace(1e-3, 9e-3, 1000).tolist() if v * 3 / 3 != v)
    p = Planner()
    p.costs.verify = {1: 0.6 * c, 2: c, 3: c}  # 2 and 3 token rows measured at the same cost
    p.costs.draft, p.costs.host_plain, p.costs.host_spec = {1: 1e-4}, {1: 1e-5}, {1: 1e-5}
    assert p.plan(np.array([SPEC_ADAPTIVE]), np.array([4]), [np.array([1.0, 2.0, 2.0, 2.0])]).tolist() == [2]


# ----------------------------------------------------------------------------- cold steps and probe bursts


def test_a_cold_measurement_only_fills_an_empty_entry():
    c = Costs()
    c.add_verify(4, 3.0, cold=True)  # nothing known: a cold measurement is better than none
    assert c.verify == {4: 3.0}
    c.add_verify(4, 1.0)  # the next warm one replaces it (a shape's first measurement)
    c.add_verify(4, 9.0, cold=True)  # a cold one after it moves nothing
    c.add_verify(2, 9.0, cold=True)  # nor fills another size (the estimate's running maximum would
    assert c.verify_cost(4) == 1.0  # carry 9.0 onto size 4)
    c.add_draft(1, 0.5)
    c.add_draft(1, 0.1)
    c.add_draft(1, 7.0, cold=True)
    c.add_host(True, 0.2, 1)
    c.add_host(True, 0.2, 1)
    c.add_host(True, 5.0, 1, cold=True)
    assert c.verify == {4: 1.0} and c.draft == {1: 0.1} and c.host_spec == {1: 0.2}
    c.add_verify(4, 2.0)  # warm ones average in as before
    assert c.verify[4] == pytest.approx(0.85 * 1.0 + 0.15 * 2.0)


def test_a_stalled_call_moves_the_average_by_at_most_outlier_times():
    c = Costs()
    c.add_verify(4, 1.0)
    c.add_verify(4, 1.0)
    c.add_verify(4, 10.0)  # a stall: averaged in as OUTLIER x the average
    assert c.verify[4] == pytest.approx(0.85 + 0.15 * OUTLIER)
    for _ in range(30):  # a lasting change still gets through, OUTLIER x at a time
        c.add_verify(4, 10.0)
    assert c.verify[4] == pytest.approx(10.0, rel=0.05)
    c.add_verify(4, 0.1)  # faster calls are averaged in as they are
    assert c.verify[4] < 10.0 * 0.86
    c.add_verify(2, 1.0)
    c.add_verify(2, 9.0)  # a second measurement replaces the first only where it is lower
    assert c.verify[2] == 1.0
    c.host_plain[1] = 0.0  # a zero (a test's fixed cost) is no bound: the next one counts
    c.add_host(False, 0.5)
    assert c.host_plain[1] == pytest.approx(0.15 * 0.5)


def test_cold_measurements_count_once_nothing_else_comes():
    """Under a stream of arrivals every decode step may follow a prefill chunk: after COLD_SKIPS cold
    measurements in a row, the next is folded in (cold is then what the calls cost)."""
    c = Costs()
    c.add_verify(1, 1.0)
    c.add_verify(1, 1.0)
    for _ in range(COLD_SKIPS):
        c.add_verify(1, 5.0, cold=True)
    assert c.verify[1] == 1.0
    c.add_verify(1, 1.5, cold=True)
    assert c.verify[1] == pytest.approx(0.85 * 1.0 + 0.15 * 1.5)
    folded = c.verify[1]
    c.add_verify(1, 1.5, cold=True)  # and every cold one after it, until a warm one comes
    assert c.verify[1] > folded
    c.add_verify(1, 1.0)  # a warm one starts the count again
    before = c.verify[1]
    c.add_verify(1, 5.0, cold=True)
    assert c.verify[1] == before
    assert c.copy()._skipped == c._skipped
    # counted by size: warm measurements of another size (a prefill's, every step) do not reset it
    c = Costs()
    c.add_verify(1, 1.0)
    for _ in range(COLD_SKIPS):
        c.add_verify(8, 3.0)  # warm, another size
        c.add_verify(4, 2.0, cold=True)  # never measured warm
    assert 4 not in c.verify
    c.add_verify(4, 2.0, cold=True)
    assert c.verify[4] == 2.0


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_a_probe_drafts_probe_steps_in_a_row_then_decides(steps):
    p = _losing(probe_every=2, max_probe_every=64, probe_steps=steps)
    widths = [int(p.plan(*ONE, LOSE)[0]) for _ in range(2 + steps)]
    assert widths == [1, 1] + [3] * steps  # the wait, then the burst
    assert int(p.plan(*ONE, LOSE)[0]) == 1 and p.wait == 4 and not p.probing  # lost: decided once, after it
    g = Counted(LOSE)
    p = _losing(probe_every=2, max_probe_every=64, probe_steps=steps)
    for _ in range(2 + steps):
        p.plan(*ONE, g)
    assert g.calls == 2  # a plain decision (held until the probe), the probe's: its later steps reuse it


@pytest.mark.parametrize("every", [1, 2, 4])
def test_once_drafting_is_known_warm_a_probe_is_one_step_but_every_rewarm_every(every):
    p = _losing(probe_every=2, max_probe_every=2, probe_steps=3, rewarm_every=every)
    p.costs.add_draft(1, 1.0)  # a second measurement: drafting's cost known warm
    widths = [int(p.plan(*ONE, LOSE)[0]) for _ in range(40)]
    bursts = "".join("3" if w > 1 else "." for w in widths).split(".")
    lengths = [len(b) for b in bursts if b]
    assert lengths[:2 * every] == ([1] * (every - 1) + [3]) * 2


def _drive(planner: Planner, steps: int, mark_cold: bool, t: int = 4, accepted: int = 3) -> list[int]:
    """A machine where a drafted step costs 1.5 in a row but 4.0 right after a plain step (plain: 1.0),
    and every tree accepts ``accepted`` tokens: drafting pays 2x while it lasts, a lone probe loses."""
    chain = Tree.from_parents(list(range(-1, t - 1)), score=-np.arange(t, dtype=float))
    gains, modes, full = RowGains(t), np.array([SPEC_ADAPTIVE]), np.array([t])
    widths, last = [], False
    for _ in range(steps):
        w = int(planner.plan(modes, full, [gains.predicted()])[0])
        drafted = w > 1
        cold = drafted and not last and mark_cold
        planner.costs.add_verify(w, (1.5 if last else 4.0) if drafted else 1.0, cold)
        planner.costs.add_host(drafted, 0.0, 1, cold)
        if drafted:
            planner.costs.add_draft(1, 0.0, cold)
            gains.observe(sub_tree(chain, cut_tree(chain, w)), list(range(min(accepted, w))))
        widths.append(w)
        last = drafted
    return widths


def test_cold_probes_do_not_keep_the_policy_plain():
    """Measured on the 19M int4 model: probes among plain steps cost 1.5x what drafted steps in a row
    do, and the policy, folding them in, stayed plain (tau 1.03) where drafting paid 1.2-1.35x. With
    the cold steps left out and probes of probe_steps, it drafts; as it did, it stays plain."""
    new = _drive(Planner(), 200, mark_cold=True)
    old = _drive(Planner(AdaptiveConfig(probe_steps=1)), 200, mark_cold=False)
    assert sum(w > 1 for w in new[20:]) == 180  # drafting from the first decision on
    assert sum(w > 1 for w in old[20:]) < 20  # a probe now and then, each one cold and lost


def test_plain_steps_until_the_plain_call_itself_is_measured_warm():
    """Host time known warm is not enough: the plain call of these rows must be measured twice too
    (one call measured 1.17 ms on the 19M int4 model where they cost 0.3-0.45, and stayed)."""
    p = Planner()
    modes, full, g = *_adaptive(1, 4), [np.arange(1.0, 5.0)]
    p.costs.add_draft(1, 0.1)
    p.costs.add_draft(1, 0.1)
    p.costs.add_verify(4, 0.1)
    p.costs.add_verify(4, 0.1)
    p.costs.add_host(True, 0.0)
    p.costs.add_host(False, 0.0)
    p.costs.add_host(False, 0.0)  # host time: warm
    p.costs.add_verify(1, 1.0)  # the plain call: once
    assert p.plan(modes, full, g).tolist() == [1]
    p.costs.add_verify(1, 1.0)
    assert p.plan(modes, full, g).tolist() == [4]
