"""Draft trees as data: static Medusa trees from paths, dynamic EAGLE-2 trees from draft scores.

A :class:`Tree` of ``T`` nodes is what the base graph verifies in one forward. Node 0 is the root:
the token the base model already chose at the previous step (always accepted). Every other node is
one drafted token; its parent is the token before it. Nodes are numbered topologically
(``parents[i] < i``), so one pass over ``range(T)`` sees every parent before its children.

Worked example, Medusa paths ``[[0], [1], [0, 0]]`` (top-k ranks per head along a path)::

    node  path    parent  depth  head  rank        tree          mask (row i attends column j)
    0     root    -1      0      -1    -1          0              1 0 0 0
    1     [0]      0      1       0     0         / \\            1 1 0 0
    2     [1]      0      1       0     1        1   2            1 0 1 0
    3     [0, 0]   1      2       1     0        |                1 1 0 1
                                                 3

The base graph reads ``tokens`` (T,), positions ``past_len + depth`` (T,) and ``mask`` (T, T)
(after the all-True block over the K/V cache); row ``i`` of its logits is the distribution of the
token *after* node ``i``. :mod:`graphs.sampling` walks ``children`` to accept a path.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True, eq=False)
class Tree:
    """A draft tree of ``T`` nodes in topological order; node 0 is the root.

    ``children[n]`` lists the children of node ``n`` in *priority order* (the order in which
    acceptance tries them). Both builders below number nodes so that this is also node-index order.

    Example (``Tree.from_parents([-1, 0, 0, 1])``)::

        parents  = [-1, 0, 0, 1]      depth = [0, 1, 1, 2]
        children = [[1, 2], [3], [], []]
        retrieve_paths() = [[0, 2, -1],   # one row per leaf (2, then 3), root..leaf,
                            [0, 1, 3]]    # padded with -1
    """

    parents: np.ndarray  # (T,) int64, index into nodes; -1 for the root
    depth: np.ndarray  # (T,) int64, root 0; position offset of the node after the cache
    mask: np.ndarray  # (T, T) bool, mask[i, j] = j is an ancestor of i or j == i
    children: list[np.ndarray]  # T arrays of node indices, priority order
    head: np.ndarray | None = None  # (T,) int64, Medusa head giving the node's token (depth-1); -1 root
    rank: np.ndarray | None = None  # (T,) int64, top-k rank of the token within that head; -1 root
    score: np.ndarray | None = None  # (T,) float64, dynamic trees: cumulative draft log-prob; root 0

    def __post_init__(self):
        T = self.parents.shape[0]
        if T < 1 or self.parents[0] != -1:
            raise ValueError("tree: node 0 must be the root (parents[0] == -1)")
        if T > 1 and not np.all((self.parents[1:] >= 0) & (self.parents[1:] < np.arange(1, T))):
            raise ValueError("tree: nodes must be in topological order (0 <= parents[i] < i)")
        if self.depth.shape != (T,) or self.mask.shape != (T, T) or len(self.children) != T:
            raise ValueError(f"tree: depth/mask/children do not match {T} nodes")

    @classmethod
    def from_parents(
        cls,
        parents,
        *,
        head: np.ndarray | None = None,
        rank: np.ndarray | None = None,
        score: np.ndarray | None = None,
    ) -> Tree:
        """Build a tree from its parent array; children are listed in node-index order.

        ``Tree.from_parents([-1, 0, 0, 1]).mask`` is::

            [[1, 0, 0, 0],
             [1, 1, 0, 0],
             [1, 0, 1, 0],
             [1, 1, 0, 1]]
        """
        parents = np.asarray(parents, dtype=np.int64)  # (T,)
        T = parents.shape[0]
        depth = np.zeros(T, dtype=np.int64)
        mask = np.eye(T, dtype=bool)  # (T, T)
        kids: list[list[int]] = [[] for _ in range(T)]
        for i, p in enumerate(parents.tolist()):
            if i == 0 or not 0 <= p < i:  # __post_init__ names the error
                continue
            depth[i] = depth[p] + 1
            mask[i] |= mask[p]  # a node sees what its parent sees, plus itself
            kids[p].append(i)
        children = [np.array(k, dtype=np.int64) for k in kids]
        return cls(parents, depth, mask, children, head=head, rank=rank, score=score)

    @functools.cached_property
    def child_lists(self) -> list[list[int]]:
        """``children`` as Python lists (what the acceptance walks read, node by node)."""
        return [c.tolist() for c in self.children]

    @property
    def size(self) -> int:
        """Number of nodes ``T``, the root included."""
        return int(self.parents.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for a root-only tree)."""
        return int(self.depth.max())

    def retrieve_paths(self) -> np.ndarray:
        """(L, max_depth + 1) int64: node indices root..leaf for each leaf (by index), -1 padded."""
        leaves = [n for n in range(self.size) if len(self.children[n]) == 0]
        out = np.full((len(leaves), self.max_depth + 1), -1, dtype=np.int64)  # (L, D+1)
        for row, leaf in enumerate(leaves):
            n = leaf
            while n >= 0:
                out[row, self.depth[n]] = n
                n = int(self.parents[n])
        return out


