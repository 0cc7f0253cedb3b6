"""Accepting a verified draft tree: greedy, lossless speculative sampling, Medusa typical.

Inputs shared by every rule: a :class:`~graphs.trees.Tree` of ``T`` nodes, ``tokens`` (T,) (the
token of each node; node 0 is the root, always accepted) and the base model's output at each node,
row ``i`` being the distribution of the token *after* node ``i``. Each rule walks from the root
through ``tree.children`` and returns ``(accepted, bonus)``: the accepted node indices starting with
0, and one more token from the base model at the last accepted node. The step emits
``tokens[accepted[1:]]`` followed by ``bonus``, i.e. ``len(accepted)`` tokens.
"""

from __future__ import annotations

import numpy as np

from graphs.errors import InputError, NonFiniteLogitsError
from graphs.trees import Tree

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a subnormal
# temperature overflows to inf, and a distribution that sharp is the argmax anyway.
MIN_TEMPERATURE = 1e-5


def check_finite(value) -> None:
    """Raise NonFiniteLogitsError if ``value`` (the largest logit of a row, or several) is nan or +inf.

    Checking the maximum is enough: a nan anywhere makes ``max`` nan (and ``argmax`` picks it), an
    overflowed logit is +inf. ``-inf`` elsewhere is a legitimately masked token.
    """
    if isinstance(value, (float, np.floating)):  # one logit: the common case, no array round trip
        bad = value != value or value == float("inf")
    else:
        v = np.asarray(value)
        bad = bool(np.isnan(v).any() or np.isposinf(v).any())
    if bad:
        raise NonFiniteLogitsError(
            "the base graph returned non-finite logits (nan or inf): float16 overflow or damaged weights; "
            "re-export with --dtype float32 (or check the model in PyTorch)"
        )


def greedy_accept(tree: Tree, tokens: np.ndarray, logits: np.ndarray) -> tuple[list[int], int]:
    """Follow the base model's argmax through the tree; equals plain greedy decoding.

    At node ``n`` the base picks ``t = argmax(logits[n])``; if a child of ``n`` carries ``t`` the
    walk moves there, otherwise it stops and ``t`` is the bonus token::

        tree = Tree.from_parents([-1, 0, 0, 1]); tokens = [9, 4, 5, 6]
        argmax(logits) per node = [5, 0, 6, 1]
        greedy_accept(...) -> ([0, 2], 6)      # 5 matches node 2; node 2 has no child: bonus 6
    """
    if tree.size == 1:  # a plain step (the autoregressive one): nothing to walk
        t = int(np.argmax(logits[0]))
        check_finite(logits[0][t])
        return [0], t
    best = np.argmax(logits, axis=-1).tolist()  # (T,) the base's token after each node: one call
    accepted, t = greedy_walk(tree, tokens, best)
    # every choice the walk made, checked at once (a nan or +inf among them: no real choice)
    check_finite(logits[accepted, [best[i] for i in accepted]])
    return accepted, t


def greedy_walk(tree: Tree, tokens, best: list) -> tuple[list[int], int]:
    """The walk of :func:`greedy_accept` over ``best`` (T,), the base's argmax after each node (the
    device path's selection graph computes it beside the logits; the caller checks the walked nodes'
    logits were finite)."""
    toks = np.asarray(tokens).tolist()
    kids = tree.child_lists
    accepted = [0]
    n = 0
    while True:
        t = best[n]
        for c in kids[n]:  # priority order: the first child carrying t
            if toks[c] == t:
                n = c
                accepted.append(n)
                break
        else:
            return accepted, int(t)


