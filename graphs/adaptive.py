"""Adaptive speculation: what each step verifies, decided for the whole batch from measured costs.

Per request, :class:`RowGains` keeps what speculation has been buying it: ``gain[n - 1]``, the tokens a
step would have emitted had its tree been cut to its ``n`` best nodes by draft score. One full-tree
step tells this for every ``n`` at once: the best-``n`` set is ancestor-closed (scores only fall along
a path), and a greedy walk through a sub-tree accepts exactly the prefix of the full tree's accepted
path that lies inside it::

    tree scores (node: score)  0: root, 1: -.1, 2: -.9, 3: -.3 (child of 1)     ranks 1, 3, 2
    accepted path [0, 1, 3]  ->  gain(1) = 1, gain(2) = 2, gain(3) = 3, gain(4) = 3

Per engine, :class:`Planner` keeps what this machine's calls cost (:class:`Costs`): a base forward by
the number of token rows it computes (batch rows x width: a verify over ``n`` rows padded to width
``W`` costs ``verify(n * W)``), drafting by the number of batch rows, and the host's own time per
step by the number of batch rows (drafted and plain steps apart: a drafted step's tree handling
and acceptance walk are per row, and on a small model they are most of a step). Before each step
it picks one width ``W`` for the batch, the one with the best predicted rate over every live
request::

    rate(W) = sum_b gain_b[min(W, T_b)] / (verify(n * W) + [W > 1] (draft(n) + host_spec(n))
                                                          + [W = 1] host_plain(n))

so trees shrink smoothly as load grows (more rows make every extra node of width cost more), down to
plain steps (``W = 1``, no drafter call), with no threshold anywhere. Requests choose how they take
part (``SPEC_OFF``: always one token; ``SPEC_ON``: always the full tree, so ``W`` is at least its size;
``SPEC_ADAPTIVE``: ``min(W, T_b)``). A wider ``W`` is taken only if its rate beats a plain step's by
``margin``. While the batch steps plain, a full tree is tried again every ``probe_every`` plain steps
(doubling, up to ``max_probe_every``, while probes keep losing; halved when one wins; reset while
drafted steps keep paying), so text that becomes predictable again gets its trees back. The wait is
longer the farther drafting is from paying (:meth:`Planner._probe_due`): each row's ceiling (the
tokens a cut tree emits with every draft accepted) bounds what a probe can find, and where even
that cannot pay for a drafted step (a weak drafter, or one too costly for its base on this machine)
the wait is ``max_probe_every`` from the first plain decision on. While the batch drafts trees cut
below their full size, the full trees are verified once every ``widen_every`` drafted steps: a cut
tree observes only the sizes up to its cut, so without them a request whose first trees accepted
little kept its small trees for good. A probe after plain steps is ``probe_steps`` drafted steps in a
row where drafting's cost is not known warm yet, and every ``rewarm_every``-th probe after that; the
other probes are one step.

Costs are what the machine measured, never guessed: a call shape's first measurement (cold: the
session allocates, pages fault in) is replaced by its second, and the policy takes plain steps until
a plain step's cost is known warm; after that plain steps are measured only where the policy takes
them (the estimate is the last plain stretch's while drafting pays). A step right after a call of
the other kind is cold and left out (:class:`Costs`): a probe's first step costs what drafted steps
in a row do not, and folded in, probes kept the 19M int4 model plain where drafting paid. A plain
decision holds until that probe (``plain_recheck_every``): the engine runs such stretches as plain
runs, as it runs autoregressive decoding. (The wait is each engine's: carried across a decoder's
engines, a few probes lost to noise kept the 19M model plain for whole benchmark runs.)

Trees only change *which* candidates are verified, never the acceptance rule: greedy output stays the
base's greedy output, and lossless sampling stays lossless (the tree is chosen before the step's
random draws).

A new request's gains start from the mean that earlier requests of the same setting (tree,
sampling) measured (:meth:`Planner.prior`); costs are the machine's and carry from one engine to the next
(:meth:`Planner.carry`).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from graphs.trees import HEAD_DECAY, RANK_DECAY, TOP1, Tree

_ROOT_ONLY = Tree.from_parents([-1])
COLD_SKIPS = 16  # Costs: cold measurements of a size left out in a row before they are folded in
OUTLIER = 2.0  # Costs: a measurement is averaged in as at most this many times the average
# A server runs for days: what the policy keeps must not grow with the requests it served.
HISTORY_WINDOW = 4096  # Planner.history: the widths of the last steps kept (a window, not a log)
PRIORS_MAX = 256  # Priors: settings whose mean gains are kept, the least recently used forgotten

# how a row takes part in a step (Planner.plan)
IDLE, SPEC_OFF, SPEC_ON, SPEC_ADAPTIVE = 0, 1, 2, 3


@dataclass(frozen=True)
class AdaptiveConfig:
    ema: float = 0.15
    """Weight of the newest observation in the running averages (gains and costs). Slow enough that
    a few hard tokens in predictable text do not switch speculation off (measured at temperature 0
    on the 19M model: 0.3 went plain in a quarter of the steps and lost 4% to never switching)."""
    margin: float = 1.05
    """Speculate only if its predicted tokens/s is at least ``margin`` times a plain step's (a little
    above 1: where speculation would barely pay, noisy estimates would flip between the two)."""
    probe_every: int = 4
    """Plain steps before a full tree is tried again (the first wait)."""
    max_probe_every: int = 64
    """The longest wait between probes while speculation keeps losing, and the wait where no width
    could pay even with every draft accepted."""
    recheck_every: int = 8
    """While the full trees clearly pay (``fast_margin``) and the rows do not change, decide again
    only every this many drafted steps."""
    plain_recheck_every: int | None = None
    """While the batch steps plain and its rows do not change, decide again only every this many
    steps; None: at the next probe (gains change only on drafted steps, costs drift slowly, and the
    probe decides again). Each decision ends the engine's run of plain steps: on the 0.9M demo with
    drafting made never to pay (``generate`` per prompt, four probes per 96-token request either way),
    8 ran at 0.79-0.81x autoregressive, None at 0.82-0.86x."""
    probe_steps: int = 3
    """A probe after plain steps verifies the full trees for this many drafted steps in a row where
    what drafting costs is not known warm yet (and every ``rewarm_every``-th probe after that): the
    first is cold (:class:`Costs`: its costs are not folded in), the ones after it measure what
    drafting costs while the policy drafts. The other probes are one step: they measure the gains
    (their costs, cold, are left out). A probe among drafted steps, ``widen_every``'s, is one step."""
    rewarm_every: int = 4
    """Once drafting's costs are known warm, every this many probes after plain steps is again
    ``probe_steps`` long (costs drift with the machine). Where drafting never pays, each longer
    probe costs ``probe_steps - 1`` more losing steps."""
    widen_every: int = 16
    """While the batch drafts trees cut below their full size, the full trees are verified once
    every this many drafted steps (a probe): a cut tree tells nothing about the sizes past it, so
    without one the gains there stayed what the first full trees saw (a first tree that accepted
    nothing kept a request at 2 nodes for good, where 8 paid)."""
    fast_margin: float = 1.25
    """Full trees predicted at least this many times a plain step's tokens/s are kept for
    ``recheck_every`` drafted steps without deciding or updating gains (a wholly rejected draft ends
    that window): where speculation clearly pays, the policy costs the host little more than a
    fixed tree (on the 0.9M demo a step is about 1 ms, and deciding and observing every step cost
    a sixth of it)."""

    def __post_init__(self):
        if (not 0 < self.ema <= 1 or self.margin <= 0 or not 1 <= self.probe_every <= self.max_probe_every
                or self.recheck_every < 1 or self.widen_every < 1 or self.probe_steps < 1
                or self.rewarm_every < 1
                or (self.plain_recheck_every is not None and self.plain_recheck_every < 1)):
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
        score[n] = score[tree.parents[n]] + np.log(TOP1 * HEAD_DECAY**h * RANK_DECAY**r)
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
    rank = _RANKS.get(tree)
    if rank is None:
        score = tree.score if tree.score is not None else -np.arange(t, dtype=np.float64)
        order = np.empty(t, dtype=np.int64)
        order[np.argsort(-score[1:], kind="stable") + 1] = np.arange(1, t)
        order[0] = 0
        rank = _RANKS[tree] = order.tolist()
    r = sorted(rank[a] for a in accepted[1:])  # ranks along the accepted path
    # scores fall along a path, so the sorted ranks are the path's order: the best-n tree keeps
    # exactly the path nodes ranked below n, a prefix of the path (plain Python: every drafted step)
    return np.array([1.0 + bisect.bisect_left(r, n) for n in range(1, t + 1)])