# --------------------------------------------------------------------------------------------
# Static Medusa trees


def _check_paths(paths, where: str = "medusa tree") -> list[list[int]]:
    """Validate Medusa paths; returns them as plain lists of ints. One-line ValueError otherwise."""
    if not isinstance(paths, (list, tuple)) or len(paths) == 0:
        raise ValueError(f"{where}: paths must be a non-empty list of paths, got {paths!r}")
    clean: list[list[int]] = []
    for path in paths:
        if not isinstance(path, (list, tuple)) or len(path) == 0:
            raise ValueError(f"{where}: path {path!r} must be a non-empty list of ranks")
        for r in path:
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
                raise ValueError(f"{where}: path {list(path)!r} has non-integer rank {r!r}")
            if r < 0:
                raise ValueError(f"{where}: path {list(path)!r} has negative rank {r}")
        clean.append([int(r) for r in path])
    seen: set[tuple[int, ...]] = set()
    for path in clean:
        if tuple(path) in seen:
            raise ValueError(f"{where}: path {path!r} appears twice")
        seen.add(tuple(path))
    for path in clean:
        for n in range(1, len(path)):
            if tuple(path[:n]) not in seen:
                raise ValueError(f"{where}: path {path!r} lacks its prefix {path[:n]!r}")
    return clean


def medusa_tree(paths: list[list[int]]) -> Tree:
    """Static Medusa tree from "choices": each path lists the top-k rank used at each head.

    Node ``i + 1`` is ``sorted(paths, key=(len, path))[i]``, so siblings come in rank order, and
    node ``n`` takes its token from head ``depth[n] - 1`` at rank ``path[-1]``::

        medusa_tree([[1], [0], [0, 0]])
        # nodes: 0 root, 1 [0], 2 [1], 3 [0, 0]
        # parents [-1, 0, 0, 1], head [-1, 0, 0, 1], rank [-1, 0, 1, 0]
    """
    clean = sorted(_check_paths(paths), key=lambda p: (len(p), p))
    index = {(): 0} | {tuple(p): i + 1 for i, p in enumerate(clean)}
    parents = [-1] + [index[tuple(p[:-1])] for p in clean]
    head = np.array([-1] + [len(p) - 1 for p in clean], dtype=np.int64)  # (T,)
    rank = np.array([-1] + [p[-1] for p in clean], dtype=np.int64)  # (T,)
    return Tree.from_parents(parents, head=head, rank=rank)


def medusa_candidates(tree: Tree, root_token: int, topk_ids: np.ndarray) -> np.ndarray:
    """(T,) int64 tokens of a Medusa tree: root_token, then ``topk_ids[head[n], rank[n]]``.

    ``topk_ids`` (heads, K) are the Medusa heads' top-k token ids at the root's position::

        tree = medusa_tree([[0], [1], [0, 0]])
        medusa_candidates(tree, 7, np.array([[5, 9], [3, 4]]))  # -> [7, 5, 9, 3]
    """
    return medusa_candidates_batch(tree, np.array([root_token]), np.asarray(topk_ids)[None])[0]


