"""The adaptive speculation policy (graphs.adaptive) on synthetic gains and costs: no graphs needed."""

from __future__ import annotations

import numpy as np
import pytest

from graphs.adaptive import AdaptiveConfig, AdaptivePolicy, counterfactual_gain, cut_tree, sub_tree
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


def _run(policy: AdaptivePolicy, steps: int, gain_of, cost_of, draft: float) -> list[int]:
    """Drive the policy with a synthetic model: a full tree accepts a chain of gain_of(step) tokens."""
    chain = Tree.from_parents(list(range(-1, policy.t - 1)), score=-np.arange(policy.t, dtype=float))
    live = np.array([True])
    sizes = []
    for i in range(steps):
        n = int(policy.plan(live)[0])
        sizes.append(n)
        if n == 1:
            policy.observe(None, [[0]], 1, cost_of(1), None, live)
        else:
            acc = list(range(min(gain_of(i), n)))
            policy.observe([sub_tree(chain, cut_tree(chain, n))], [acc], n, cost_of(n), draft, live)
    return sizes


def test_speculates_when_it_pays():
    p = AdaptivePolicy(1, 6)
    sizes = _run(p, 30, gain_of=lambda i: 5, cost_of=lambda n: 1.0 + 0.05 * n, draft=0.2)
    assert sizes[0] == 6 and sizes[1] == 1  # a full tree, then one plain step to measure its cost
    assert all(s > 1 for s in sizes[2:])


def test_falls_back_to_plain_steps_and_probes_less_and_less():
    p = AdaptivePolicy(1, 6, AdaptiveConfig(probe_every=2, max_probe_every=8))
    sizes = _run(p, 60, gain_of=lambda i: 1, cost_of=lambda n: 1.0 + 0.1 * n, draft=0.5)
    assert sizes.count(1) > 45
    probes = [i for i, s in enumerate(sizes) if s > 1][1:]
    gaps = np.diff(probes)
    assert np.all(gaps[1:] >= gaps[:-1]) and gaps[-1] == 8 + 1  # doubling waits, capped


def test_grows_back_when_the_text_becomes_predictable():
    p = AdaptivePolicy(1, 6, AdaptiveConfig(probe_every=2, max_probe_every=4))
    sizes = _run(p, 60, gain_of=lambda i: 1 if i < 20 else 6, cost_of=lambda n: 1.0 + 0.05 * n, draft=0.2)
    assert sizes[10:20].count(1) >= 7
    assert all(s > 1 for s in sizes[35:])


def test_picks_a_smaller_tree_when_the_tail_does_not_pay():
    """Acceptance stops at 3 tokens while each node costs a lot: a 3-node tree is the best buy."""
    p = AdaptivePolicy(1, 6)
    sizes = _run(p, 20, gain_of=lambda i: 3, cost_of=lambda n: 1.0 + 0.3 * (n - 1), draft=0.1)
    assert sizes[-1] == 3