def _blend(old: np.ndarray, new: np.ndarray, w: float) -> list:
    """``(1 - w) * old + w * new`` where ``old`` is known, ``new`` where it is NaN (never observed).
    Plain Python over the few sizes: it runs every drafted step, where numpy's calls are slow right
    after a graph call."""
    return [y if x != x else (1 - w) * x + w * y for x, y in zip(old.tolist(), new.tolist())]


_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tree -> node ranks (static trees recur)


def cut_tree(tree: Tree, n: int) -> np.ndarray:
    """Indices (n,) of ``tree``'s root and its ``n - 1`` best nodes by score, in node order."""
    if n >= tree.size:
        return np.arange(tree.size)
    score = tree.score if tree.score is not None else -np.arange(tree.size, dtype=np.float64)
    best = np.argsort(-score[1:], kind="stable")[: n - 1] + 1
    return np.concatenate(([0], np.sort(best)))


def tree_ceiling(tree: Tree) -> np.ndarray:
    """(T,) the most tokens a step verifying ``tree`` cut to its best n = 1..T nodes can emit: the
    deepest kept node's path, every draft on it accepted, plus the bonus token (a static tree's
    cuts are fixed: computed once per tree)."""
    got = _CEILINGS.get(tree)
    if got is None:
        # the nodes by score as cut_tree ranks them (a static Medusa tree: its static scores, as the
        # proposer's trees carry them), the deepest of the first n - 1 a running maximum
        score = (tree.score if tree.score is not None
                 else static_scores(tree) if tree.head is not None and tree.rank is not None
                 else -np.arange(tree.size, dtype=np.float64))
        best = np.argsort(-score[1:], kind="stable") + 1
        got = _CEILINGS[tree] = 1.0 + np.concatenate(([0], np.maximum.accumulate(tree.depth[best])))
    return got


