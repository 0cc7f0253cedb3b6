"""Adaptive speculation: never slower than plain decoding.

Per sequence, the policy keeps what speculation has been buying: ``gain[b, n]``, the tokens a step
would have emitted had its tree been cut to its ``n`` best nodes by draft score. One full-tree step
tells this for every ``n`` at once: the best-``n`` set is ancestor-closed (scores only fall along a
path), and a greedy walk through a sub-tree accepts exactly the prefix of the full tree's accepted
path that lies inside it::

    tree scores (node: score)  0: root, 1: -.1, 2: -.9, 3: -.3 (child of 1)     ranks 1, 3, 2
    accepted path [0, 1, 3]  ->  gain(1) = 1, gain(2) = 2, gain(3) = 3, gain(4) = 3

and what steps cost: ``verify[n]`` seconds for a base forward over ``n`` positions (measured at the
widths used, linear in between) and ``draft`` seconds per drafter call. Before each step every
sequence picks the size with the best predicted rate::

    n = 1            1 / verify[1]                       (a plain step: no drafter call)
    n >= 2           gain[b, n] / (verify[n] + draft)

If every sequence picks 1 the step skips the drafter; the drafter's context rows wait for the next
drafted step. While speculation is off, a full tree is tried again every ``probe_every`` plain steps
(doubling, up to ``max_probe_every``, while it keeps losing; reset when it wins), so a sequence
whose text becomes predictable again gets its trees back. Trees only change *which* candidates are
verified, never the acceptance rule: greedy output stays the base's greedy output, and lossless
sampling stays lossless (the tree is chosen before the step's random draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphs.trees import Tree


@dataclass(frozen=True)
class AdaptiveConfig:
    ema: float = 0.3
    """Weight of the newest observation in the running averages (gain and costs)."""
    margin: float = 1.0
    """Speculate only if its predicted tokens/s is at least ``margin`` times a plain step's."""
    probe_every: int = 4
    """Plain steps before a full tree is tried again (the first wait)."""
    max_probe_every: int = 64
    """The longest wait between probes while speculation keeps losing."""

    def __post_init__(self):
        if not 0 < self.ema <= 1 or self.margin <= 0 or not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"AdaptiveConfig: bad values {self}")


def counterfactual_gain(tree: Tree, accepted: list[int]) -> np.ndarray:
    """(T,) tokens the step would have emitted with the tree cut to its best n = 1..T nodes.

    ``accepted``: the node indices the walk accepted (root first). Node ranks come from
    ``tree.score`` (best first, ties to the lower index); without scores (static trees), node order.
    """
    t = tree.size
    score = tree.score if tree.score is not None else -np.arange(t, dtype=np.float64)
    rank = np.empty(t, dtype=np.int64)
    rank[np.argsort(-score[1:], kind="stable") + 1] = np.arange(1, t)
    rank[0] = 0
    gain = np.ones(t)
    r = np.sort(rank[np.asarray(accepted[1:], dtype=np.int64)])  # ranks along the accepted path
    # accepted path node with rank r counts for every n > r, if all path nodes above it do too
    ok = r < np.arange(1, t + 1)[:, None]  # (n, path): node kept in the best-n tree
    gain += np.cumprod(ok, axis=1).sum(axis=1)
    return gain


def cut_tree(tree: Tree, n: int) -> np.ndarray:
    """Indices (n,) of ``tree``'s root and its ``n - 1`` best nodes by score, in node order."""
    if n >= tree.size:
        return np.arange(tree.size)
    score = tree.score if tree.score is not None else -np.arange(tree.size, dtype=np.float64)
    best = np.argsort(-score[1:], kind="stable")[: n - 1] + 1
    return np.concatenate(([0], np.sort(best)))


def sub_tree(tree: Tree, keep: np.ndarray) -> Tree:
    """The tree restricted to ``keep`` (ancestor-closed, node order), re-indexed."""
    new = np.full(tree.size, -1, dtype=np.int64)
    new[keep] = np.arange(keep.size)
    parents = np.concatenate(([-1], new[tree.parents[keep[1:]]]))
    kids = [c[new[c] >= 0] for c in (tree.children[i] for i in keep)]
    return Tree(parents, tree.depth[keep], tree.mask[np.ix_(keep, keep)], [new[k] for k in kids],
                score=None if tree.score is None else tree.score[keep])


