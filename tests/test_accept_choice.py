"""The acceptance rules' decisions at their boundaries (graphs.sampling), with a scripted random
stream: which child is accepted when the uniform draw is just below / at / above the child's
share, when typical acceptance's bar is just met, and which bonus token a draw lands on."""

from __future__ import annotations

import numpy as np
import pytest

from graphs.errors import NonFiniteLogitsError
from graphs.sampling import _draw, greedy_accept, sample_accept, typical_accept
from graphs.trees import Tree


class Script:
    """A random stream that returns the given uniforms in turn (and counts what was drawn)."""

    def __init__(self, *u):
        self.u, self.drawn = list(u), 0

    def random(self):
        self.drawn += 1
        return self.u.pop(0)


TWO = Tree.from_parents([-1, 0, 0])  # root with two children
CHAIN = Tree.from_parents([-1, 0, 1])


@pytest.mark.parametrize(("u", "accepted"), [(0.3 - 1e-9, True), (0.3, False), (0.3 + 1e-9, False)])
def test_sample_accept_takes_a_child_while_the_draw_is_below_its_probability(u, accepted):
    """p = [.5, .3, .2], child token 1: accepted iff u * 1 < .3 (at .3: rejected)."""
    probs = np.array([[0.5, 0.3, 0.2], [0.0, 0.0, 1.0]])
    tree = Tree.from_parents([-1, 0])
    acc, bonus = sample_accept(tree, np.array([0, 1]), probs, Script(u, 0.5))
    assert acc == ([0, 1] if accepted else [0])
    # accepted: the leaf's bonus from row 1 (token 2); rejected: from r = [.5, 0, .2] at u = .5 -> token 0
    assert bonus == (2 if accepted else 0)


@pytest.mark.parametrize(("u", "second"), [(2 / 7 - 1e-9, True), (2 / 7 + 1e-9, False)])
def test_sample_accept_the_next_child_draws_against_the_residual(u, second):
    """After token 1 (.3) is rejected the residual mass is .7: token 2 (.2) is accepted iff u * .7 < .2."""
    probs = np.array([[0.5, 0.3, 0.2], [1.0, 0, 0], [1.0, 0, 0]])
    rng = Script(0.9, u, 0.0)
    acc, bonus = sample_accept(TWO, np.array([0, 1, 2]), probs, rng)
    assert acc == ([0, 2] if second else [0])
    assert bonus == 0 and rng.drawn == 3


def test_sample_accept_skips_a_repeated_rejected_token_without_drawing():
    probs = np.array([[0.5, 0.5, 0.0], [1.0, 0, 0], [1.0, 0, 0]])
    rng = Script(0.99, 0.3)  # first child (token 1) rejected; second child, token 1 again: skipped
    acc, bonus = sample_accept(TWO, np.array([0, 1, 1]), probs, rng)
    assert acc == [0] and bonus == 0 and rng.drawn == 2  # one accept draw, one bonus draw


def test_sample_accept_stops_trying_when_nothing_is_left():
    """All the mass on the first child's token, rejected only by rounding (u * 1 >= 1 is impossible
    with a true uniform; scripted here): nothing is left, the second child is not tried."""
    probs = np.array([[0.0, 1.0, 0.0], [1.0, 0, 0], [1.0, 0, 0]])
    rng = Script(1.0, 0.5)
    acc, bonus = sample_accept(TWO, np.array([0, 1, 2]), probs, rng)
    assert acc == [0] and rng.drawn == 1 and bonus == 1  # no mass left: the bonus falls back to argmax(p)


def test_sample_accept_walks_down_a_chain():
    probs = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert sample_accept(CHAIN, np.array([0, 1, 2]), probs, Script(0.5, 0.5, 0.5)) == ([0, 1, 2], 0)


@pytest.mark.parametrize(("u", "token"), [(0.0, 0), (0.5 - 1e-9, 0), (0.5, 2), (0.99, 2)])
def test_draw_lands_on_the_cdf_step(u, token):
    """p = [.5, .3, .5] (unnormalized) with token 1 rejected: r = [.5, 0, .5], cdf [.5, .5, 1]; u below
    .5 -> 0, from .5 on -> 2 (searchsorted right: a zero-mass token is never drawn)."""
    p = np.array([0.5, 0.3, 0.5])
    assert _draw(p, [1], Script(u)) == token
    assert p.tolist() == [0.5, 0.3, 0.5]  # _draw never changes its input
    assert _draw(np.array([0.5, 0.0, 0.5]), [], Script(u)) == token


def test_draw_with_everything_rejected_falls_back_to_argmax():
    assert _draw(np.array([0.2, 0.5, 0.3]), [0, 1, 2], Script(0.5)) == 1


def test_draw_at_the_top_of_the_cdf_takes_the_last_possible_token():
    assert _draw(np.array([0.5, 0.5, 0.0]), [], Script(1.0)) == 1


@pytest.mark.parametrize(("px", "passes"), [(0.09 * 0.999, False), (0.09, False), (0.09 * 1.001, True)])
def test_typical_accept_needs_strictly_more_than_the_bar(px, passes):
    """Low entropy, so the bar is posterior_threshold (.09): a child passes iff p[x] > .09."""
    p0 = np.array([1.0 - px, px, 0.0])
    probs = np.array([p0, [0.0, 0.0, 1.0]])
    tree = Tree.from_parents([-1, 0])
    acc, bonus = typical_accept(tree, np.array([0, 1]), probs, Script(0.0))
    assert acc == ([0, 1] if passes else [0]) and bonus == (2 if passes else 0)


