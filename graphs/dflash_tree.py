"""A DFlash block as a draft tree: the chain of its top-1 tokens, or a tree grown from its top-k.

One DFlash draft call returns, for the S-1 drafted slots of a block, each slot's top-K tokens and
their log-probs (``topk_ids``/``topk_logprobs`` of the draft graph, :func:`graphs.contract.dflash_graph_spec`):
row k is the drafter's guess for the token at root position + k + 1 (the root is the block's anchor,
the token the base chose last). Every slot after the anchor is the mask token, so slot k's top-K is
one distribution shared by every depth-(k+1) node: a node at depth d branches into slot d's top-K,
whichever candidate its parent took. The drafter's path probability of a node is the product of its
tokens' probabilities along the path; keeping the ``size`` best nodes (best-first from the root) gives
a prefix-closed tree, the chain (K = 1) its special case.

Worked example, two slots, top-2 (probabilities, not logs)::

    slot 1: ids [5, 9]  p [.6, .3]          block_tree(..., root_token=4, size=4) keeps
    slot 2: ids [7, 8]  p [.5, .4]              [5] .6, [9] .3, [5, 7] .30 (.6 * .5)
                                             and drops [5, 8] .24, [9, 7] .15, [9, 8] .12

    node  token  parent  depth  score (log)      tree       mask
    0     4      -1      0      0                  0         1 0 0 0
    1     5       0      1      log .6            / \\        1 1 0 0
    2     9       0      1      log .3           1   2       1 0 1 0
    3     7       1      2      log .30          |           1 1 0 1
                                                 3

The output is what the base's verify takes (:mod:`graphs.trees`): a :class:`~graphs.trees.Tree` (parents,
depth, ancestor mask, children by priority, ``score`` = the cumulative log-prob) and the node tokens
(T,) with the root first; verify feeds ``tokens`` at root position + ``tree.depth`` under ``tree.mask``.
Pure numpy, no engine state.
"""

from __future__ import annotations

import heapq

import numpy as np

from graphs.trees import Tree


def _check(topk_ids, topk_logprobs) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(topk_ids, dtype=np.int64)
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or lp.shape != ids.shape:
        raise ValueError(f"dflash tree: topk_ids {ids.shape} and topk_logprobs {lp.shape} must both be "
                         f"(block slots - 1, K) with K >= 1")
    lp = np.minimum(lp, 0.0)  # log-softmax noise above 0; NaN never wins a slot
    lp[np.isnan(lp)] = -np.inf
    return ids, lp


def block_chain(topk_ids, topk_logprobs, root_token: int, size: int | None = None) -> tuple[Tree, np.ndarray]:
    """The chain of the block's top-1 tokens: root, then slot 1, 2, ... (at most ``size`` nodes with the
    root; None: the whole block). ``topk_ids``/``topk_logprobs`` (S-1, K), rank 0 first::

        block_chain([[5, 9], [7, 8]], np.log([[.6, .3], [.5, .4]]), 4)
        # -> parents [-1, 0, 1], tokens [4, 5, 7], score [0, log .6, log .3]
    """
    ids, lp = _check(topk_ids, topk_logprobs)
    n = ids.shape[0] if size is None else min(ids.shape[0], size - 1)
    if n < 0:
        raise ValueError(f"block_chain: size must be >= 1 (the root), got {size}")
    tokens = np.concatenate(([root_token], ids[:n, 0])).astype(np.int64)  # (T,)
    score = np.concatenate(([0.0], np.cumsum(lp[:n, 0])))  # (T,)
    return Tree.from_parents(np.arange(-1, n, dtype=np.int64), score=score), tokens


def block_tree(topk_ids, topk_logprobs, root_token: int, size: int) -> tuple[Tree, np.ndarray]:
    """The ``size``-node tree (root included) of the block's most probable paths (see the module
    docstring): best-first from the root, a node's children are the next slot's top-K, so every kept
    node's parent is kept. Nodes are numbered by (depth, score descending), so ``children`` come in
    score order (the order acceptance tries them). ``topk_ids``/``topk_logprobs``: (S-1, K)."""
    ids, lp = _check(topk_ids, topk_logprobs)
    if size < 1:
        raise ValueError(f"block_tree: size must be >= 1 (the root), got {size}")
    slots, k = ids.shape
    # kept node: (path of ranks, score, index of its parent among kept nodes)
    kept: list[tuple[tuple[int, ...], float, int]] = [((), 0.0, -1)]
    heap = [(-lp[0, r], 0, (r,)) for r in range(k) if np.isfinite(lp[0, r])]  # (-score, parent, path)
    heapq.heapify(heap)
    while heap and len(kept) < size:
        neg, parent, path = heapq.heappop(heap)
        kept.append((path, -neg, parent))
        if len(path) < slots:  # its children: the next slot's top-K
            me = len(kept) - 1
            for r in range(k):
                if np.isfinite(lp[len(path), r]):
                    heapq.heappush(heap, (neg - lp[len(path), r], me, (*path, r)))
    # renumber by (depth, -score, order kept): parents first, siblings by score
    order = sorted(range(len(kept)), key=lambda i: (len(kept[i][0]), -kept[i][1], i))
    new = {old: j for j, old in enumerate(order)}
    parents = np.array([-1 if kept[i][2] < 0 else new[kept[i][2]] for i in order], dtype=np.int64)  # (T,)
    tokens = np.array([root_token] + [ids[len(p) - 1, p[-1]] for p, _, _ in (kept[i] for i in order[1:])],
                      dtype=np.int64)  # (T,)
    score = np.array([kept[i][1] for i in order], dtype=np.float64)  # (T,)
    return Tree.from_parents(parents, score=score), tokens


def block_trees(topk_ids, topk_logprobs, root_tokens, sizes, topk: int | None = None) -> list[tuple[Tree, np.ndarray]]:
    """Per row b of a batch: :func:`block_tree` of ``topk_ids[b]``/``topk_logprobs[b]`` (B, S-1, K) at
    ``sizes[b]`` nodes, over its first ``topk`` candidates per slot (None: all K; 1: the chain)."""
    ids = np.asarray(topk_ids)
    lp = np.asarray(topk_logprobs)
    if ids.ndim != 3:
        raise ValueError(f"block_trees: topk_ids must be (B, S-1, K), got {ids.shape}")
    k = ids.shape[2] if topk is None else topk
    if not 1 <= k <= ids.shape[2]:
        raise ValueError(f"block_trees: topk {topk} is outside 1..{ids.shape[2]} (the draft call's K)")
    out = []
    for b, (root, size) in enumerate(zip(np.asarray(root_tokens).reshape(-1).tolist(), sizes)):
        if k == 1:
            out.append(block_chain(ids[b, :, :1], lp[b, :, :1], root, int(size)))
        else:
            out.append(block_tree(ids[b, :, :k], lp[b, :, :k], root, int(size)))
    return out
