"""Acceptance rules: greedy equals greedy decoding, speculative sampling is lossless."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from helpers import chi2_sf

from graphs.sampling import greedy_accept, process_logits, sample_accept, typical_accept
from graphs.trees import Tree

# --------------------------------------------------------------------------------------------
# Greedy


def test_greedy_accept_worked_example():
    tree = Tree.from_parents([-1, 0, 0, 1])
    tokens = np.array([9, 4, 5, 6])
    logits = np.eye(8)[[5, 0, 6, 1]]  # argmax per node: 5, 0, 6, 1
    assert greedy_accept(tree, tokens, logits) == ([0, 2], 6)


def _base_logits(context: tuple[int, ...], vocab: int) -> np.ndarray:
    """A deterministic toy base model: logits of the next token given the whole context."""
    rng = np.random.default_rng(zlib.crc32(np.array(context, dtype=np.int64).tobytes()))
    return rng.normal(size=vocab)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_accept_equals_greedy_decoding(seed):
    rng = np.random.default_rng(seed)
    vocab, T = 4, int(rng.integers(1, 25))
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
    tree = Tree.from_parents(parents)
    tokens = np.concatenate(([seed % vocab], rng.integers(0, vocab, T - 1)))  # (T,) duplicates likely
    context = [(int(tokens[0]),)]
    for i in range(1, T):
        context.append((*context[parents[i]], int(tokens[i])))
    logits = np.stack([_base_logits(c, vocab) for c in context])  # (T, V)

    accepted, bonus = greedy_accept(tree, tokens, logits)
    emitted = [int(t) for t in tokens[accepted[1:]]] + [bonus]
    # plain greedy decoding from the root, one token at a time
    ctx, greedy = context[0], []
    for _ in emitted:
        greedy.append(int(np.argmax(_base_logits(ctx, vocab))))
        ctx = (*ctx, greedy[-1])
    assert emitted == greedy
    assert all(tree.parents[b] == a for a, b in itertools.pairwise(accepted))
    assert bonus not in tokens[tree.children[accepted[-1]]]  # it stopped only when it had to


# --------------------------------------------------------------------------------------------
# process_logits

_P4 = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, _P4),
        ({"top_k": 2}, [0.625, 0.375, 0, 0]),
        ({"top_k": 4}, _P4),
        ({"top_k": 9}, _P4),
        ({"top_p": 0.75}, [0.625, 0.375, 0, 0]),  # mass above: 0, .5, .8, .95
        ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        ({"top_p": 0.1}, [1, 0, 0, 0]),  # the most probable token always stays
        ({"temperature": 2.0}, np.sqrt(_P4) / np.sqrt(_P4).sum()),
        ({"temperature": 0.0}, [1, 0, 0, 0]),
    ],
)
def test_process_logits_hand_computed(kwargs, expected):
    kwargs = {"temperature": 1.0} | kwargs
    probs = process_logits(np.log(_P4), **kwargs)
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, expected, atol=1e-12)


def test_process_logits_top_k_before_top_p():
    # top_k=3 first: [4/9, 3/9, 2/9, 0]; then top_p=.75: mass above 0, .44, .78 -> keep two.
    # (top_p first would keep three: mass above 0, .4, .7 < .75.)
    probs = process_logits(np.log([0.4, 0.3, 0.2, 0.1]), temperature=1.0, top_k=3, top_p=0.75)
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0, 0], atol=1e-12)


def test_process_logits_top_k_keeps_ties_and_batches():
    logits = np.array([[[1.0, 1.0, 0.0]], [[0.0, 2.0, 1.0]]])  # (2, 1, V)
    probs = process_logits(logits, temperature=1.0, top_k=1)
    np.testing.assert_allclose(probs, [[[0.5, 0.5, 0.0]], [[0.0, 1.0, 0.0]]])
    assert probs.shape == logits.shape


def test_process_logits_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(np.zeros(3), temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(np.zeros(3), temperature=1.0, top_p=0.0)


# --------------------------------------------------------------------------------------------
# Lossless speculative sampling: a statistical test that can fail


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of counts to probabilities; cells with probability 0 must be empty."""
    observed, probs = observed.ravel(), probs.ravel()
    if np.any(observed[probs == 0] > 0):
        return 0.0
    obs, exp = observed[probs > 0], probs[probs > 0] * observed.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    try:
        from scipy.stats import chi2
    except ImportError:
        return chi2_sf(stat, obs.size - 1)
    return float(chi2.sf(stat, obs.size - 1))


