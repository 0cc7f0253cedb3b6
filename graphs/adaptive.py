"""Adaptive speculation: never slower than plain decoding.

Per sequence, the policy keeps what speculation has been buying: ``gain[b, n]``, the tokens a step
would have emitted had its tree been cut to its ``n`` best nodes by draft score. One full-tree step
tells this for every ``n`` at once: the best-``n`` set is ancestor-closed (scores only fall along a
path), and a greedy walk through a sub-tree accepts exactly the prefix of the full tree's accepted
path that lies inside it::

    tree scores (node: score)  0: root, 1: -.1, 2: -.9, 3: -.3 (child of 1)     ranks 1, 3, 2
    accepted path [0, 1, 3]  ->  gain(1) = 1, gain(2) = 2, gain(3) = 3, gain(4) = 3

and what steps cost: ``verify[n]`` seconds for a base forward over ``n`` positions (measured at the
widths used, linear in between), ``draft`` seconds per step's drafting, and the host's seconds per
step around the graph calls (``host_plain``, ``host_spec``: the wall time from one plan to the next
less the graph calls; a drafted step's tree handling and acceptance walk are not free on a CPU).
Before each step every sequence picks the size with the best predicted rate::

    n = 1            1 / (verify[1] + host_plain)                       (a plain step: no drafter call)
    n >= 2           gain[b, n] / (verify[n] + draft + host_spec)

What one run measured seeds the next one of the same decoder, tree and sampling settings
(:meth:`AdaptivePolicy.carry`): the costs, the waits between probes, and the batch's mean gain as
every sequence's starting gain. Without it each short run would pay the policy's lessons again
(a full tree first, a plain step to price it, probes after 4, 8, 16, ... plain steps).

If every sequence picks 1 the step skips the drafter; the drafter's context rows wait for the next
drafted step. While speculation is off, a full tree is tried again every ``probe_every`` plain steps
(doubling, up to ``max_probe_every``, while it keeps losing; halved when a probe wins, reset while
drafted steps keep paying), so a sequence whose text becomes predictable again gets its trees back.
Between probes an all-plain decision is reused for ``recheck_every`` steps (only the costs drift
then), so a plain step costs the host about what an autoregressive one does. Likewise, when every
sequence's full tree beats a plain step by ``fast_margin`` or more, that decision is reused for
``recheck_every`` drafted steps, which update only the costs; then a step is decided and observed
in full again: where speculation clearly pays, the policy costs the host little more than a fixed tree
(measured on the 0.9M demo, where a step is 0.5 ms: 0.18 ms of policy per step before this). Trees
only change *which* candidates are
verified, never the acceptance rule: greedy output stays the base's greedy output, and lossless
sampling stays lossless (the tree is chosen before the step's random draws).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from graphs.trees import _HEAD_DECAY, _RANK_DECAY, _TOP1, Tree

_ROOT_ONLY = Tree.from_parents([-1])


@dataclass(frozen=True)
class AdaptiveConfig:
    ema: float = 0.15
    """Weight of the newest observation in the running averages (gain and costs). Slow enough that
    a few hard tokens in predictable text do not switch speculation off (measured at temperature 0
    on the 19M model: 0.3 went plain in a quarter of the steps and lost 4% to never switching)."""
    margin: float = 1.05
    """Speculate only if its predicted tokens/s is at least ``margin`` times a plain step's (a little
    above 1: where speculation would barely pay, noisy estimates would flip between the two)."""
    probe_every: int = 4
    """Plain steps before a full tree is tried again (the first wait)."""
    max_probe_every: int = 64
    """The longest wait between probes while speculation keeps losing."""
    recheck_every: int = 8
    """While plain, decide again after this many plain steps (costs drift; gains only change on probes);
    while the full tree clearly pays (``fast_margin``), after this many drafted steps."""
    fast_margin: float = 1.25
    """A full tree predicted at least this many times a plain step's tokens/s, for every sequence, is
    kept for ``recheck_every`` drafted steps without deciding or observing gains in between."""

    def __post_init__(self):
        if (not 0 < self.ema <= 1 or self.margin <= 0 or not 1 <= self.probe_every <= self.max_probe_every
                or self.recheck_every < 1):
            raise ValueError(f"AdaptiveConfig: bad values {self}")


def static_scores(tree: Tree) -> np.ndarray:
    """(T,) a static Medusa tree's node scores: the log of the assumed probability that the node's
    whole path is accepted (graphs.trees' default-tree model, head h at rank r: 0.6 * 0.8**h * 0.3**r).

    Every factor is < 1, so scores fall strictly along a path: the best-n nodes are ancestor-closed
    for any tree, and they are the ones a Medusa tree of n nodes would have been built from. Node
    order would not do: it lists every depth-1 node (all ranks) before the first depth-2 one::

        medusa_tree([[0], [1], [2], [0, 0]])  ranks by node order [0], [1], [2], [0, 0]
                                              ranks by score      [0], [0, 0], [1], [2]
    """
    if tree.head is None or tree.rank is None:
        raise ValueError("static_scores: tree has no head/rank (not a Medusa tree)")
    score = np.zeros(tree.size)
    for n in range(1, tree.size):  # parents come first (topological order)
        h, r = int(tree.head[n]), int(tree.rank[n])
        score[n] = score[tree.parents[n]] + np.log(_TOP1 * _HEAD_DECAY**h * _RANK_DECAY**r)
    return score


def plain_inputs(root: np.ndarray):
    """(trees, candidates (B, 1), layout) of a plain step: every sequence verifies its root only."""
    bsz = root.shape[0]
    layout = (np.zeros((bsz, 1), dtype=np.int64), np.ones((bsz, 1, 1), dtype=bool))
    return [_ROOT_ONLY] * bsz, root[:, None].astype(np.int64), layout


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
        self.long_gain = np.full(self.t, np.nan)  # (T,) slow mean over every observation (carried)
        self.long_n = 0  # observations in it
        self.verify = np.full(self.t + 1, np.nan)  # seconds per base forward over n positions, [n]
        self.draft = np.nan  # seconds of drafting per drafted step
        self.host_plain = np.nan  # host seconds per plain step, around the graph calls
        self.host_spec = np.nan  # host seconds per drafted step, around the graph calls
        self.plain_run = 0  # plain steps since the last drafted one
        self.wait = self.cfg.probe_every
        self.history: list[int] = []  # the verify width of every step (for stats and tests)
        self._tick = None  # perf_counter at the last plan
        self._plain_until = 0  # plan() answers "all plain" without deciding while plain_run is below
        self._ones = np.ones(batch, dtype=np.int64)
        self._fast_left = 0  # drafted steps left in which plan() reuses the full tree without deciding
        self._fast = False  # the current step is one of those (observe() then records costs only)
        self._fast_live = None
        self._cuts: dict = {}  # static trees: {"tree": the tree, n: (kept nodes, cut tree)}
        self._graph_s = 0.0  # graph seconds (verify + draft) of the step since then
        self._last_plain = True

    def carry(self, prior: AdaptivePolicy | None) -> AdaptivePolicy:
        """Start from what ``prior`` (a run of the same decoder, tree and sampling) measured. Returns self.

        Costs carry as they are. Gains do not carry their last state (where the last text happened
        to be hard): every sequence starts from the setting's long-run mean gain. If that says
        speculation pays, the run speculates from its first step; if not (a high temperature, a
        drafter that does not fit the text), it starts plain and keeps the prior's probe wait, so
        short runs do not pay the probes of a cold start (after 4, 8, 16, ... plain steps) again."""
        if prior is None or prior.t != self.t:
            return self
        self.verify = prior.verify.copy()
        self.draft, self.host_plain, self.host_spec = prior.draft, prior.host_plain, prior.host_spec
        self.long_gain, self.long_n = prior.long_gain.copy(), prior.long_n
        self.gain[:] = self.long_gain[None]
        if not np.isnan(self.verify[1]) and not self.plan_is_speculative(0):
            self.wait = int(np.clip(prior.wait, self.cfg.probe_every, self.cfg.max_probe_every))
            self.plain_run = prior.plain_run
        return self

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
        host_plain = 0.0 if np.isnan(self.host_plain) else self.host_plain
        host_spec = 0.0 if np.isnan(self.host_spec) else self.host_spec
        out[0] = 1.0 / (self.verify_cost(1) + host_plain) if not np.isnan(self.verify[1]) else np.nan
        widths = np.arange(2, self.t + 1)
        known = np.flatnonzero(~np.isnan(self.verify))
        verify = (np.interp(widths, known, self.verify[known]) if known.size > 1
                  else np.full(widths.size, self.verify_cost(2)))
        out[1:] = self.gain[b, 1:] / (verify + self.draft + host_spec)
        return out

    # ---------------------------------------------------------------- decisions

    def plan(self, live: np.ndarray) -> np.ndarray:
        """(B,) tree size per sequence for the next step (1 = no draft for it; all 1 = skip the drafter)."""
        self._clock()
        bsz = self.gain.shape[0]
        if np.isnan(self.draft):  # nothing measured yet: speculate
            return np.full(bsz, self.t)
        if np.isnan(self.verify[1]):  # one plain step to learn what not speculating costs
            return np.ones(bsz, dtype=np.int64)
        if self.plain_run < self._plain_until:  # decided "plain" lately; only costs drifted since
            return self._ones
        self._fast = self._fast_left > 0 and np.array_equal(live, self._fast_live)
        if self._fast:  # the full tree clearly paid lately: keep it without deciding
            self._fast_left -= 1
            return np.full(bsz, self.t)
        self._fast_left = 0
        sizes = np.ones(bsz, dtype=np.int64)
        clear = bool(live.any())
        for b in range(bsz):
            if not live[b]:
                continue
            r = self.rates(b)
            r[1:][np.isnan(r[1:])] = -np.inf
            best = int(np.argmax(r[1:])) + 2
            if r[best - 1] >= self.cfg.margin * r[0]:
                sizes[b] = best
            clear = clear and sizes[b] == self.t and r[best - 1] >= self.cfg.fast_margin * r[0]
        if clear and self.cfg.recheck_every > 1:
            self._fast_left, self._fast_live = self.cfg.recheck_every - 1, live.copy()
        if sizes.max() == 1:
            if self.plain_run >= self.wait:  # probe: a full tree for all, to measure again
                return np.full(bsz, self.t)
            # the gains change only on drafted steps: decide again at the probe, or after a few
            # plain steps of cost drift (this keeps a plain step's host work near autoregressive's)
            self._plain_until = min(self.wait, self.plain_run + self.cfg.recheck_every)
        return sizes

    def observe(self, trees: list[Tree] | None, accepted: list[list[int]] | None, width: int, t_verify: float,
                t_draft: float | None, live: np.ndarray) -> None:
        """Record a step: the trees verified (None for a plain step), accepted nodes, costs."""
        self.history.append(width)
        self.verify[width] = self._ema(self.verify[width], t_verify)
        self._graph_s = t_verify + (t_draft or 0.0)
        self._last_plain = t_draft is None
        if t_draft is None:
            self.plain_run += 1
            return
        self.draft = self._ema(self.draft, t_draft)
        if self._fast and all(len(a) > 1 for a, alive in zip(accepted, live) if alive):
            return  # a reused full-tree decision that still accepted something: costs only
        if self._fast:  # a draft wholly rejected ends the window: every step is observed again
            self._fast_left = 0
        probed = self.plain_run >= self.wait
        self.plain_run = self._plain_until = 0
        for b, tree in enumerate(trees):
            if not live[b] or tree.size < 2:
                continue
            g = counterfactual_gain(tree, accepted[b])
            n = tree.size
            row = self.gain[b, :n]
            self.gain[b, :n] = np.where(np.isnan(row), g, (1 - self.cfg.ema) * row + self.cfg.ema * g)
            # the long-run mean: a plain mean of the first 50 observations, then a slow average
            self.long_n += 1
            w, old = max(1.0 / self.long_n, 0.02), self.long_gain[:n]
            self.long_gain[:n] = np.where(np.isnan(old), g, (1 - w) * old + w * g)
        if probed:  # did the probe win? then probe more often again; else wait longer next time
            wins = any(self.plan_is_speculative(b) for b in range(len(trees)) if live[b])
            # a win halves the wait (one lucky probe at a high temperature must not bring back probes
            # every few steps); speculation that goes on paying resets it (below)
            self.wait = max(self.wait // 2, self.cfg.probe_every) if wins else min(2 * self.wait,
                                                                                    self.cfg.max_probe_every)
        elif self.history[-2:-1] and self.history[-2] > 1 and self.plan_is_speculative_any(live):
            self.wait = self.cfg.probe_every  # two drafted steps in a row, still paying

    def _clock(self) -> None:
        """At each plan: the wall time since the previous plan, less its step's graph calls, is that
        step's host time (its tree handling, acceptance, and what the caller did with the tokens)."""
        now = time.perf_counter()
        if self._tick is not None and self.history:
            host = max(0.0, now - self._tick - self._graph_s)
            if self._last_plain:
                self.host_plain = self._ema(self.host_plain, host)
            else:
                self.host_spec = self._ema(self.host_spec, host)
        self._tick = now

    def plan_is_speculative_any(self, live: np.ndarray) -> bool:
        return any(self.plan_is_speculative(b) for b in range(self.gain.shape[0]) if live[b])

    def plan_is_speculative(self, b: int) -> bool:
        r = self.rates(b)
        return bool(np.nanmax(r[1:], initial=-np.inf) >= self.cfg.margin * r[0])

    def shrink(self, trees: list[Tree], cand: np.ndarray, sizes: np.ndarray, static: bool = False):
        """Cut each sequence's tree to its planned size; returns (trees, cand (B, T'), layout).

        ``static``: the trees are one static tree (Medusa), whose cuts are computed once per size."""
        if static:
            cuts = [self._static_cut(trees[0], int(n)) for n in sizes]
            keeps, new_trees = [k for k, _ in cuts], [t for _, t in cuts]
        else:
            keeps = [cut_tree(tr, int(n)) for tr, n in zip(trees, sizes)]
            new_trees = [sub_tree(tr, k) for tr, k in zip(trees, keeps)]
        width = max(k.size for k in keeps)
        bsz = len(trees)
        out = np.zeros((bsz, width), dtype=cand.dtype)
        depth = np.zeros((bsz, width), dtype=np.int64)
        mask = np.broadcast_to(np.eye(width, dtype=bool), (bsz, width, width)).copy()
        for b, (tr, k) in enumerate(zip(new_trees, keeps)):
            out[b, : k.size] = cand[b, k]
            depth[b, : k.size] = tr.depth
            mask[b, : k.size, : k.size] = tr.mask
        return new_trees, out, (depth, mask)

    def _static_cut(self, tree: Tree, n: int) -> tuple[np.ndarray, Tree]:
        if self._cuts.get("tree") is not tree:
            self._cuts = {"tree": tree}
        if n not in self._cuts:
            keep = cut_tree(tree, n)
            self._cuts[n] = (keep, sub_tree(tree, keep))
        return self._cuts[n]