class AdaptivePolicy:
    """Picks each sequence's tree size per step from measured gains and costs (see the module doc)."""

    def __init__(self, batch: int, tree_size: int, cfg: AdaptiveConfig | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self.t = int(tree_size)
        self.gain = np.full((batch, self.t), np.nan)  # (B, T) EMA; NaN = never observed
        self.verify = np.full(self.t + 1, np.nan)  # seconds per base forward over n positions, [n]
        self.draft = np.nan  # seconds per drafter call
        self.plain_run = 0  # plain steps since the last drafted one
        self.wait = self.cfg.probe_every
        self.history: list[int] = []  # the verify width of every step (for stats and tests)

    # ---------------------------------------------------------------- estimates

    def _ema(self, old, new):
        return new if np.isnan(old) else (1 - self.cfg.ema) * old + self.cfg.ema * new

    def verify_cost(self, n: int) -> float:
        """Estimated seconds for a verify of n positions: measured, else linear between measured widths."""
        known = np.flatnonzero(~np.isnan(self.verify))
        if known.size == 0:
            return np.nan
        if known.size == 1:
            return float(self.verify[known[0]])
        return float(np.interp(n, known, self.verify[known]))

    def rates(self, b: int) -> np.ndarray:
        """(T,) predicted tokens/s of sequence b for tree sizes 1..T (NaN where unknown)."""
        out = np.full(self.t, np.nan)
        out[0] = 1.0 / self.verify_cost(1) if not np.isnan(self.verify[1]) else np.nan
        for n in range(2, self.t + 1):
            out[n - 1] = self.gain[b, n - 1] / (self.verify_cost(n) + self.draft)
        return out

    # ---------------------------------------------------------------- decisions

    def plan(self, live: np.ndarray) -> np.ndarray:
        """(B,) tree size per sequence for the next step (1 = no draft for it; all 1 = skip the drafter)."""
        bsz = self.gain.shape[0]
        if np.isnan(self.draft):  # nothing measured yet: speculate
            return np.full(bsz, self.t)
        if np.isnan(self.verify[1]):  # one plain step to learn what not speculating costs
            return np.ones(bsz, dtype=np.int64)
        sizes = np.ones(bsz, dtype=np.int64)
        for b in range(bsz):
            if not live[b]:
                continue
            r = self.rates(b)
            r[1:][np.isnan(r[1:])] = -np.inf
            best = int(np.argmax(r[1:])) + 2
            if r[best - 1] >= self.cfg.margin * r[0]:
                sizes[b] = best
        if sizes.max() == 1 and self.plain_run >= self.wait:  # probe: a full tree for all, to measure again
            return np.full(bsz, self.t)
        return sizes

    def observe(self, trees: list[Tree] | None, accepted: list[list[int]] | None, width: int, t_verify: float,
                t_draft: float | None, live: np.ndarray) -> None:
        """Record a step: the trees verified (None for a plain step), accepted nodes, costs."""
        self.history.append(width)
        self.verify[width] = self._ema(self.verify[width], t_verify)
        if t_draft is None:
            self.plain_run += 1
            return
        self.draft = self._ema(self.draft, t_draft)
        probed = self.plain_run >= self.wait
        self.plain_run = 0
        for b, tree in enumerate(trees):
            if not live[b] or tree.size < 2:
                continue
            g = counterfactual_gain(tree, accepted[b])
            n = tree.size
            for i in range(n):
                self.gain[b, i] = self._ema(self.gain[b, i], g[i])
        if probed:  # did the probe win? then probe often again; else wait longer next time
            wins = any(self.plan_is_speculative(b) for b in range(len(trees)) if live[b])
            self.wait = self.cfg.probe_every if wins else min(2 * self.wait, self.cfg.max_probe_every)

    def plan_is_speculative(self, b: int) -> bool:
        r = self.rates(b)
        return bool(np.nanmax(r[1:], initial=-np.inf) >= self.cfg.margin * r[0])

    def shrink(self, trees: list[Tree], cand: np.ndarray, sizes: np.ndarray):
        """Cut each sequence's tree to its planned size; returns (trees, cand (B, T'), layout)."""
        keeps = [cut_tree(tr, int(n)) for tr, n in zip(trees, sizes)]
        width = max(k.size for k in keeps)
        new_trees = [sub_tree(tr, k) for tr, k in zip(trees, keeps)]
        bsz = len(trees)
        out = np.zeros((bsz, width), dtype=cand.dtype)
        depth = np.zeros((bsz, width), dtype=np.int64)
        mask = np.broadcast_to(np.eye(width, dtype=bool), (bsz, width, width)).copy()
        for b, (tr, k) in enumerate(zip(new_trees, keeps)):
            out[b, : k.size] = cand[b, k]
            depth[b, : k.size] = tr.depth
            mask[b, : k.size, : k.size] = tr.mask
        return new_trees, out, (depth, mask)