def medusa_candidates_batch(tree: Tree, root_tokens: np.ndarray, topk_ids: np.ndarray) -> np.ndarray:
    """(B, T) int64: :func:`medusa_candidates` for ``root_tokens`` (B,), ``topk_ids`` (B, heads, K)."""
    if tree.head is None or tree.rank is None:
        raise ValueError("medusa_candidates: tree has no head/rank (not a Medusa tree)")
    topk_ids = np.asarray(topk_ids)
    if topk_ids.ndim != 3:
        raise ValueError(f"medusa_candidates: topk_ids must be (B, heads, K), got {topk_ids.shape}")
    need_heads, need_k = int(tree.head.max()) + 1, int(tree.rank.max()) + 1
    if topk_ids.shape[1] < need_heads or topk_ids.shape[2] < need_k:
        raise ValueError(
            f"medusa_candidates: tree needs {need_heads} heads and top-{need_k}, "
            f"got topk_ids of shape {topk_ids.shape} (B, heads, K)"
        )
    out = np.empty((topk_ids.shape[0], tree.size), dtype=np.int64)  # (B, T)
    out[:, 0] = np.asarray(root_tokens).reshape(-1)
    out[:, 1:] = topk_ids[:, tree.head[1:], tree.rank[1:]]  # (B, T-1)
    return out


# Assumed acceptance for the default tree, shaped like Medusa's measured head accuracies: head h
# predicts its token at rank r with probability TOP1 * HEAD_DECAY**h * RANK_DECAY**r (given the
# path so far was accepted). Head 0 top-1 0.6 and top-inf 0.86; later heads are less accurate.
TOP1 = 0.6
HEAD_DECAY = 0.8
RANK_DECAY = 0.3
# 8 tokens: on CPU a tree is not free (docs/DESIGN.md's cost model: 8 tokens 9.1 ms, 16 tokens 10.9 ms, vs 6.5 ms
# for one). Measured with exporter.bench --sweep (3 heads, 2 cores): 8 tokens was fastest on the
# 0.9M demo model (1.48x; 12 tokens 1.19x) and the 19M one (1.98x; 12 tokens 1.72x, 15 tokens 1.58x).
DEFAULT_MEDUSA_TREE_SIZE = 8
# Nodes whose assumed acceptance is below this are never worth a tree slot (and would need a large
# top-k from the heads: with this floor no path uses a rank above 3, so K = 4 suffices).
_MIN_PATH_PROB = 0.01


def _path_prob(path: tuple[int, ...]) -> float:
    """Assumed probability that every token of ``path`` is accepted (see ``TOP1``)."""
    return math.prod(TOP1 * HEAD_DECAY**h * RANK_DECAY**r for h, r in enumerate(path))


def default_medusa_paths(num_heads: int, size: int | None = None) -> list[list[int]]:
    """A default static tree of ``size`` nodes (root included), built greedily.

    The expected number of accepted draft tokens is the sum, over nodes, of the probability that
    the node's whole path is accepted. Under the assumed per-(head, rank) acceptance above that
    probability only falls along a path and across ranks, so adding the most probable missing node
    ``size - 1`` times (a best-first search from the root) maximises it, and the result is
    prefix-closed. Nodes below an assumed 1% acceptance are left out, so the tree can be smaller
    than ``size`` (one head: 5 nodes). Paths come out in that greedy order::

        default_medusa_paths(2, 5)  # -> [[0], [0, 0], [1], [0, 1]]
    """
    if num_heads < 1:
        raise ValueError(f"default_medusa_paths: num_heads must be >= 1, got {num_heads}")
    size = DEFAULT_MEDUSA_TREE_SIZE if size is None else size
    if size < 2:
        raise ValueError(f"default_medusa_paths: size must be >= 2 (root + 1 draft), got {size}")
    # Each path enters the heap once: its first child when it is taken, its next sibling likewise.
    heap = [(-_path_prob((0,)), (0,))]
    out: list[list[int]] = []
    while heap and len(out) < size - 1:
        neg_prob, path = heapq.heappop(heap)
        if -neg_prob < _MIN_PATH_PROB:  # the best remaining candidate: all the rest are worse
            break
        out.append(list(path))
        nxt = (*path[:-1], path[-1] + 1)
        heapq.heappush(heap, (-_path_prob(nxt), nxt))
        if len(path) < num_heads:
            child = (*path, 0)
            heapq.heappush(heap, (-_path_prob(child), child))
    return out


