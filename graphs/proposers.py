"""Drafting strategies: what each decode step verifies besides its root.

The engine (:mod:`graphs.engine`) owns the loop: prefill -> propose -> verify-and-accept -> advance ->
emit. A proposer owns, per request, the drafter's state (a typed record in ``request.draft``); every
graph call goes through the engine's executor (:mod:`graphs.executor`). Three calls on the engine's
occupied rows (slot order):

    prefilled(req, b, out, start, end, root)   the base just cached prompt[start:end] of row b
    propose(rows, sizes) -> Drafts              a tree of at most sizes[b] nodes per row (graphs.step)
    advance(rows, out, results, drafts, sizes)  the base verified; each row's RowResult (or None)

    Plain         no drafter (autoregressive, or an export without one)
    Medusa        heads on the last accepted hidden state -> a static tree's candidates (cut to size)
    Eagle         step-wise: the drafter over the newly accepted rows, then ``depth`` calls growing an
                  EAGLE-2 tree; one call: a baked tree graph (graphs.eagle_draft) drafts it whole
    DFlash        one call: the pending context rows into the drafter's K/V and the block [root, mask..]
                  -> each slot's top-k -> the chain or a top-k tree (graphs.dflash_tree)

Rows that do not draft in a drafter call (plain or prefilling rows) are fed one padding position that
sees only itself and commits nothing: a call covers every occupied row so that the drafter's K/V is
fed as one contiguous view (graphs.slots).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from graphs import contract as C
from graphs.adaptive import cut_tree, root_only, static_scores, sub_tree
from graphs.dflash_tree import block_trees
from graphs.eagle_draft import tree_from_outputs
from graphs.kv import inplace_mask
from graphs.slots import attention_mask
from graphs.step import Drafts, Proposal
from graphs.trees import DynamicTreeBuilder, Tree


def presents(out: dict, num_layers: int) -> list:
    """A graph's ``present.*`` outputs in layer order (K0, V0, K1, V1, ...)."""
    return [out[n] for i in range(num_layers) for n in (C.present_key(i), C.present_value(i))]


@dataclasses.dataclass
class MedusaState:
    """One request's Medusa drafting: the hidden state its heads read next and its tree's cuts."""

    tree: Tree  # the request's tree, nodes scored (static_scores) so best-n cuts are ancestor-closed
    cuts: dict  # n -> (tree cut to n nodes, each kept node's head, its rank): shared by the tree's requests
    topk: int  # the heads' top-k the tree reads
    hidden: np.ndarray | None = None  # (H,) the base's hidden state at the last accepted position


class Pending:
    """One request's EAGLE drafter context rows not yet in its cache: (feature of position t, token t+1).

    After prefill, the last prompt position with the first token; after a step, the accepted nodes
    (features from the verify forward) with the tokens that follow them (the accepted tokens, then
    the bonus token); after a plain step, those appended to the rows still waiting."""

    def __init__(self, feat_dim: int, dtype):
        self.feats = np.zeros((0, feat_dim), dtype)  # (A, F)
        self.ids = np.zeros(0, dtype=np.int64)  # (A,)
        self.pos = 0  # position of the first row

    def set(self, feats: np.ndarray, ids: np.ndarray, pos: int) -> None:
        self.feats, self.ids, self.pos = feats, ids, int(pos)

    def extend(self, feats: np.ndarray, ids: np.ndarray) -> None:
        self.feats = np.concatenate([self.feats, feats])
        self.ids = np.concatenate([self.ids, ids])


@dataclasses.dataclass
class DFlashState:
    """One request's DFlash context not yet in the drafter's K/V: the base's target-layer features of
    positions ``pos .. pos + A - 1``. Invariant at each propose: the drafter's cached rows (positions
    0 .. its length - 1) and these rows are every position before the root (the block's anchor)."""

    feats: np.ndarray  # (A, n_aux * H)
    pos: int = 0  # the first pending row's position
    topk: int = 1  # the tree's candidates per slot (1: the chain)

    def extend(self, feats: np.ndarray) -> None:
        self.feats = np.concatenate([self.feats, feats]) if len(self.feats) else feats

    def set(self, feats: np.ndarray, pos: int) -> None:
        self.feats, self.pos = feats, int(pos)