def chain_ceiling(size: int, depth: int) -> np.ndarray:
    """(size,) :func:`tree_ceiling` of a tree built anew each step with at most ``depth`` levels
    (EAGLE's): n nodes hold a path of at most min(n - 1, depth) drafts."""
    return np.minimum(np.arange(1, size + 1), depth + 1).astype(np.float64)


_CEILINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sub_tree(tree: Tree, keep: np.ndarray) -> Tree:
    """The tree restricted to ``keep`` (ancestor-closed, node order), re-indexed."""
    new = np.full(tree.size, -1, dtype=np.int64)
    new[keep] = np.arange(keep.size)
    parents = np.concatenate(([-1], new[tree.parents[keep[1:]]]))
    kids = [c[new[c] >= 0] for c in (tree.children[i] for i in keep)]
    return Tree(parents, tree.depth[keep], tree.mask[np.ix_(keep, keep)], [new[k] for k in kids],
                score=None if tree.score is None else tree.score[keep])


def root_only() -> Tree:
    """The one-node tree of a plain step."""
    return _ROOT_ONLY


class RowGains:
    """One request's gains by tree size (see the module doc); ``gain[0]`` is 1 (a plain step)."""

    def __init__(self, tree_size: int, prior: np.ndarray | None = None, ema: float = 0.15,
                 ceiling: np.ndarray | None = None):
        self.t, self.ema = int(tree_size), ema
        # (T,) the most tokens a step of each size can emit, every draft accepted (tree_ceiling);
        # None: unknown (the policy then probes on its doubling wait alone)
        self.ceiling = None if ceiling is None else [float(x) for x in ceiling[: self.t]]
        self.gain = np.full(self.t, np.nan)  # (T,) EMA; NaN = never observed
        self.gain[0] = 1.0
        if prior is not None and prior.shape[0] <= self.t:
            self.gain[: prior.shape[0]] = prior

    def observe(self, tree: Tree, accepted: list[int]) -> np.ndarray:
        """Record a drafted step's verified ``tree`` (cut or full) and its accepted nodes; returns the
        counterfactual gains (tree.size,) it measured."""
        g = counterfactual_gain(tree, accepted)
        n = min(tree.size, self.t)
        self.gain[:n] = _blend(self.gain[:n], g[:n], self.ema)
        return g[:n]

    def predicted(self) -> np.ndarray:
        """(T,) gains for every size. Sizes past the known prefix grow by its last increment (a tree
        cut to n nodes tells nothing about n + 1, and guessing "all accepted" there made every cut
        look like a bargain); with nothing known past a plain step, every size is assumed fully
        accepted (optimistic, so it gets measured)."""
        g = self.gain.tolist()  # (plain Python: called for every row at every decision)
        k = next((i for i, x in enumerate(g) if x != x), None)  # the first unknown: sizes 1..k are known
        if k is not None:
            if k >= 2:
                step = max(g[k - 1] - g[k - 2], 0.0)
                g[k:] = [g[k - 1] + step * i for i in range(1, self.t - k + 1)]
            else:
                g = [i + 1.0 if x != x else x for i, x in enumerate(g)]
        for i in range(1, self.t):  # a larger tree never emits fewer tokens
            g[i] = max(g[i], g[i - 1])
        return np.array(g)