def medusa_paths_from_acceptance(acc: np.ndarray, size: int, min_prob: float = 1e-3) -> list[list[int]]:
    """The static tree of ``size`` nodes (root included) with the most expected accepted tokens.

    ``acc`` (heads, K): measured probability that head h's rank-r token is the true one. As in the
    Medusa paper, a path's acceptance is the product of its (head, rank) accuracies and the tree's
    expected accepted tokens is 1 + the sum over its nodes, so nodes are added best-first (prefix-
    closed: a node enters only after its parent)::

        medusa_paths_from_acceptance(np.array([[.6, .2], [.5, .1]]), 4)  # -> [[0], [0, 0], [1]]
    """
    acc = np.asarray(acc, dtype=np.float64)
    if acc.ndim != 2 or acc.size == 0:
        raise ValueError(f"medusa_paths_from_acceptance: acc must be (heads, K), got shape {acc.shape}")
    heads, k = acc.shape
    prob = {(): 1.0}
    heap = [(-acc[0, r], (r,)) for r in range(k)]
    heapq.heapify(heap)
    out: list[list[int]] = []
    while heap and len(out) < size - 1:
        neg, path = heapq.heappop(heap)
        if -neg < min_prob:
            break
        out.append(list(path))
        prob[path] = -neg
        if len(path) < heads:
            for r in range(k):
                heapq.heappush(heap, (-(prob[path] * acc[len(path), r]), (*path, r)))
    return out


def expected_accepted(paths: list[list[int]], acc: np.ndarray) -> float:
    """1 + the sum of the paths' acceptance products: tokens per step of a static tree under ``acc``."""
    return 1.0 + sum(math.prod(acc[h, r] for h, r in enumerate(p)) for p in paths)