DraftState = MedusaState | Pending | DFlashState


class Plain:
    """No drafter: every step verifies the root only."""

    kind = "plain"
    every_plain_step = False
    """Whether :meth:`advance` must see each plain step of a run (else only its last: the engine's
    plain runs then call it once, with the last step's outputs)."""

    def __init__(self, executor):
        self.ex = executor

    def new_state(self, req) -> DraftState | None:
        return None

    def prefilled(self, req, b, out, start, end, root) -> float:
        """The base cached prompt[start:end] of row b (``out``: its outputs for those positions; ``root``:
        the first token once the prompt is whole). Returns the drafter's seconds spent."""
        return 0.0

    def propose(self, rows, sizes) -> Drafts:
        return Drafts(roots(rows))

    def advance(self, rows, out, results, drafts: Drafts, sizes) -> None:
        pass


def roots(rows) -> list[Proposal]:
    """Every row's root alone (a plain step's proposal)."""
    return [Proposal(root_only(), np.array([r.root if r is not None else 0], dtype=np.int64)) for r in rows]


class Medusa(Plain):
    """Static trees of candidates from the Medusa heads at the last accepted position."""

    kind = "medusa"

    def __init__(self, executor):
        super().__init__(executor)
        self._trees: dict = {}  # tree content -> (the tree with static scores, its cuts by size)

    def new_state(self, req) -> MedusaState:
        t = req.tree
        key = (t.parents.tobytes(), t.head.tobytes(), t.rank.tobytes())
        if key not in self._trees:
            if len(self._trees) >= 256:  # a memory, not a log
                self._trees.clear()
            # nodes scored by assumed acceptance, so best-n cuts are ancestor-closed
            self._trees[key] = (dataclasses.replace(t, score=static_scores(t)), {})
        tree, cuts = self._trees[key]
        return MedusaState(tree, cuts, int(tree.rank.max()) + 1)

    @staticmethod
    def _cut(state: MedusaState, n: int):
        """(tree cut to its best ``n`` nodes (the whole tree for n >= its size), each non-root node's
        (head, rank) of the drafter's top-k it takes its token from), computed once per tree and n."""
        if n not in state.cuts:
            full = state.tree
            keep = cut_tree(full, n) if n < full.size else np.arange(full.size)
            tree = full if n >= full.size else sub_tree(full, keep)
            state.cuts[n] = (tree, full.head[keep[1:]], full.rank[keep[1:]])
        return state.cuts[n]

    def prefilled(self, req, b, out, start, end, root) -> float:
        if end == len(req.prompt):
            req.draft.hidden = out[C.HIDDEN][0, end - start - 1].copy()
        return 0.0

    def propose(self, rows, sizes) -> Drafts:
        drafting = [b for b, n in enumerate(sizes) if n > 1 and rows[b].draft is not None]
        drafts = Drafts(roots(rows))
        if not drafting:
            return drafts
        k = max(rows[b].draft.topk for b in drafting)
        t0 = time.perf_counter()
        ids = self.ex.draft_heads([rows[b].draft.hidden for b in drafting], k)  # (D, 1, heads, K)
        drafts.seconds, drafts.calls = time.perf_counter() - t0, 1
        for j, b in enumerate(drafting):
            # (the tree's depth was checked against the drafter's heads when the request was made; its
            # ranks are below k)
            tree, heads, ranks = self._cut(rows[b].draft, int(sizes[b]))
            cand = np.empty(tree.size, dtype=np.int64)  # (T,) what medusa_candidates gives, cut
            cand[0] = rows[b].root
            cand[1:] = ids[j, 0, heads, ranks]
            drafts.rows[b] = Proposal(tree, cand)
        return drafts

    def advance(self, rows, out, results, drafts: Drafts, sizes) -> None:
        # the heads read the last accepted hidden state only (every_plain_step False: a run's last)
        for b, r in enumerate(rows):
            if r is not None and results[b] is not None and r.draft is not None:
                r.draft.hidden = out[C.HIDDEN][b, results[b].accepted[-1]].copy()


