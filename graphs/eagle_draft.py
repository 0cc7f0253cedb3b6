"""EAGLE drafting in one graph call per decode step (the ``draft_tree.*`` graphs of the manifest).

The export bakes the whole EAGLE-2 tree for a few ``(topk, depth, total_tokens)`` into graphs of
their own (:mod:`exporter.eagle_tree`); the manifest lists them under ``tree["eagle_trees"]``. When
the requested tree is one of them, a decode step is::

    draft   one call: the newly accepted rows (features, next tokens, positions) + the drafter's
            cache -> the T-node tree (tokens, parents, depths, scores, ancestor mask) and the K/V
            of those rows (committed to the drafter cache; the tree rows' K/V stay in the graph)
    verify  one base forward over the tree, accept, commit (as every speculative step)

Otherwise (``eagle_draft="stepwise"``, or a tree that was not baked) the runtime grows the tree on
the host with 1 + depth drafter calls (:meth:`graphs.runtime.Decoder._eagle`).
"""

from __future__ import annotations

import time

import numpy as np

from graphs import contract as C
from graphs.adaptive import plain_inputs
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


class PendingRows:
    """The drafter's context rows not yet in its cache: (feature of position t, token t+1) per sequence.

    After prefill they are the whole prompt; after a step, the accepted nodes (features from the
    verify forward) with the tokens that follow them (the accepted tokens, then the bonus token).
    """

    def __init__(self, feats: list[np.ndarray], ids: list[np.ndarray], dtype, pad: int):
        self.feats, self.ids = feats, ids
        self.pos = np.zeros(len(ids), dtype=np.int64)  # position of each sequence's first pending row
        self.dtype, self.pad = dtype, pad

    def arrays(self):
        """(feats (B, A, F), ids (B, A), positions (B, A), causal block (B, A, A), counts (B,)), right-padded."""
        bsz = len(self.ids)
        counts = np.array([len(x) for x in self.ids])
        a = int(counts.max())
        feats = np.zeros((bsz, a, self.feats[0].shape[-1]), self.dtype)
        ids = np.full((bsz, a), self.pad, dtype=np.int64)
        for b in range(bsz):
            feats[b, : counts[b]], ids[b, : counts[b]] = self.feats[b], self.ids[b]
        causal = np.tril(np.ones((a, a), dtype=bool))[None] & (np.arange(a)[None, None] < counts[:, None, None])
        causal |= np.eye(a, dtype=bool)[None]  # padding rows see themselves: no empty softmax
        return feats, ids, self.pos[:, None] + np.arange(a), causal, counts

    def set(self, b: int, feats: np.ndarray, ids: np.ndarray, pos: int) -> None:
        """The drafter consumed the rows: these replace them, the first at position ``pos``."""
        self.feats[b], self.ids[b], self.pos[b] = feats, ids, pos

    def extend(self, b: int, feats: np.ndarray, ids: np.ndarray) -> None:
        """No drafter call this step: append to the rows still waiting."""
        self.feats[b] = np.concatenate([self.feats[b], feats])
        self.ids[b] = np.concatenate([self.ids[b], ids])


_TREE_OUT = [C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_SCORES, C.TREE_MASK]


def one_call_steps(dec, seqs, sampler, stats, role: str):
    """The EAGLE decode loop with one drafter call per step (a generator, like ``Decoder._eagle``).

    ``dec`` is the :class:`graphs.runtime.Decoder` (its sessions, caches, verify and accept). When the
    decoder is adaptive for this run, a :class:`graphs.adaptive.AdaptivePolicy` cuts each sequence's
    tree to the size that pays, down to plain one-token steps that skip the drafter (greedy output is
    unchanged).
    """
    from graphs.runtime import _full_mask

    spec, session = dec.manifest.graphs[role], dec.tree_sessions[role]
    kv, rows, dkv, feat_name, root, pend, pos = dec._eagle_start(seqs, sampler, stats)
    bsz, d = len(seqs), dec.drafter
    size = spec.output(C.TREE_TOKENS).dims[1]
    policy = dec._new_policy(bsz, size, sampler, ("eagle_one_call", role, size))
    yield [(b, [int(root[b])]) for b in rows]
    while True:
        live = np.array([not s.done for s in seqs])
        sizes = policy.plan(live) if policy is not None else None
        t_draft = None
        if sizes is not None and sizes.max() == 1:  # a plain step: the drafter's rows wait
            trees, cand, layout = plain_inputs(root)
            stats.plain_steps += 1
        else:
            feats, ids, ppos, causal, counts = pend.arrays()
            feed = {feat_name: feats, C.INPUT_IDS: ids, C.POSITION_IDS: ppos,
                    C.ATTENTION_MASK: _full_mask(dkv.past_mask(), causal), C.ROOT_INDEX: counts - 1}  # (B, 1, A, P+A)
            t0 = time.perf_counter()
            o = dec._execute(session, spec, feed, dkv, _TREE_OUT)
            t_draft = time.perf_counter() - t0
            stats.time_draft += t_draft
            stats.draft_calls += 1
            dkv.append(dec._presents(o, d["num_layers"]), np.broadcast_to(np.arange(ids.shape[1]), ids.shape),
                       counts)
            cand, depth, tmask = o[C.TREE_TOKENS], o[C.TREE_DEPTH], o[C.TREE_MASK]
            trees = [tree_from_outputs(o[C.TREE_PARENTS][b], depth[b], tmask[b], o[C.TREE_SCORES][b]) for b in rows]
            layout = (depth, tmask)
            if sizes is not None and sizes.min() < cand.shape[1]:
                trees, cand, layout = policy.shrink(trees, cand, sizes)
        out, accepted, bonus = dec._verify_and_accept(kv, seqs, sampler, stats, trees, cand, pos, layout,
                                                      policy, t_draft, live)
        yield dec._eagle_emit(seqs, out, accepted, bonus, cand, feat_name, pend, pos, root, t_draft is not None)