@pytest.mark.parametrize(("x", "df"), [(3.841, 1), (18.307, 10), (0.5, 3), (40.0, 35), (90.0, 35), (1e-3, 2)])
def test_chi2_fallback_matches_tables(x, df):
    scipy_stats = pytest.importorskip("scipy.stats")
    assert chi2_sf(x, df) == pytest.approx(scipy_stats.chi2.sf(x, df), rel=1e-9, abs=1e-14)


# A toy base model over V = 6 tokens and one tree covering the hard cases:
#
#   root (ctx r) ── n1 "2" ── n5 "1" ── n9 "0"      n2 "2" duplicates n1 (same context, so the
#                 │         ├ n6 "3"               same base row) and must never be accepted;
#                 │         └ n7 "1" (dup of n5)   n8 "5" has base probability 0 at n3;
#                 ├ n2 "2" ── n10 "4"              n4 is a leaf (bonus drawn from its row).
#                 ├ n3 "4" ── n8 "5"
#                 └ n4 "0"
V = 6
PARENTS = [-1, 0, 0, 0, 0, 1, 1, 1, 3, 5, 2]
TOKENS = np.array([3, 2, 2, 4, 0, 1, 3, 1, 5, 0, 4])
P_ROOT = np.array([0.1, 0.05, 0.35, 0.1, 0.25, 0.15])  # p(x1)
P_AFTER = {  # p(x2 | x1) for the first-layer tokens: the rows at n1 (= n2), n3, n4
    2: np.array([0.3, 0.25, 0.05, 0.2, 0.1, 0.1]),
    4: np.array([0.2, 0.2, 0.2, 0.2, 0.2, 0.0]),
    0: np.array([0.05, 0.05, 0.6, 0.1, 0.1, 0.1]),
}
# x1 outside the tree's first layer ends the step; p(x2 | x1) is then the next step's root row
P_NEXT = {x: np.roll(np.array([0.4, 0.3, 0.1, 0.1, 0.05, 0.05]), x) for x in (1, 3, 5)}
P_DEEP = np.array([0.15, 0.15, 0.2, 0.2, 0.1, 0.2])  # rows below depth 1 (any distribution)
PROBS = np.stack([P_ROOT, P_AFTER[2], P_AFTER[2], P_AFTER[4], P_AFTER[0], *[P_DEEP] * 6])  # (T, V)
COND = np.stack([P_AFTER.get(x, P_NEXT.get(x)) for x in range(V)])  # (V, V) p(x2 | x1), the base
JOINT = P_ROOT[:, None] * COND  # (V, V) p(x1, x2)