class _Eagle(Plain):
    """What both EAGLE strategies share: the drafter's own K/V per row (the executor's ``draft_kv``),
    fed the accepted rows."""

    every_plain_step = True  # each accepted row joins the drafter's pending context (advance)

    def __init__(self, executor):
        super().__init__(executor)
        info = executor.info
        self.kv = executor.draft_kv
        self.feat, self.feat_dim, self.dtype, self.pad = info.feature, info.feature_dim, info.dtype, info.pad

    def _mask(self, role: str, past: np.ndarray, new: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The attention mask of a ``role`` call whose S new rows of row b go to cache columns
        ``starts[b] ..``: over the buffer's columns where the graph writes in place, else the past
        columns followed by the S new ones (the traced contract)."""
        if self.ex.draft_in_place(role):
            return inplace_mask(past, starts, new)
        return attention_mask(past, new)

    def new_state(self, req) -> Pending:
        return Pending(self.feat_dim, self.dtype)

    def _presents(self, out: dict):
        """The ``present.*`` of a drafter call in layer order; None where the graph wrote them in place."""
        return presents(out, self.kv.num_layers) if any(n.startswith("present.") for n in out) else None

    def prefilled(self, req, b, out, start, end, root) -> float:
        """Feed the drafter (feature of position t, token t+1) for every prompt position whose next
        token is known; the last prompt position waits, with the root, for the first draft."""
        last = len(req.prompt) - 1
        stop = min(end, last)
        feats = out[self.feat][0, : end - start]  # (c, F)
        t = 0.0
        if stop > start:
            k = stop - start
            ids = np.asarray(req.prompt[start + 1 : stop + 1], dtype=np.int64)[None]  # (1, k)
            pos = np.arange(start, stop, dtype=np.int64)[None]
            causal = np.tril(np.ones((1, k, k), dtype=bool))
            rows = slice(b, b + 1)
            starts = self._starts(k, rows)
            mask = self._mask("draft", self.kv.past_mask(rows), causal, starts)
            t0 = time.perf_counter()
            dout = self.ex.draft_step(feats[None, :k], ids, pos, mask, 1, rows=rows, is_aux=True, starts=starts)
            t = time.perf_counter() - t0
            self.kv.commit(self._presents(dout), np.arange(k)[None], np.array([k]), first=b)
        if end == len(req.prompt):
            req.draft.set(feats[last - start : last - start + 1].copy(), np.array([root], dtype=np.int64), last)
        return t

    def _context(self, rows, drafting: list[int], role: str = "draft"):
        """The pending rows of ``drafting`` rows (others: one padding row) as one call's inputs for the
        ``role`` graph (its mask, and ``starts``: where the rows go in the cache)."""
        n = len(rows)
        counts = np.zeros(n, dtype=np.int64)
        for b in drafting:
            counts[b] = len(rows[b].draft.ids)
        a = int(counts.max())
        feats = np.zeros((n, a, self.feat_dim), self.dtype)
        ids = np.full((n, a), self.pad, dtype=np.int64)
        pos = np.zeros((n, a), dtype=np.int64)
        for b in drafting:
            p = rows[b].draft
            feats[b, : counts[b]], ids[b, : counts[b]] = p.feats, p.ids
            pos[b] = p.pos + np.arange(a)
        causal = np.tril(np.ones((a, a), dtype=bool))[None] & (np.arange(a)[None, None] < counts[:, None, None])
        causal |= np.eye(a, dtype=bool)[None]  # padding rows see themselves: no empty softmax
        starts = self._starts(a)
        mask = self._mask(role, self.kv.past_mask(), causal, starts)
        return feats, ids, pos, mask, counts, starts

    def _starts(self, s: int, rows: slice | None = None) -> np.ndarray:
        """(B,) the cache column of each row's next new rows (its length), room made for ``s`` of them."""
        starts = self.kv.write_columns(rows)
        self.kv.reserve(int(starts.max(initial=0)) + s + self.kv.temp)
        return starts

    def advance(self, rows, out, results, drafts: Drafts, sizes) -> None:
        """The accepted rows become the drafter's next context (after a drafted step) or join the rows
        still waiting (after a plain one)."""
        for b, r in enumerate(rows):
            res = results[b]
            if r is None or res is None or r.draft is None:
                continue
            acc = res.accepted
            feats = out[self.feat][b, acc]
            ids = np.append(drafts.rows[b].tokens[acc[1:]], res.bonus).astype(np.int64)
            if sizes[b] > 1:
                r.draft.set(feats, ids, r.position)
            else:
                r.draft.extend(feats, ids)


class Eagle(_Eagle):
    """EAGLE-1/-3 drafting: a request whose tree the export baked drafts it in one call of that tree
    graph; any other grows an EAGLE-2 tree on the host (one drafter call over its pending rows, then
    ``depth`` more). Both kinds may share a step (each call commits only its own rows' context)."""

    kind = "eagle"

    def propose(self, rows, sizes) -> Drafts:
        drafting = [b for b, n in enumerate(sizes) if n > 1 and rows[b] is not None and rows[b].draft is not None]
        drafts = Drafts(roots(rows))
        one_call = [b for b in drafting if rows[b].tree_role is not None]
        stepwise = [b for b in drafting if rows[b].tree_role is None]
        if one_call:
            self._one_call(rows, sizes, one_call, drafts)
        if stepwise:
            self._stepwise(rows, sizes, stepwise, drafts)
        return drafts

    def _stepwise(self, rows, sizes, drafting, drafts: Drafts) -> None:
        n = len(rows)
        calls = 1
        t_draft = 0.0
        topk = max(rows[b].tree["topk"] for b in drafting)
        # 1) context: the pending rows into the drafter cache
        feats, ids, pos, mask, counts, starts = self._context(rows, drafting)
        t0 = time.perf_counter()
        dout = self.ex.draft_step(feats, ids, pos, mask, topk, is_aux=True, starts=starts)
        t_draft += time.perf_counter() - t0
        self.kv.commit(self._presents(dout), np.broadcast_to(np.arange(ids.shape[1]), ids.shape), counts)
        # 2) grow one EAGLE-2 tree per drafting row from its root's drafter output
        builders, frontiers, prev, fed = {}, {}, {}, {}
        for b in drafting:
            cfg = rows[b].tree
            builders[b] = DynamicTreeBuilder(cfg["topk"], cfg["depth"], cfg["total_tokens"])
            last = counts[b] - 1
            k_b = cfg["topk"]
            frontiers[b] = builders[b].start(dout[C.TOPK_IDS][b, last, :k_b], dout[C.TOPK_LOGPROBS][b, last, :k_b])
            prev[b] = dout[C.HIDDEN_OUT][b, last][None]  # (1, H) the output at the root
            fed[b] = np.zeros(0, dtype=np.int64)  # temporary columns of the nodes fed so far
        hid_dim = dout[C.HIDDEN_OUT].shape[-1]
        while any(f is not None for f in frontiers.values()):
            live = [b for b in drafting if frontiers[b] is not None]
            k = max(frontiers[b].size for b in live)
            start = self.kv.top() + self.kv.temp  # where this level's rows will be written
            hid = np.zeros((n, k, hid_dim), self.dtype)
            tok = np.full((n, k), self.pad, dtype=np.int64)
            fpos = np.zeros((n, k), dtype=np.int64)
            # what each of the k new rows sees: context and fed tree rows (cache columns), then this
            # level (written at columns start.. of every row); the cache may grow by this level
            self.kv.reserve(start + k)
            cap = self.kv.capacity
            seen = np.broadcast_to(self.kv.past_mask()[:, None, :], (n, k, cap)).copy()  # (n, k, cap)
            level = np.broadcast_to(np.eye(k, dtype=bool), (n, k, k)).copy()  # padding rows see themselves
            for b in live:
                f = frontiers[b]
                kb, nf = f.size, fed[b].size
                hid[b, :kb] = prev[b][f.parent_row]
                tok[b, :kb] = f.tokens
                fpos[b, :kb] = rows[b].position + f.depth - 1  # the parent's position
                seen[b, :kb][:, fed[b]] = f.attend[:, :nf]
                level[b, :kb, :kb] = f.attend[:, nf:]
            starts = np.full(n, start, dtype=np.int64)
            m = self._mask("draft", seen, level, starts)
            t0 = time.perf_counter()
            dout = self.ex.draft_step(hid, tok, fpos, m, topk, starts=starts)
            t_draft += time.perf_counter() - t0
            calls += 1
            col = self.kv.write_temp(self._presents(dout), k)
            for b in live:
                kb = frontiers[b].size
                fed[b] = np.concatenate([fed[b], col + np.arange(kb)])
                prev[b] = dout[C.HIDDEN_OUT][b, :kb]
                k_b = rows[b].tree["topk"]
                frontiers[b] = builders[b].expand(dout[C.TOPK_IDS][b, :kb, :k_b], dout[C.TOPK_LOGPROBS][b, :kb, :k_b])
        self.kv.drop_temp()
        for b in drafting:
            tree, cand = builders[b].finish(root_token=int(rows[b].root))
            if sizes[b] < tree.size:
                keep = cut_tree(tree, int(sizes[b]))
                tree, cand = sub_tree(tree, keep), cand[keep]
            drafts.rows[b] = Proposal(tree, np.asarray(cand, dtype=np.int64))
        drafts.seconds += t_draft
        drafts.calls += calls

    def _one_call(self, rows, sizes, drafting, drafts: Drafts) -> None:
        """One call of a baked tree graph per tree in use: pending rows + drafter cache -> the tree."""
        t_draft, calls = 0.0, 0
        roles = sorted({rows[b].tree_role for b in drafting})
        for role in roles:  # one call per baked tree in use (usually one)
            group = [b for b in drafting if rows[b].tree_role == role]
            feats, ids, pos, mask, counts, starts = self._context(rows, group, role)
            feed = {self.feat: feats, C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask,
                    C.ROOT_INDEX: np.maximum(counts - 1, 0)}
            t0 = time.perf_counter()
            o = self.ex.draft_tree(role, feed, starts)
            t_draft += time.perf_counter() - t0
            calls += 1
            self.kv.commit(self._presents(o), np.broadcast_to(np.arange(ids.shape[1]), ids.shape), counts)
            for b in group:
                tree = tree_from_outputs(o[C.TREE_PARENTS][b], o[C.TREE_DEPTH][b], o[C.TREE_MASK][b],
                                         o[C.TREE_SCORES][b])
                cand = o[C.TREE_TOKENS][b].astype(np.int64)
                if sizes[b] < tree.size:
                    keep = cut_tree(tree, int(sizes[b]))
                    tree, cand = sub_tree(tree, keep), cand[keep]
                drafts.rows[b] = Proposal(tree, cand)
        drafts.seconds += t_draft
        drafts.calls += calls


class DFlash(Plain):
    """DFlash: one drafter call per step over every occupied row (graphs.executor ``draft_block``):
    each drafting row's pending context rows join its drafter K/V (the executor's ``draft_kv``; a
    row's columns are its positions 0 .., appended only) and its block ``[root, mask x (b-1)]`` at the
    root's position + 0..b-1 returns each slot's top-k; the row's chain (topk 1) or top-k tree
    (graphs.dflash_tree.block_trees) cut to the size the policy allows is what it verifies.

    After a verify the accepted nodes' target-layer features (root included) are the pending rows,
    the bonus token is the next anchor (the root); a row that did not draft (a plain step, its own or
    the batch's) appends its step's row to the rows still pending (docs/dflash.md 0.4)."""

    kind = "dflash"
    every_plain_step = True  # each plain step's row joins the pending context

    def __init__(self, executor):
        super().__init__(executor)
        info = executor.info
        self.kv = executor.draft_kv
        self.feat_dim, self.dtype, self.pad = info.feature_dim, info.dtype, info.pad
        self.block, self.mask_id, self.max_positions = info.block_size, info.mask_token_id, info.max_positions

    def new_state(self, req) -> DFlashState:
        return DFlashState(np.zeros((0, self.feat_dim), self.dtype), 0, int(req.tree["topk"]))

    def prefilled(self, req, b, out, start, end, root) -> float:
        """Every prompt position's features are pending until the first draft (no drafter call here)."""
        req.draft.extend(out[C.AUX_HIDDEN][0, : end - start].copy())
        return 0.0

    def propose(self, rows, sizes) -> Drafts:
        # (a block reaching past the model's positions is not drafted: the row verifies its root)
        drafting = [b for b, n in enumerate(sizes) if n > 1 and rows[b] is not None and rows[b].draft is not None
                    and rows[b].position + self.block <= self.max_positions]
        drafts = Drafts(roots(rows))
        if not drafting:
            return drafts
        n, s = len(rows), self.block
        counts = np.zeros(n, dtype=np.int64)  # (n,) pending rows each row commits (0: not drafting)
        for b in drafting:
            counts[b] = len(rows[b].draft.feats)
        a = int(counts.max())
        feats = np.zeros((n, a, self.feat_dim), self.dtype)  # (n, A, n_aux * H)
        ctx_pos = np.zeros((n, a), dtype=np.int64)  # (n, A) pads: any position
        ids = np.full((n, s), self.pad, dtype=np.int64)  # (n, S) the block
        pos = np.zeros((n, s), dtype=np.int64)  # (n, S)
        for b in drafting:
            st, r = rows[b].draft, rows[b]
            feats[b, : counts[b]] = st.feats
            ctx_pos[b] = st.pos + np.arange(a)
            ids[b] = [r.root] + [self.mask_id] * (s - 1)
            pos[b] = r.position + np.arange(s)
        topk = max(rows[b].draft.topk for b in drafting)
        starts = self.kv.write_columns()  # (n,) where each row's new context rows go: its length
        self.kv.reserve(int(starts.max(initial=0)) + a)
        new = np.arange(a)[None, :] < counts[:, None]  # (n, A) which new context columns are real
        t0 = time.perf_counter()
        out = self.ex.draft_block(feats, ctx_pos, ids, pos, self.kv.past_mask(), new, topk, starts)
        drafts.seconds, drafts.calls = time.perf_counter() - t0, 1
        pres = presents(out, self.kv.num_layers) if any(k.startswith("present.") for k in out) else None
        self.kv.commit(pres, np.broadcast_to(np.arange(a), (n, a)), counts)
        for b in drafting:  # (block_trees of one row at its own K: 1 is the chain)
            (tree, tokens), = block_trees(out[C.TOPK_IDS][b : b + 1], out[C.TOPK_LOGPROBS][b : b + 1],
                                          [rows[b].root], [int(sizes[b])], rows[b].draft.topk)
            rows[b].draft.set(rows[b].draft.feats[:0], rows[b].position)  # in the drafter's K/V now
            drafts.rows[b] = Proposal(tree, tokens)
        return drafts

    def advance(self, rows, out, results, drafts: Drafts, sizes) -> None:
        """The accepted nodes' features (root included) join the pending rows: after a row's draft call
        those were emptied (in its drafter K/V now), so they become the pending rows; after a step it
        did not draft (plain, or its block past the model's positions) they follow the rows waiting."""
        for b, r in enumerate(rows):
            res = results[b]
            if r is None or res is None or r.draft is None:
                continue
            r.draft.extend(out[C.AUX_HIDDEN][b, res.accepted])  # (len(accepted), n_aux * H) root first