class Costs:
    """Seconds per call on this machine: base forwards by token rows, drafting by batch rows, host.

    A measurement marked ``cold`` (the engine marks a decode step that follows a call of the other
    kind: a drafted step after a plain one or a prefill, a plain one after a drafted one or a
    prefill) is kept only where its table is empty: such a step runs after a stretch of other calls,
    and costs what it would not in a row of its kind (nor does it fill a missing size of a table
    that has others: interpolated between warm sizes, a size is closer than cold, and the estimate's
    running maximum would carry a cold small size onto every larger one). Where a size has had
    ``COLD_SKIPS`` cold measurements in a row and no warm one (an engine whose every decode step
    follows a prefill chunk, under a stream of arrivals), its cold ones are folded in until a warm
    one comes: cold is then what its calls cost. Warm ones are averaged in as at most ``OUTLIER``
    times the value they average with.
    Measured on the 19M int4 model (Medusa, a 3-node chain): a probe among plain steps cost 0.95 ms
    of verify, 0.16 of drafter and 0.35 of host, drafted steps in a row 0.65-0.70, 0.05-0.06 and
    0.08; folded in, the probes' costs kept the policy plain (tau 1.03, 0.97x autoregressive) where
    drafting every step ran at 1.2-1.35x."""

    def __init__(self, ema: float = 0.15):
        self.ema = ema
        self._sorted: dict[int, tuple] = {}  # id(table) -> (xs, monotone ys), rebuilt after a change
        # (table name, key) measured once: the first call of a shape is cold (the session allocates,
        # pages fault in), so the second measurement replaces it. Measured on the 0.9M demo (int4):
        # the first 8-token verify 1.32 ms, the next ones 0.89-0.90; the first drafter call 0.31 ms,
        # the next 0.17. Averaged in (ema 0.15) it took a dozen calls to fade, and the policy's
        # probe wait (which grows the farther drafting is from paying) read it as drafting's cost.
        self._once: set[tuple[str, int]] = set()
        self._skipped: dict[tuple[str, int], int] = {}  # (table, key) -> cold ones left out since its last warm one
        self.verify: dict[int, float] = {}  # token rows (batch x width) -> seconds
        self.draft: dict[int, float] = {}  # batch rows -> seconds of drafting per drafted step
        self.host_plain: dict[int, float] = {}  # batch rows -> host seconds per plain step (outside graph calls)
        self.host_spec: dict[int, float] = {}  # batch rows -> host seconds per drafted step

    def _avg(self, name: str, key: int, value: float, cold: bool = False) -> None:
        table = getattr(self, name)
        old = table.get(key)
        if cold and table and self._skipped.get((name, key), 0) < COLD_SKIPS:
            self._skipped[(name, key)] = self._skipped.get((name, key), 0) + 1
            return  # a call right after a switch (class doc): what it costs is not what it costs in a row
        if not cold:
            self._skipped.pop((name, key), None)
        # at most OUTLIER times the value it averages with: a call the machine stalled (a vCPU
        # descheduled, another process's threads spinning) took 5-10x on the noisy 2-core VMs here,
        # and with cold steps left out such a value stayed in the average until drafting ran again
        if old is not None and old > 0:
            value = min(value, OUTLIER * old)
        if old is None:
            table[key] = value
            self._once.add((name, key))
        elif (name, key) in self._once:  # the second measurement: the first may have been cold
            table[key] = min(old, value)  # (or this one stalled: one sample says little either way)
            self._once.discard((name, key))
        else:
            table[key] = (1 - self.ema) * old + self.ema * value
        self._sorted.pop(id(table), None)

    def add_verify(self, tokens: int, seconds: float, cold: bool = False) -> None:
        self._avg("verify", int(tokens), float(seconds), cold)

    def add_draft(self, rows: int, seconds: float, cold: bool = False) -> None:
        self._avg("draft", int(rows), float(seconds), cold)

    def add_host(self, drafted: bool, seconds: float, rows: int = 1, cold: bool = False) -> None:
        """A step's host time: its wall time less its graph calls (tree handling, acceptance, emit:
        all per row, so it is kept by batch rows like the graph calls)."""
        self._avg("host_spec" if drafted else "host_plain", int(rows), float(seconds), cold)

    def warm(self, name: str, key: int | None = None) -> bool:
        """Table ``name`` holds a measurement past a call shape's first (cold) one (of ``key``, if given)."""
        table = getattr(self, name)
        if key is not None:
            return key in table and (name, key) not in self._once
        return any((name, k) not in self._once for k in table)

    def host_cost(self, drafted: bool, rows) -> float:
        """Estimated host seconds of a step over ``rows`` (0 until measured)."""
        table = self.host_spec if drafted else self.host_plain
        return self._estimate(table, rows) if table else 0.0

    def _estimate(self, table: dict, x):
        """Measured, else linear between measured points; past the largest, proportional to it (a
        larger call is compute-bound: pessimistic until measured); below the smallest, the smallest.
        ``x``: a number or an array of them. The tables hold a few sizes each and change every step,
        so they are kept sorted as Python lists and a number is estimated without numpy (a step's
        planning is otherwise a dozen small array operations, each slow right after a graph call)."""
        if not table:
            return np.full(np.shape(x), np.nan) if np.ndim(x) else np.nan
        cached = self._sorted.get(id(table))
        if cached is None:
            xs, ys, top = [], [], -np.inf
            for k, v in sorted(table.items()):
                top = max(top, v)  # a call over more rows never costs less (noise can say it does)
                xs.append(float(k))
                ys.append(top)
            cached = self._sorted[id(table)] = (xs, ys)
        xs, ys = cached
        if np.ndim(x):
            x = np.asarray(x, dtype=np.float64)
            return np.where(x > xs[-1], ys[-1] * x / xs[-1], np.interp(x, xs, ys))
        x = float(x)
        if x > xs[-1]:
            return ys[-1] * x / xs[-1]
        i = bisect.bisect_left(xs, x)
        if xs[i] == x or i == 0:
            return ys[i]
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])  # numpy.interp's own arithmetic, to the last bit
        return slope * (x - xs[i - 1]) + ys[i - 1]

    def verify_cost(self, tokens):
        return self._estimate(self.verify, tokens)

    def draft_cost(self, rows):
        return self._estimate(self.draft, rows)

    def copy(self) -> Costs:
        c = Costs(self.ema)
        c.verify, c.draft = dict(self.verify), dict(self.draft)  # (new tables: nothing cached for them)
        c.host_plain, c.host_spec = dict(self.host_plain), dict(self.host_spec)
        c._once, c._skipped = set(self._once), dict(self._skipped)
        return c