def test_typical_accept_bar_is_the_smaller_of_threshold_and_alpha_exp_minus_entropy():
    """Uniform over 4: H = log 4, alpha * exp(-H) = .3 / 4 = .075 < .09: .25 passes; with alpha 1.1
    the entropy bar is .275 > .09: the threshold (.09) binds and .25 still passes; with threshold .3
    and alpha 1.1 the bar is .275: .25 fails."""
    flat = np.full(4, 0.25)
    probs = np.stack([flat, flat])
    tree = Tree.from_parents([-1, 0])
    toks = np.array([0, 1])
    assert typical_accept(tree, toks, probs, Script(0.0))[0] == [0, 1]
    assert typical_accept(tree, toks, probs, Script(0.0), posterior_alpha=1.1)[0] == [0, 1]
    assert typical_accept(tree, toks, probs, Script(0.0), posterior_threshold=0.3, posterior_alpha=1.1)[0] == [0]
    assert typical_accept(tree, toks, probs, Script(0.0), posterior_threshold=0.3, posterior_alpha=0.9)[0] == [0, 1]


def test_typical_accept_entropy_ignores_zero_probabilities():
    """p = [.5, .5, 0]: H = log 2 (zeros add nothing), so alpha * exp(-H) = alpha / 2; threshold .6:
    alpha .99 -> bar .495 < .5 passes, alpha 1.01 -> bar .505 fails."""
    probs = np.array([[0.5, 0.5, 0.0], [1.0, 0, 0]])
    tree = Tree.from_parents([-1, 0])
    assert typical_accept(tree, np.array([0, 1]), probs, Script(0.0), posterior_threshold=0.6,
                          posterior_alpha=0.99)[0] == [0, 1]
    assert typical_accept(tree, np.array([0, 1]), probs, Script(0.0), posterior_threshold=0.6,
                          posterior_alpha=1.01)[0] == [0]


def test_typical_accept_takes_the_first_passing_child_in_priority_order():
    probs = np.array([[0.1, 0.45, 0.45], [1.0, 0, 0], [1.0, 0, 0]])
    assert typical_accept(TWO, np.array([0, 2, 1]), probs, Script(0.0))[0] == [0, 1]
    assert typical_accept(TWO, np.array([0, 0, 1]), probs, Script(0.0))[0] == [0, 1]  # .1 passes the .09 bar too
    probs = np.array([[0.05, 0.5, 0.45], [1.0, 0, 0], [1.0, 0, 0]])
    assert typical_accept(TWO, np.array([0, 0, 1]), probs, Script(0.0))[0] == [0, 2]  # .05 fails: the second


@pytest.mark.parametrize("kids", [[1, 2], [2, 1]])
def test_greedy_accept_first_matching_child_then_bonus(kids):
    logits = np.array([[0.0, 1.0, 0.5], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    acc, bonus = greedy_accept(TWO, np.array([0, *kids]), logits)
    node = 1 + kids.index(1)  # the child carrying argmax(root) = 1
    assert acc == [0, node] and bonus == int(np.argmax(logits[node]))


def test_greedy_accept_refuses_non_finite_logits():
    with pytest.raises(NonFiniteLogitsError):
        greedy_accept(CHAIN, np.array([0, 1, 2]), np.array([[0.0, np.nan, 0.0]] * 3))


def test_greedy_accept_checks_every_node_it_walks_and_only_those():
    """The chosen logits of every visited node are checked (once, after the walk): a nan or +inf on
    the walk's last node fails; one on a node the walk never reaches is no choice made."""
    walked = np.array([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]])  # tokens 1, 2: the whole chain
    for bad in (np.nan, np.inf):
        logits = walked.copy()
        logits[2, 0] = bad  # the last node's choice (the bonus)
        with pytest.raises(NonFiniteLogitsError):
            greedy_accept(CHAIN, np.array([0, 1, 2]), logits)
    logits = walked.copy()
    logits[1, 2] = np.inf  # node 1's choice: +inf wins its argmax, and is refused
    with pytest.raises(NonFiniteLogitsError):
        greedy_accept(CHAIN, np.array([0, 1, 2]), logits)
    logits = np.array([[0.0, 5.0, 0.0], [np.nan, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert greedy_accept(CHAIN, np.array([0, 2, 1]), logits) == ([0], 1)  # node 1 never walked


def test_typical_accept_default_alpha_is_0_3():
    """Uniform over 12 (p = .083): default bar min(.09, .3 / 12) = .025 passes it; alpha 1.3 would make
    the bar min(.09, .108) = .09 and fail it."""
    flat = np.full(12, 1 / 12)
    tree = Tree.from_parents([-1, 0])
    probs = np.stack([flat, flat])
    assert typical_accept(tree, np.array([0, 5]), probs, Script(0.0))[0] == [0, 1]
    assert typical_accept(tree, np.array([0, 5]), probs, Script(0.0), posterior_alpha=1.3)[0] == [0]


def test_draw_with_only_the_last_token_left_draws_it():
    """r = [0, 0, .2]: the last cdf step holds all the mass (the fallback is only for no mass at all)."""
    assert _draw(np.array([0.5, 0.3, 0.2]), [0, 1], Script(0.5)) == 2