def _first_two_tokens(sampler, trials: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts of x1 (V,), of (x1, x2) (V, V) and of node visits (T,) over ``trials`` steps."""
    tree, rng = Tree.from_parents(PARENTS), np.random.default_rng(seed)
    pairs = np.zeros((V, V), dtype=np.int64)
    visits = np.zeros(len(PARENTS), dtype=np.int64)
    cdf = np.cumsum(COND, axis=1)  # (V, V)
    cdf[:, -1] = 1.0
    for _ in range(trials):
        accepted, bonus = sampler(tree, TOKENS, PROBS, rng)
        visits[accepted] += 1
        emitted = [*TOKENS[accepted[1:]].tolist(), bonus]
        if len(emitted) == 1:  # the next step draws x2 from its root row, the base's p(x2 | x1)
            emitted.append(int(np.searchsorted(cdf[emitted[0]], rng.random(), side="right")))
        pairs[emitted[0], emitted[1]] += 1
    return pairs.sum(axis=1), pairs, visits


def test_sample_accept_is_lossless():
    first, pairs, visits = _first_two_tokens(sample_accept, trials=120_000, seed=0)
    assert _chi2_pvalue(first, P_ROOT) > 1e-3
    assert _chi2_pvalue(pairs, JOINT) > 1e-3
    assert visits[2] == 0 and visits[7] == 0 and visits[8] == 0  # duplicates and a p=0 token
    assert visits[1] > 0 and visits[5] > 0 and visits[9] > 0  # deeper nodes are reached


def _accept_argmax(tree, tokens, probs, rng):
    """WRONG: accepts a child outright when it carries the argmax, else never (bonus from p)."""
    n, accepted = 0, [0]
    while True:
        best = int(np.argmax(probs[n]))
        kids = [c for c in tree.children[n] if tokens[c] == best]
        if not kids:
            return accepted, int(rng.choice(len(probs[n]), p=probs[n]))
        n = kids[0]
        accepted.append(n)


def _bonus_from_p(tree, tokens, probs, rng):
    """WRONG: the right acceptance test, but a rejected step's bonus is drawn from p, not r."""
    n, accepted = 0, [0]
    while True:
        p = probs[n]
        nxt = next((c for c in tree.children[n] if rng.random() < p[tokens[c]]), None)
        if nxt is None:
            return accepted, int(rng.choice(len(p), p=p))
        n = nxt
        accepted.append(n)


@pytest.mark.parametrize("sampler", [_accept_argmax, _bonus_from_p])
def test_lossless_check_catches_a_wrong_sampler(sampler):
    first, pairs, _ = _first_two_tokens(sampler, trials=20_000, seed=0)
    assert min(_chi2_pvalue(first, P_ROOT), _chi2_pvalue(pairs, JOINT)) < 1e-3


def test_sample_accept_leaf_and_root_only():
    rng = np.random.default_rng(0)
    tree = Tree.from_parents([-1])
    draws = [sample_accept(tree, np.array([1]), P_ROOT[None], rng) for _ in range(20_000)]
    assert all(acc == [0] for acc, _ in draws)
    counts = np.bincount([b for _, b in draws], minlength=V)
    assert _chi2_pvalue(counts, P_ROOT) > 1e-3


def test_sample_accept_certain_tokens_always_accepted():
    tree = Tree.from_parents([-1, 0, 1])
    probs = np.eye(4)[[2, 3, 1]]  # one-hot rows: the base is certain
    for seed in range(20):
        assert sample_accept(tree, np.array([0, 2, 3]), probs, np.random.default_rng(seed)) == ([0, 1, 2], 1)


# --------------------------------------------------------------------------------------------
# Typical acceptance (Medusa): not lossless, deterministic given the probabilities


def test_typical_accept_takes_the_first_passing_child():
    tree = Tree.from_parents([-1, 0, 0, 1, 2])
    tokens = np.array([0, 1, 2, 3, 3])
    probs = np.array(
        [
            [0.0, 0.05, 0.95, 0.0],  # low entropy: bar .09; token 1 (.05) fails, token 2 passes
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 0.0, 0.0, 1.0],  # token 3 certain: passes
            [1.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 0.0, 0.0],  # leaf: bonus from this row
        ]
    )
    assert typical_accept(tree, tokens, probs, np.random.default_rng(0)) == ([0, 2, 4], 1)


def test_typical_accept_threshold_follows_entropy():
    tree = Tree.from_parents([-1, 0])
    flat = np.full(20, 0.05)  # entropy log 20: bar = .3 / 20 = .015, so .05 passes
    assert typical_accept(tree, np.array([0, 7]), np.stack([flat, flat]), np.random.default_rng(0))[0] == [0, 1]
    # a stricter alpha raises the bar above .05: nothing accepted, the bonus comes from the root
    acc, bonus = typical_accept(
        tree, np.array([0, 7]), np.stack([flat, flat]), np.random.default_rng(0), posterior_alpha=2.0
    )
    assert acc == [0] and 0 <= bonus < 20