class Priors(OrderedDict):
    """The mean gains per setting (tree, sampling settings) that requests of that setting start from:
    at most ``limit`` settings, the least recently used forgotten (a client choosing a new
    temperature per request would otherwise grow it for ever; a forgotten setting only starts cold).
    Shared by a decoder's engines (threads): a lock around each use."""

    def __init__(self, items=(), limit: int = PRIORS_MAX):
        self.limit, self._lock = limit, threading.Lock()
        super().__init__()
        for k, v in dict(items).items():
            self[k] = v

    def get(self, key, default=None):
        with self._lock:
            if key not in self:
                return default
            self.move_to_end(key)
            return super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.limit:
                self.popitem(last=False)


class Planner:
    """Picks each step's width for the whole batch (module doc). One per engine, used by its thread."""

    def __init__(self, cfg: AdaptiveConfig | None = None, costs: Costs | None = None, priors: dict | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self.costs = costs if costs is not None else Costs(self.cfg.ema)
        self.plain_run = 0  # plain steps in a row while adaptive rows were live
        self.cut_run = 0  # drafted steps in a row at a width below the widest tree
        self.wait = self.cfg.probe_every
        self.due = self.wait  # plain steps before the next probe: the wait, or longer where drafting is far from paying
        self.probing = False  # the last step was a probe
        self.last_width = 1
        self.history: deque[int] = deque(maxlen=HISTORY_WINDOW)  # the widths of the last planned steps
        self._reuse = 0  # plain steps left that reuse the last plain decision without deciding
        self._fast_left = 0  # drafted steps left that reuse the last full-tree decision (it clearly paid)
        self._probe_left = 0  # drafted steps left of a probe (AdaptiveConfig.probe_steps)
        self._probes = 0  # probes after plain steps since the last one of probe_steps
        self._reused_for = None  # (modes, full) that decision was made for
        self._clear = False  # the last decision was the full trees, by fast_margin or more
        self.fast = False  # this step reuses a clearly paying full-tree decision (gains need no update)
        # setting -> (mean gains (T,), observations); a decoder's, shared on purpose
        self._priors: dict = priors if priors is not None else Priors()

    # ---------------------------------------------------------------- carry

    def carry(self, costs: Costs | None, priors: dict | None = None) -> Planner:
        """Start from what an earlier engine measured on this machine. Returns self."""
        if costs is not None:
            self.costs = costs.copy()
        if priors:
            self._priors = Priors((k, (g.copy(), n)) for k, (g, n) in list(priors.items()))
        return self

    def prior(self, key) -> np.ndarray | None:
        """The mean gains earlier requests of setting ``key`` measured (None: none yet)."""
        got = self._priors.get(key)
        return None if got is None else got[0].copy()

    def learn(self, key, gains: np.ndarray) -> None:
        """Fold one drafted step's gains (a prefix of sizes) into the setting's long-run mean (a plain
        mean of the first 50 observations, then a slow average)."""
        k = gains.shape[0]
        mean, n = self._priors.get(key, (np.full(k, np.nan), 0))
        if mean.shape[0] < k:
            mean = np.concatenate([mean, np.full(k - mean.shape[0], np.nan)])
        n += 1
        w = max(1.0 / n, 0.02)
        mean[:k] = _blend(mean[:k], gains, w)
        self._priors[key] = (mean, n)

    @property
    def priors(self) -> dict:
        return self._priors

    # ---------------------------------------------------------------- decisions

    def rate(self, width: int, rows: int, tokens: float) -> float:
        c = self.costs
        if width == 1:
            return tokens / (c.verify_cost(rows) + c.host_cost(False, rows))
        return tokens / (c.verify_cost(rows * width) + c.draft_cost(rows) + c.host_cost(True, rows))

    def plan(self, modes: np.ndarray, full: np.ndarray, gains: list[np.ndarray | None],
             ceilings=None) -> np.ndarray:
        """(B,) nodes each row verifies next step (0 for an idle row, 1 for a plain one).

        ``modes`` (B,): IDLE / SPEC_OFF / SPEC_ON / SPEC_ADAPTIVE; ``full`` (B,): each row's full tree
        size; ``gains``: per row, its :meth:`RowGains.predicted` (SPEC_ON and SPEC_ADAPTIVE rows), or a
        callable returning that list (called only when a decision is made); ``ceilings``: the same for
        :attr:`RowGains.ceiling` (None, or None for a row: unknown), which sets how long a plain
        decision waits for its probe (:meth:`_probe_due`)."""
        # plain Python over the rows: a step's decision was two dozen small numpy operations, each
        # slow right after a graph call has flushed the CPU caches (~0.1 ms a step)
        modes, full = [int(m) for m in modes], [int(t) for t in full]
        key = (tuple(modes), tuple(full))
        self.fast = False
        if self._reuse > 0 and key == self._reused_for and self.plain_run < self.due:
            self._reuse -= 1  # plain lately, the same rows: only the probe counter moves
            self.plain_run += 1
            width = 1
        elif self._fast_left > 0 and key == self._reused_for:
            self._fast_left -= 1  # the full trees clearly paid lately, the same rows: keep them
            self.fast = True
            width = self.last_width
        elif self._probe_left > 0 and key == self._reused_for:
            self._probe_left -= 1  # a probe's next step (AdaptiveConfig.probe_steps): gains observed
            width = self.last_width
        else:
            self._clear = False
            width = self._width(modes, full, gains, ceilings)
            self._reuse, self._fast_left, self._probe_left, self._reused_for = 0, 0, 0, None
            if width > 1 and self.probing and self.last_width == 1 and self.cfg.probe_steps > 1:  # (after plain)
                self._probes += 1
                if not self.costs.warm("draft") or self._probes >= self.cfg.rewarm_every:
                    self._probe_left, self._reused_for, self._probes = self.cfg.probe_steps - 1, key, 0
            elif width == 1 and SPEC_ADAPTIVE in modes and self.plain_run > 0:
                every = self.cfg.plain_recheck_every or self.cfg.max_probe_every  # (None: the probe ends it)
                self._reuse, self._reused_for = every - 1, key
            elif self._clear:
                self._fast_left, self._reused_for = self.cfg.recheck_every - 1, key
        self._record(width)
        self.last_width = width
        sizes = [0 if m == IDLE else t if m == SPEC_ON else min(width, t) if m == SPEC_ADAPTIVE else 1
                 for m, t in zip(modes, full)]
        return np.array(sizes, dtype=np.int64)

    def _width(self, modes: list[int], full: list[int], gains, ceilings=None) -> int:
        """The batch's width; ``gains`` / ``ceilings`` as :meth:`plan` takes them (lists, or callables
        called only here, once a choice is to be made: rows that all take their full trees need none)."""
        rows = len(modes)
        on = [b for b, m in enumerate(modes) if m == SPEC_ON]
        adapt = [b for b, m in enumerate(modes) if m == SPEC_ADAPTIVE]
        w_min = max([full[b] for b in on], default=1)
        w_max = max([full[b] for b in on + adapt], default=1)
        if not adapt or w_max <= w_min:
            return w_min
        gains = gains() if callable(gains) else gains
        ceilings = ceilings() if callable(ceilings) else ceilings
        c = self.costs
        if not c.draft:  # nothing drafted yet: speculate, to measure it (a probe: steps in a row)
            self.probing = w_min == 1  # (rows that always speculate measure it anyway)
            return w_max
        if w_min == 1 and not self._measured_plain(rows):
            self.probing = False
            return 1  # plain steps to learn what not speculating costs (the first is cold)
        # tokens(W) for every W in w_min..w_max: adaptive rows at min(W, T_b), on rows at T_b, others 1
        # (summed in the order the numpy version summed, row by row then the plain rows, so that
        # ties between widths break as they did, to the last bit)
        drafting = [(gains[b].tolist(), full[b], modes[b] == SPEC_ON) for b in range(rows)
                    if modes[b] in (SPEC_ON, SPEC_ADAPTIVE)]
        n_off = modes.count(SPEC_OFF)
        draft, host = c.draft_cost(rows), c.host_cost(True, rows)
        best, top, plain = w_min, -np.inf, None
        for w in range(w_min, w_max + 1):
            tok = 0.0
            for g, t, always in drafting:
                tok += g[t - 1] if always else g[min(w, t) - 1]
            tok += n_off
            if w == 1:  # a plain step has no drafter call and the plain host time
                rate = plain = self.rate(1, rows, tok)
            else:
                rate = tok / (c.verify_cost(rows * w) + draft + host)
            if top == top and (rate > top or rate != rate):  # the first best; a nan (unmeasured) wins, as in argmax
                best, top = w, rate
        if w_min > 1:
            return best
        paid = top >= self.cfg.margin * plain and best > 1
        was_probe, self.probing = self.probing, False
        if was_probe:  # did the probe win? probe more often again; else wait longer next time
            self.wait = (max(self.wait // 2, self.cfg.probe_every) if paid
                         else min(2 * self.wait, self.cfg.max_probe_every))
        if paid:
            if self.last_width > 1 and not was_probe:
                self.wait = self.cfg.probe_every  # drafted steps in a row, still paying
            self.plain_run, self.due = 0, self.wait
            self._clear = best == w_max and top >= self.cfg.fast_margin * plain
            self.cut_run = self.cut_run + 1 if best < w_max else 0
            if self.cut_run > self.cfg.widen_every:  # probe: the full trees, to learn the sizes past the cut
                self.cut_run, self.probing = 0, True
                return w_max
            return best
        self.plain_run += 1
        self.cut_run = 0
        self.due = self._probe_due(modes, full, gains, ceilings, w_max, n_off, plain)
        if self.plain_run > self.due:  # probe: full trees for all, to measure the gains again
            self.plain_run, self.probing = 0, True
            return w_max
        return 1

    def _probe_due(self, modes: list[int], full: list[int], gains, ceilings, w_max: int, n_off: int,
                   plain: float) -> int:
        """Plain steps before the next probe: the doubling wait, or longer the farther drafting is from
        paying. A width W pays once its rows emit ``need(W) = margin * plain rate * cost(W)`` tokens;
        they are predicted to emit ``pred(W)`` and can emit at most ``cap(W)`` (every draft accepted:
        the ceilings). The gains must climb ``f = (need - pred) / (cap - pred)`` of their room for the
        closest width to pay: the wait grows geometrically with ``f`` from ``probe_every`` to
        ``max_probe_every``, which it is where no width can pay at all (f >= 1: a drafted step costs
        more than its best case buys, as on the 0.9M demo, where every probe lost about two plain
        steps). Computed from the costs and gains an engine carries, so a new engine's first plain
        decision knows it (a doubling wait starts again at ``probe_every`` for each engine)."""
        cfg = self.cfg
        if ceilings is None or cfg.max_probe_every <= self.wait:
            return self.wait
        rows = len(modes)
        drafting = [b for b in range(rows) if modes[b] == SPEC_ADAPTIVE]
        if any(ceilings[b] is None for b in drafting):
            return self.wait
        c = self.costs
        fixed = c.draft_cost(rows) + c.host_cost(True, rows)
        got = [(gains[b].tolist(), ceilings[b], full[b]) for b in drafting]
        f = np.inf
        for w in range(2, w_max + 1):
            need = cfg.margin * plain * (c.verify_cost(rows * w) + fixed)
            pred = cap = float(n_off)
            for g, top, t in got:
                k = min(w, t) - 1
                pred += g[k]
                cap += top[k]
            if need != need:  # unmeasured: probe on the wait
                return self.wait
            if need <= pred:
                f = 0.0
            elif cap > pred:
                f = min(f, (need - pred) / (cap - pred))
        if f >= 1:
            return cfg.max_probe_every
        due = round(cfg.probe_every * (cfg.max_probe_every / cfg.probe_every) ** f)
        return max(self.wait, min(due, cfg.max_probe_every))

    def plain_ahead(self) -> int:
        """Plain steps :meth:`plan` has already decided after the one it just planned plain (a reused
        plain decision: the same rows, no probe due); the engine may run them without asking, calling
        :meth:`planned_plain` for each (the rows must stay the same)."""
        if self.last_width != 1 or self._reused_for is None:
            return 0
        return max(min(self._reuse, self.due - self.plain_run), 0)

    def planned_plain(self) -> None:
        """One of :meth:`plain_ahead`'s steps ran: what :meth:`plan` records for it."""
        self._reuse -= 1
        self.plain_run += 1
        self.fast = False
        self._record(1)

    def _record(self, width: int) -> None:
        self.history.append(width)

    def end_fast(self) -> None:
        """A draft was wholly rejected inside a reused full-tree window: decide afresh next step."""
        self._fast_left = 0

    def _measured_plain(self, rows: int | None = None) -> bool:
        """A plain step's cost is known warm: its host time measured twice for some batch rows, and
        its graph call twice for ``rows`` (the first was cold; on the 0.9M demo a lone first plain
        step measured 0.50 ms of graph and 0.59 ms of host where a plain step costs 0.3 ms in all,
        and the policy, which measures plain steps only when it takes them, then drafted every step
        at 0.62-0.68x autoregressive; on the 19M int4 model one plain call measured 1.17 ms where
        they cost 0.3-0.45, and stayed the estimate through 15 drafted requests)."""
        c = self.costs
        return c.warm("host_plain") and (rows is None or c.warm("verify", rows))