def process_logits(logits: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The base model's sampling distribution, float64 (..., V); the same order as HF's warpers.

    1. temperature: ``logits / temperature`` (``temperature < MIN_TEMPERATURE``: one-hot at the argmax).
    2. top_k (> 0): keep the tokens whose logit is >= the k-th largest (ties at the k-th kept).
    3. top_p (< 1): keep the smallest set of most probable tokens whose mass reaches ``top_p``,
       i.e. a token stays if the mass of the tokens ranked above it is < ``top_p``.

    Example, ``logits = log([.5, .3, .15, .05])``: ``top_k=2`` -> ``[.625, .375, 0, 0]``;
    ``top_p=.75`` -> ``[.625, .375, 0, 0]`` (mass above: 0, .5, .8, .95; keep while < .75).

    Never nan for logits without nan/+inf (checked): the largest logit is subtracted before the
    division, so every value is in [-inf, 0] and the largest is 0 whatever the temperature.
    """
    if not temperature >= 0:  # (nan too)
        raise InputError(f"process_logits: temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"process_logits: top_p must be in (0, 1], got {top_p}")
    x = np.asarray(logits, dtype=np.float64)  # (..., V)
    top = x.max(axis=-1, keepdims=True)  # (..., 1)
    check_finite(top)
    if np.isneginf(top).any():
        raise NonFiniteLogitsError("the base graph returned -inf for every token of a row: no token can be "
                                   "chosen; check the model in PyTorch or re-export with --dtype float32")
    if temperature < MIN_TEMPERATURE:
        return (np.arange(x.shape[-1]) == np.argmax(x, axis=-1)[..., None]).astype(np.float64)
    with np.errstate(over="ignore"):  # a finite logit far below the top may reach -inf: probability 0
        x = (x - top) / temperature  # (..., V) in [-inf, 0], the top exactly 0
    if 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[..., -top_k, None]  # (..., 1) k-th largest logit
        x = np.where(x >= kth, x, -np.inf)
    probs = _softmax(x)  # (..., V)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # (..., V) most probable first
        sorted_p = np.take_along_axis(probs, order, axis=-1)  # (..., V)
        mass_above = np.cumsum(sorted_p, axis=-1) - sorted_p  # (..., V) exclusive cumsum
        keep_sorted = mass_above < top_p  # (..., V); always keeps the first
        keep = np.empty_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_accept(
    tree: Tree, tokens: np.ndarray, probs: np.ndarray, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Lossless speculative sampling over a tree of deterministic draft tokens.

    At node ``n`` with base distribution ``p = probs[n]``, start with the residual ``r = p`` and try
    the children in priority order: accept child ``c`` (token ``x``) with probability
    ``r[x] / sum(r)``; on rejection set ``r[x] = 0`` and try the next child. If one is accepted,
    move to it and repeat; if none is, the bonus token is drawn from ``r / sum(r)``. A leaf's bonus
    is drawn from ``p``. A second child with an already rejected token has ``r[x] = 0``: never
    accepted, as it must be.

    Why it is exact: drawing ``y ~ p`` is the same as asking "is y = x1?" (yes w.p. ``p[x1]``),
    then, if not, drawing from ``p`` conditioned on ``y != x1``, which is ``r / sum(r)`` with
    ``r[x1] = 0`` — exactly the loop above; so each emitted token is distributed as ``p`` at its node.

    Example: ``p = [.5, .3, .2]``, children tokens ``[1, 1, 2]``: accept the first w.p. .3; else the
    second w.p. 0; else the third w.p. .2 / .7; else the bonus is 0 (all that is left).
    """
    tokens = np.asarray(tokens)
    return sample_walk(tree, tokens, rng, lambda n: float(probs[n].sum()),
                       lambda n, c: float(probs[n][tokens[c]]), lambda n, rejected: _draw(probs[n], rejected, rng))


def sample_walk(tree: Tree, tokens: np.ndarray, rng: np.random.Generator, mass, prob, draw) -> tuple[list[int], int]:
    """The walk of :func:`sample_accept` over what it reads of each node's distribution ``p_n``:
    ``mass(n)`` sum(p_n), ``prob(n, c)`` p_n of child c's token, ``draw(n, rejected)`` a token from p_n
    with the ``rejected`` tokens zeroed (the device path reads them from its selection graph)."""
    accepted = [0]
    n = 0
    while True:
        left = mass(n)  # sum(r)
        rejected: list[int] = []  # tokens x with r[x] = 0
        nxt = -1
        for c, x in zip(tree.children[n].tolist(), tokens[tree.children[n]].tolist()):
            if x in rejected:
                continue
            px = prob(n, c)
            if rng.random() * left < px:
                nxt = c
                break
            rejected.append(x)
            left -= px
            if left <= 0.0:  # only from rounding: nothing left to accept
                break
        if nxt < 0:
            return accepted, draw(n, rejected)
        accepted.append(nxt)
        n = nxt


def typical_accept(
    tree: Tree,
    tokens: np.ndarray,
    probs: np.ndarray,
    rng: np.random.Generator,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance. NOT lossless: it trades the base distribution for length.

    At node ``n`` with ``p = probs[n]`` and entropy ``H(p)`` (nats), a child with token ``x`` passes
    if ``p[x] > min(posterior_threshold, posterior_alpha * exp(-H(p)))``; the walk takes the first
    passing child in priority order and stops when none passes. The bonus is drawn from ``p`` at the
    last accepted node. (Medusa keeps the longest passing root-to-leaf path instead of walking; the
    two agree whenever at most one child passes at each node.)

    Example: ``p = [.7, .2, .1]`` has H = 0.80, so the bar is min(.09, .3 * .45) = .09: tokens 0, 1
    and 2 all pass; with ``p = [.95, .04, .01]`` (H = .22, bar .09) only token 0 does.
    """
    tokens = np.asarray(tokens)
    accepted = [0]
    n = 0
    while True:
        p = probs[n]  # (V,)
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        bar = min(posterior_threshold, posterior_alpha * float(np.exp(-entropy)))
        kids = tree.children[n]
        ok = np.flatnonzero(p[tokens[kids]] > bar)  # positions into kids, priority order
        if ok.size == 0:
            return accepted, _draw(p, [], rng)
        n = int(kids[ok[0]])
        accepted.append(n)


def draw_excluding(p: np.ndarray, rejected: list[int], rng: np.random.Generator) -> int:
    """One token from ``p`` with the ``rejected`` tokens zeroed (the bonus draw of :func:`sample_accept`)."""
    return _draw(p, rejected, rng)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _draw(p: np.ndarray, rejected: list[int], rng: np.random.Generator) -> int:
    """One token from ``p`` with the ``rejected`` tokens zeroed (unnormalized is fine)."""
    r = p
    if rejected:
        r = p.copy()
        r[rejected] = 0.0
    cdf = np.cumsum(r, dtype=np.float64)  # (V,)
    if cdf[-1] <= 0.0:  # everything rejected: only reachable through rounding
        return int(np.argmax(p))
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return i if i < cdf.size else int(np.flatnonzero(r)[-1])
