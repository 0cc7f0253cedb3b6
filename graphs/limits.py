"""Tree arguments checked against the model before any graph runs (one-line InputErrors).

A Medusa rank r asks the draft graph for its top r + 1 tokens, an EAGLE ``topk`` for the drafter's top
k: neither may exceed the (draft) vocabulary (ONNX Runtime's TopK would fail with a raw error). An
EAGLE-2 tree cannot hold more than ``1 + topk + depth * topk**2`` nodes (layer 1, then ``topk``
expanded nodes with ``topk`` children per drafter call), and no tree may be longer than the
context, so a larger ``total_tokens`` is refused instead of allocating masks for it.
"""

from __future__ import annotations

from graphs.errors import InputError
from graphs.trees import Tree


def check_medusa_tree(tree: Tree, vocab: int, max_positions: int) -> None:
    top = int(tree.rank.max()) + 1
    if top > vocab:
        raise InputError(f"Medusa tree rank {top - 1} asks for the top {top} tokens but the vocabulary has {vocab}; "
                         f"use ranks below {vocab}")
    if tree.size >= max_positions:
        raise InputError(f"Medusa tree of {tree.size} nodes does not fit the context of {max_positions} positions; "
                         f"use a smaller tree")


def max_eagle_nodes(topk: int, depth: int) -> int:
    return 1 + topk + depth * topk * topk


def check_eagle_tree(cfg: dict, draft_vocab: int, max_positions: int) -> None:
    topk, depth, total = cfg["topk"], cfg["depth"], cfg["total_tokens"]
    if topk > draft_vocab:
        raise InputError(f"EAGLE tree topk {topk} exceeds the drafter's vocabulary of {draft_vocab}; use topk <= "
                         f"{draft_vocab}")
    if depth >= max_positions:
        raise InputError(f"EAGLE tree depth {depth} does not fit the context of {max_positions} positions")
    cap = min(max_eagle_nodes(topk, depth), max_positions - 1)
    if total > cap:
        raise InputError(f"EAGLE tree total_tokens {total} exceeds the {cap} nodes a tree with topk {topk} and depth "
                         f"{depth} can hold in this model; use total_tokens <= {cap}")