def load_tree_file(path) -> list[list[int]]:
    """Read Medusa paths from JSON: ``[[0], [1], [0, 0]]`` or ``{"paths": [[0], [1], [0, 0]]}``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tree file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tree file {str(p)!r} is not valid JSON: {e}") from None
    if isinstance(data, dict):
        if set(data) != {"paths"}:
            raise ValueError(f"tree file {str(p)!r}: an object must have exactly the key 'paths'")
        data = data["paths"]
    return _check_paths(data, where=f"tree file {str(p)!r}")


# --------------------------------------------------------------------------------------------
# Dynamic EAGLE-2 trees


@dataclass(frozen=True, eq=False)
class Frontier:
    """The nodes the runtime feeds to the drafter next, one row each (k rows).

    Fed order: the runtime feeds each frontier's rows in order and keeps their drafter K/V, so the
    j-th node ever fed this step is column j of ``attend`` (the root is not on this axis: it is
    the last context position, which every node attends).
    """

    node_ids: np.ndarray  # (k,) int64, builder node ids (root 0, in drafting order); not final ids
    tokens: np.ndarray  # (k,) int64, the node's token: the drafter's input_ids for this row
    depth: np.ndarray  # (k,) int64, node depth (root 0): its token sits at root position + depth
    parent_row: np.ndarray  # (k,) int64, row of the previous drafter call whose hidden output is
    #                         this row's input hidden (the output at the node's parent); for the
    #                         first frontier that call is the root's, a single row, so all 0
    attend: np.ndarray  # (k, n_fed + k) bool, fed nodes (previous frontiers then this one) that
    #                     each row may attend: its fed ancestors and itself

    @property
    def size(self) -> int:
        return int(self.node_ids.shape[0])


# EAGLE-2 defaults for CPUs, measured (python -m exporter.bench --sweep, 2 cores): every drafter call
# costs a fixed ~0.5-1 ms and a tree of T tokens costs ~T/8 base forwards, so a narrow, shallow tree
# wins: on a 19M-parameter Llama (topk, depth, total_tokens) = (2, 3, 6) ran 1.3x faster than (4, 4, 12)
# and (8, 6, 32) 2x slower. GPUs want larger trees (EAGLE-2 uses 10, 6, 60): pass tree=... there.
DEFAULT_EAGLE_TREE = {"topk": 2, "depth": 3, "total_tokens": 6}


class DynamicTreeBuilder:
    """Host side of EAGLE-2 drafting: grow a tree by cumulative draft log-prob, keep the best.

    One decode step (``K`` = top-k the drafter returns per row, usually ``topk``)::

        f = builder.start(ids, logprobs)          # root's drafter output (K,): layer 1
        while f is not None:                      # `depth` times
            out = drafter(f.tokens, hidden[f.parent_row], positions(f.depth), f.attend)
            f = builder.expand(out.topk_ids, out.topk_logprobs)   # (k, K) each
        tree, tokens = builder.finish()           # root + best total_tokens - 1 drafted nodes

    A node's score is the sum of draft log-probs along its path. Each layer's best ``topk`` nodes
    are expanded; every drafted node (expanded or not) competes in :meth:`finish`. As in EAGLE's
    ``depth``, ``depth`` counts drafter calls on tree nodes, so the deepest node has depth
    ``depth + 1``. Hand-checked example (topk=2, depth=1, total_tokens=4, K=2)::

        start([5, 6], log([.6, .3]))       -> layer 1: a=5 (log .6), b=6 (log .3); frontier [a, b]
        expand([[7, 8], [9, 7]], log([[.4, .3], [.9, .1]]))
                                           -> a7 log .24, a8 log .18, b9 log .27, b7 log .03; None
        finish(root_token=4)               -> keep a, b, b9 (b's child beats a's children):
                                              parents [-1, 0, 0, 2], tokens [4, 5, 6, 9]
    """

    def __init__(self, topk: int, depth: int, total_tokens: int):
        if topk < 1 or depth < 1 or total_tokens < 1:
            raise ValueError(
                f"DynamicTreeBuilder: topk, depth, total_tokens must be >= 1, got {topk}, {depth}, "
                f"{total_tokens}"
            )
        self.topk, self.depth, self.total_tokens = topk, depth, total_tokens
        self._n = 0  # nodes drafted so far, root included

    # State, all indexed by builder node id (0 = root, then in drafting order):
    #   _tok (N,) token, _par (N,) parent id, _score (N,) cumulative log-prob, _dep (N,) depth,
    #   _fed (N,) index on the fed axis or -1, _anc (F, F) fed-ancestor-or-self rows per fed node.

    def start(self, topk_ids, topk_logprobs) -> Frontier:
        """Layer 1 from the drafter's output at the root: ``topk_ids``, ``topk_logprobs`` (K,)."""
        ids = np.asarray(topk_ids, dtype=np.int64).reshape(-1)  # (K,)
        lp = np.asarray(topk_logprobs, dtype=np.float64).reshape(-1)  # (K,)
        if ids.shape != lp.shape or ids.size == 0:
            raise ValueError(f"start: topk_ids {ids.shape} and topk_logprobs {lp.shape} must be (K,)")
        K = ids.size
        cap = 1 + K + self.depth * self.topk * K  # root + layer 1 + one layer per expand
        cap_fed = self.topk * self.depth  # one frontier per drafter call
        self._tok = np.empty(cap, dtype=np.int64)
        self._par = np.empty(cap, dtype=np.int64)
        self._score = np.empty(cap, dtype=np.float64)
        self._dep = np.empty(cap, dtype=np.int64)
        self._fed = np.full(cap, -1, dtype=np.int64)
        self._anc = np.zeros((cap_fed, cap_fed), dtype=bool)
        self._tok[0], self._par[0], self._score[0], self._dep[0] = -1, -1, 0.0, 0
        self._n, self._n_fed, self._expands = 1, 0, 0
        new = self._add(np.zeros(K, dtype=np.int64), ids, _safe_logprobs(lp))  # (K,)
        order = _best(self._score[new], self.topk)  # (k,) into layer 1
        return self._frontier(new[order], parent_row=np.zeros(order.size, dtype=np.int64))

    def expand(self, topk_ids, topk_logprobs) -> Frontier | None:
        """Children of the last frontier from the drafter's output at its rows: (k, K) each.

        Returns the next frontier, or None once the drafter has been called ``depth`` times.
        """
        if self._n == 0 or self._expands >= self.depth:
            raise RuntimeError("expand: call start() first, and no more than `depth` times")
        ids = np.asarray(topk_ids, dtype=np.int64)  # (k, K)
        lp = np.asarray(topk_logprobs, dtype=np.float64)  # (k, K)
        k = self._last.size
        if ids.ndim != 2 or ids.shape[0] != k or lp.shape != ids.shape:
            raise ValueError(
                f"expand: topk_ids {ids.shape} and topk_logprobs {lp.shape} must be ({k}, K)"
            )
        K = ids.shape[1]
        scores = self._score[self._last][:, None] + _safe_logprobs(lp)  # (k, K)
        new = self._add(np.repeat(self._last, K), ids.reshape(-1), scores.reshape(-1))  # (k*K,)
        self._expands += 1
        if self._expands == self.depth:
            return None
        order = _best(scores.reshape(-1), self.topk)  # (k',) into the flat (k*K,) children
        return self._frontier(new[order], parent_row=order // K)

    def finish(self, root_token: int = -1) -> tuple[Tree, np.ndarray]:
        """The root plus the best ``total_tokens - 1`` drafted nodes, re-indexed.

        Returns ``(tree, tokens)``: ``tokens`` (T,) int64 with ``tokens[0] = root_token`` (the
        builder never sees the root token; -1 unless given), nodes ordered by (depth, score descending), so each node's
        children come in score order. ``tree.score`` holds the cumulative log-probs.

        The kept set is ancestor-closed: a child's score is its parent's plus a log-prob <= 0, so
        never above its parent's, and ties go to the older node (lower builder id), i.e. the parent.
        """
        if self._n == 0:
            raise RuntimeError("finish: call start() first")
        n = self._n
        ids = np.arange(1, n)  # (n-1,) drafted builder ids
        keep = ids[_best(self._score[1:n], self.total_tokens - 1)]  # (T-1,) builder ids
        keep = keep[np.lexsort((keep, -self._score[keep], self._dep[keep]))]  # (depth, -score, id)
        new_id = np.full(n, -1, dtype=np.int64)  # builder id -> final node index
        new_id[0] = 0
        new_id[keep] = np.arange(1, keep.size + 1)
        parents = np.concatenate(([-1], new_id[self._par[keep]]))  # (T,)
        if np.any(parents[1:] < 0):
            raise AssertionError("finish: kept set is not ancestor-closed (NaN scores?)")
        tokens = np.concatenate(([root_token], self._tok[keep]))  # (T,)
        score = np.concatenate(([0.0], self._score[keep]))  # (T,)
        return Tree.from_parents(parents, score=score), tokens

    def _add(self, parents: np.ndarray, ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """Append drafted nodes; returns their builder ids (m,)."""
        m = ids.size
        new = np.arange(self._n, self._n + m)  # (m,)
        self._tok[new], self._par[new], self._score[new] = ids, parents, scores
        self._dep[new] = self._dep[parents] + 1
        self._n += m
        return new

    def _frontier(self, node_ids: np.ndarray, parent_row: np.ndarray) -> Frontier:
        """Register ``node_ids`` (k,) as the next fed block and build their attend rows."""
        k, f0 = node_ids.size, self._n_fed
        pf = self._fed[self._par[node_ids]]  # (k,) parent's fed index, -1 for the root
        rows = self._anc[np.maximum(pf, 0)] & (pf >= 0)[:, None]  # (k, F) parent's ancestors
        rows[np.arange(k), f0 + np.arange(k)] = True  # ... plus itself
        self._anc[f0 : f0 + k] = rows
        self._fed[node_ids] = f0 + np.arange(k)
        self._n_fed = f0 + k
        self._last = node_ids
        return Frontier(
            node_ids=node_ids,
            tokens=self._tok[node_ids],
            depth=self._dep[node_ids],
            parent_row=parent_row,
            attend=self._anc[f0 : f0 + k, : f0 + k].copy(),  # (k, n_fed)
        )


def _safe_logprobs(lp: np.ndarray) -> np.ndarray:
    """Clip to <= 0 (float noise from log-softmax) and map NaN to -inf, so scores never rise."""
    lp = np.minimum(lp, 0.0)
    lp[np.isnan(lp)] = -np.inf
    return lp


def _best(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` highest scores, best first; ties go to the lower index.

    ``_best(np.array([-1., -.5, -1., -2.]), 3)`` -> ``[1, 0, 2]``
    """
    return np.argsort(-scores, kind="stable")[:n]
