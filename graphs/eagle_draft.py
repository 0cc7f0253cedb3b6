"""EAGLE drafting in one graph call per decode step (the ``draft_tree.*`` graphs of the manifest).

The export bakes the whole EAGLE-2 tree for a few ``(topk, depth, total_tokens)`` into graphs of
their own (:mod:`exporter.eagle_tree`); the manifest lists them under ``tree["eagle_trees"]``. When
the requested tree is one of them, a decode step is::

    draft   one call: the newly accepted rows (features, next tokens, positions) + the drafter's
            cache -> the T-node tree (tokens, parents, depths, scores, ancestor mask) and the K/V
            of those rows (committed to the drafter cache; the tree rows' K/V stay in the graph)
    verify  one base forward over the tree, accept, commit (as every speculative step)

Otherwise (``eagle_draft="stepwise"``, or a tree that was not baked) the runtime grows the tree on
the host with 1 + depth drafter calls. Both are :class:`graphs.proposers.Eagle`; this module says
which graph drafts a tree and reads its outputs.
"""

from __future__ import annotations

import numpy as np

from graphs import contract as C
from graphs.errors import InputError
from graphs.trees import Tree

DRAFT_MODES = ("auto", "one_call", "stepwise")


def baked_trees(manifest) -> dict[tuple[int, int, int], str]:
    """{(topk, depth, total_tokens): graph role} of the one-call tree graphs in the manifest."""
    out = {}
    for e in (manifest.tree or {}).get("eagle_trees") or []:
        if e.get("graph") in manifest.graphs:
            out[(int(e["topk"]), int(e["depth"]), int(e["total_tokens"]))] = e["graph"]
    return out


def choose_graph(manifest, cfg: dict, mode: str) -> str | None:
    """The tree graph role to draft ``cfg`` with, or None for the step-wise path."""
    if mode not in DRAFT_MODES:
        raise InputError(f"unknown eagle_draft {mode!r}; accepted: {', '.join(DRAFT_MODES)}")
    if mode == "stepwise":
        return None
    key = (cfg["topk"], cfg["depth"], cfg["total_tokens"])
    baked = baked_trees(manifest)
    if key in baked:
        return baked[key]
    if mode == "one_call":
        have = ", ".join(f"{k},{d},{t}" for k, d, t in baked) or "none"
        raise InputError(
            f"no one-call draft graph for the EAGLE tree {key[0]},{key[1]},{key[2]} (baked: {have}); "
            f"re-export with --eagle-trees {key[0]},{key[1]},{key[2]} or load with eagle_draft='auto'"
        )
    return None


def tree_from_outputs(parents: np.ndarray, depth: np.ndarray, mask: np.ndarray, score: np.ndarray) -> Tree:
    """A :class:`Tree` from one sequence's graph outputs (T,), (T,), (T, T), (T,); children in node order,
    which is the graph's (depth, score descending) order, so acceptance tries the best child first."""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0])]
    for i, p in enumerate(parents.tolist()[1:], start=1):
        kids[p].append(i)
    children = [np.array(k, dtype=np.int64) for k in kids]
    return Tree(parents.astype(np.int64), depth.astype(np.int64), mask, children, score=score.astype(np.float64))


def step_feed(model, feats, ids, pos, mask, topk: int, is_aux: bool) -> dict:
    """The step-wise EAGLE drafter call's inputs, on the host or the device path: the base's features
    (``is_aux``: EAGLE-3's layers) or the drafter's own hidden go to the one feature input that has rows
    (EAGLE-3's contract: the other is given with none)."""
    feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask, C.TOPK_IN: np.array([topk], dtype=np.int64)}
    if model.drafter.get("eagle3"):
        bsz = ids.shape[0]
        aux_dim, hid_dim = model.draft_spec.input(C.AUX_HIDDEN).dims[-1], model.draft_spec.input(C.HIDDEN).dims[-1]
        feed[C.AUX_HIDDEN] = feats if is_aux else np.empty((bsz, 0, aux_dim), model.dtype)
        feed[C.HIDDEN] = np.empty((bsz, 0, hid_dim), model.dtype) if is_aux else feats
    else:
        feed[C.HIDDEN] = feats
    return feed
