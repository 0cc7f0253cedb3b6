"""Drafting strategies: what each decode step verifies besides its root.

The engine (:mod:`graphs.engine`) owns the loop: prefill -> propose -> verify-and-accept -> advance ->
emit. A proposer owns the drafter's sessions and, per request, the drafter's state (a small object in
``request.draft``), and implements three calls on the engine's occupied rows (slot order):

    prefilled(req, b, out, start, end, root)   the base just cached prompt[start:end] of row b
    propose(rows, sizes) -> ([(tree, tokens)], seconds, calls)   a tree of at most sizes[b] nodes per row
    advance(rows, out, accepted, bonus, tokens, sizes)   the base verified; accepted nodes per row

    Plain         no drafter (autoregressive, or an export without one)
    Medusa        heads on the last accepted hidden state -> a static tree's candidates (cut to size)
    Eagle         step-wise: the drafter over the newly accepted rows, then ``depth`` calls growing an
                  EAGLE-2 tree; one call: a baked tree graph (graphs.eagle_draft) drafts it whole

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
from graphs.eagle_draft import tree_from_outputs
from graphs.kv import inplace_mask
from graphs.sessions import BoundArrays, InPlaceRun
from graphs.slots import SlotCache, attention_mask
from graphs.trees import DynamicTreeBuilder

TREE_OUTPUTS = [C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_SCORES, C.TREE_MASK]


def presents(out: dict, num_layers: int) -> list:
    """A graph's ``present.*`` outputs in layer order (K0, V0, K1, V1, ...)."""
    return [out[n] for i in range(num_layers) for n in (C.present_key(i), C.present_value(i))]


class Plain:
    """No drafter: every step verifies the root only."""

    kind = "plain"
    every_plain_step = False
    """Whether :meth:`advance` must see each plain step of a run (else only its last: the engine's
    plain runs then call it once, with the last step's outputs)."""

    def __init__(self, runtime):
        self.rt = runtime

    def new_state(self, req):
        return None

    def add_row(self) -> None:
        pass

    def remove_row(self, b: int) -> None:
        pass

    def prefilled(self, req, b, out, start, end, root) -> float:
        """The base cached prompt[start:end] of row b (``out``: its outputs for those positions; ``root``:
        the first token once the prompt is whole). Returns the drafter's seconds spent."""
        return 0.0

    def propose(self, rows, sizes):
        """([(tree, tokens (tree.size,))] per row, drafting seconds, drafter calls)."""
        return _roots(rows), 0.0, 0

    def advance(self, rows, out, accepted, bonus, cand, sizes) -> None:
        pass

    def memory(self) -> dict:
        return {}

    def shrink(self) -> None:
        pass


def _roots(rows) -> list:
    return [(root_only(), np.array([r.root if r is not None else 0], dtype=np.int64)) for r in rows]


class Medusa(Plain):
    """Static trees of candidates from the Medusa heads at the last accepted position."""

    kind = "medusa"

    def __init__(self, runtime):
        super().__init__(runtime)
        self._trees: dict = {}  # tree content -> the tree with static scores, and its cuts by size
        self._calls: dict = {}  # (drafting rows, top-k) -> the heads' bound call (one engine, one thread)

    def new_state(self, req):
        t = req.tree
        key = (t.parents.tobytes(), t.head.tobytes(), t.rank.tobytes())
        if key not in self._trees:
            if len(self._trees) >= 256:  # a memory, not a log
                self._trees.clear()
            # nodes scored by assumed acceptance, so best-n cuts are ancestor-closed
            self._trees[key] = {"tree": dataclasses.replace(t, score=static_scores(t))}
        tree = self._trees[key]["tree"]
        return {"hidden": None, "tree": tree, "cuts": self._trees[key], "topk": int(tree.rank.max()) + 1}

    def _bound(self, d: int, k: int) -> BoundArrays:
        """The heads' call for ``d`` drafting rows and top-``k``, bound once (graphs.sessions.BoundArrays):
        hidden (d, 1, H) in, topk_ids (d, 1, heads, k) out. A few (rows, k) pairs occur; each is kept."""
        call = self._calls.get((d, k))
        if call is None:
            if len(self._calls) >= 16:  # a memory, not a log (a batch's drafting rows vary)
                self._calls.clear()
            spec = self.rt.draft_spec
            h_in, ids_out = spec.input(C.HIDDEN), spec.output(C.TOPK_IDS)
            call = BoundArrays(self.rt.draft,
                               {C.HIDDEN: ((d, 1, h_in.dims[2]), h_in.dtype), C.TOPK_IN: ((1,), np.int64)},
                               {C.TOPK_IDS: ((d, 1, ids_out.dims[2], k), ids_out.dtype)})
            call.inputs[C.TOPK_IN][:] = k
            self._calls[(d, k)] = call
        return call

    @staticmethod
    def _cut(state: dict, n: int):
        """(tree cut to its best ``n`` nodes (the whole tree for n >= its size), each non-root node's
        (head, rank) of the drafter's top-k it takes its token from), computed once per tree and n."""
        cuts = state["cuts"]
        if n not in cuts:
            full = state["tree"]
            keep = cut_tree(full, n) if n < full.size else np.arange(full.size)
            tree = full if n >= full.size else sub_tree(full, keep)
            cuts[n] = (tree, full.head[keep[1:]], full.rank[keep[1:]])
        return cuts[n]

    def prefilled(self, req, b, out, start, end, root) -> float:
        if end == len(req.prompt):
            req.draft["hidden"] = out[C.HIDDEN][0, end - start - 1].copy()
        return 0.0

    def propose(self, rows, sizes):
        drafting = [b for b, n in enumerate(sizes) if n > 1 and rows[b].draft is not None]
        result = _roots(rows)
        if not drafting:
            return result, 0.0, 0
        k = max(rows[b].draft["topk"] for b in drafting)
        if self.rt.provider == "cpu":
            call = self._bound(len(drafting), k)
            hidden = call.inputs[C.HIDDEN]  # (D, 1, H)
            for j, b in enumerate(drafting):
                hidden[j, 0] = rows[b].draft["hidden"]
            t0 = time.perf_counter()
            ids = call.run()[C.TOPK_IDS]
        else:  # (host arrays bound to a CUDA session: untested here, no GPU was lent; run() is)
            hidden = np.stack([rows[b].draft["hidden"] for b in drafting])[:, None]  # (D, 1, H)
            t0 = time.perf_counter()
            (ids,) = self.rt.draft.run([C.TOPK_IDS], {C.HIDDEN: hidden, C.TOPK_IN: np.array([k], dtype=np.int64)})
        t_draft = time.perf_counter() - t0
        for j, b in enumerate(drafting):  # ids (D, 1, heads, K)
            # (the tree's depth was checked against the drafter's heads when the request was made:
            # Decoder.medusa_tree; its ranks are below k)
            tree, heads, ranks = self._cut(rows[b].draft, int(sizes[b]))
            cand = np.empty(tree.size, dtype=np.int64)  # (T,) what medusa_candidates gives, cut
            cand[0] = rows[b].root
            cand[1:] = ids[j, 0, heads, ranks]
            result[b] = (tree, cand)
        return result, t_draft, 1

    def advance(self, rows, out, accepted, bonus, cand, sizes) -> None:
        # the heads read the last accepted hidden state only (every_plain_step False: a run's last)
        for b, r in enumerate(rows):
            if r is not None and accepted[b] is not None and r.draft is not None:
                r.draft["hidden"] = out[C.HIDDEN][b, accepted[b][-1]].copy()


class Pending:
    """One request's drafter context rows not yet in its cache: (feature of position t, token t+1).

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


class _Eagle(Plain):
    """What both EAGLE strategies share: the drafter's own K/V per row, fed the accepted rows."""

    every_plain_step = True  # each accepted row joins the drafter's pending context (advance)

    def __init__(self, runtime, slots: int, max_len: int, headroom: int):
        super().__init__(runtime)
        d = runtime.drafter
        self.eagle3 = bool(d.get("eagle3"))
        self.feat = C.AUX_HIDDEN if self.eagle3 else C.HIDDEN
        self.layers = d["num_layers"]
        self.kv = SlotCache(d["num_layers"], slots, d["num_kv_heads"], d["head_dim"], runtime.dtype, max_len,
                            headroom=headroom)
        self.spec = runtime.draft_spec
        self.dtype = runtime.dtype
        self.pad = runtime.pad
        # graphs that write the drafter's K/V into its cache in place (optimized for the CPU): bound
        # per graph, each with its own IO bindings of the cache's buffers
        self._in_place = {role: InPlaceRun(session, spec) for role, session, spec in self._drafter_graphs()
                          if C.kv_in_place(spec)}

    def _drafter_graphs(self):
        yield "draft", self.rt.draft, self.spec
        for role, session in getattr(self.rt, "tree_sessions", {}).items():
            yield role, session, self.rt.manifest.graphs[role]

    def _mask(self, role: str, past: np.ndarray, new: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The attention mask of a ``role`` call whose S new rows of row b go to cache columns
        ``starts[b] ..``: over the buffer's columns where the graph writes in place, else the past
        columns followed by the S new ones (the traced contract)."""
        if role in self._in_place:
            return inplace_mask(past, starts, new)
        return attention_mask(past, new)

    def _call(self, role: str, session, spec, names: list[str], feed: dict, starts: np.ndarray,
              rows: slice | None = None) -> dict:
        """One drafter graph call against the cache's ``rows`` (default: every occupied row): ``names``
        (no ``present.*``) by name. In place, the S new rows of row b are written at ``starts[b]``;
        else the graph's ``present.*`` come back too (the rows for the caller to commit)."""
        run = self._in_place.get(role)
        if run is None:
            names = names + [t.name for t in spec.outputs if t.name.startswith("present.")]
            return dict(zip(names, session.run(names, feed | self.kv.feed(rows))))
        return run.run_on(self.kv, feed | {C.KV_WRITE: np.asarray(starts, dtype=np.int64)}, rows)

    def memory(self) -> dict:
        return {"drafter_kv_budget_bytes": self.kv.budget_bytes, "drafter_kv_allocated_bytes": self.kv.allocated_bytes}

    def new_state(self, req):
        return Pending(self._feat_dim(), self.dtype)

    def _feat_dim(self) -> int:
        return self.rt.base_spec.output(self.feat).dims[-1]

    def add_row(self) -> None:
        self.kv.add_row()

    def remove_row(self, b: int) -> None:
        self.kv.remove_row(b)

    def shrink(self) -> None:
        self.kv.shrink()

    def run_draft(self, feats, ids, pos, mask, topk: int, rows: slice | None = None, is_aux: bool = False,
                  starts: np.ndarray | None = None):
        """One drafter forward over ``rows`` of the drafter cache (default: every occupied row).

        ``feats`` are the base's features (``is_aux``: EAGLE-3 layers) or the drafter's own hidden;
        ``mask`` from :meth:`_mask` with the same ``starts`` (where the new rows go)."""
        bsz = ids.shape[0]
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask,
                C.TOPK_IN: np.array([topk], dtype=np.int64)}
        if self.eagle3:  # exactly one of the two feature inputs has rows (contract)
            aux_dim = self.spec.input(C.AUX_HIDDEN).dims[-1]
            hid_dim = self.spec.input(C.HIDDEN).dims[-1]
            feed[C.AUX_HIDDEN] = feats if is_aux else np.empty((bsz, 0, aux_dim), self.dtype)
            feed[C.HIDDEN] = np.empty((bsz, 0, hid_dim), self.dtype) if is_aux else feats
        else:
            feed[C.HIDDEN] = feats
        return self._call("draft", self.rt.draft, self.spec, [C.HIDDEN_OUT, C.TOPK_IDS, C.TOPK_LOGPROBS], feed,
                          starts, rows)

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
            dout = self.run_draft(feats[None, :k], ids, pos, mask, 1, rows=rows, is_aux=True, starts=starts)
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
        feats = np.zeros((n, a, self._feat_dim()), self.dtype)
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

    def _presents(self, out: dict):
        """The ``present.*`` of a drafter call in layer order; None where the graph wrote them in place."""
        return presents(out, self.layers) if any(n.startswith("present.") for n in out) else None

    def advance(self, rows, out, accepted, bonus, cand, sizes) -> None:
        """The accepted rows become the drafter's next context (after a drafted step) or join the rows
        still waiting (after a plain one)."""
        for b, r in enumerate(rows):
            if r is None or accepted[b] is None or r.draft is None:
                continue
            acc = accepted[b]
            feats = out[self.feat][b, acc]
            ids = np.append(cand[b][acc[1:]], bonus[b]).astype(np.int64)
            if sizes[b] > 1:
                r.draft.set(feats, ids, r.position)
            else:
                r.draft.extend(feats, ids)


class Eagle(_Eagle):
    """EAGLE-1/-3 drafting: a request whose tree the export baked drafts it in one call of that tree
    graph; any other grows an EAGLE-2 tree on the host (one drafter call over its pending rows, then
    ``depth`` more). Both kinds may share a step (each call commits only its own rows' context)."""

    kind = "eagle"

    def propose(self, rows, sizes):
        drafting = [b for b, n in enumerate(sizes) if n > 1 and rows[b] is not None and rows[b].draft is not None]
        result = _roots(rows)
        t_draft, calls = 0.0, 0
        one_call = [b for b in drafting if rows[b].tree_role is not None]
        stepwise = [b for b in drafting if rows[b].tree_role is None]
        if one_call:
            t, c = self._one_call(rows, sizes, one_call, result)
            t_draft, calls = t_draft + t, calls + c
        if stepwise:
            t, c = self._stepwise(rows, sizes, stepwise, result)
            t_draft, calls = t_draft + t, calls + c
        return result, t_draft, calls

    def _stepwise(self, rows, sizes, drafting, result):
        n = len(rows)
        calls = 1
        t_draft = 0.0
        topk = max(rows[b].tree["topk"] for b in drafting)
        # 1) context: the pending rows into the drafter cache
        feats, ids, pos, mask, counts, starts = self._context(rows, drafting)
        t0 = time.perf_counter()
        dout = self.run_draft(feats, ids, pos, mask, topk, is_aux=True, starts=starts)
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
            cap = self.kv.capacity
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
            dout = self.run_draft(hid, tok, fpos, m, topk, starts=starts)
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
            result[b] = (tree, np.asarray(cand, dtype=np.int64))
        return t_draft, calls

    def _one_call(self, rows, sizes, drafting, result):
        """One call of a baked tree graph per tree in use: pending rows + drafter cache -> the tree."""
        t_draft, calls = 0.0, 0
        roles = sorted({rows[b].tree_role for b in drafting})
        for role in roles:  # one call per baked tree in use (usually one)
            group = [b for b in drafting if rows[b].tree_role == role]
            spec, session = self.rt.manifest.graphs[role], self.rt.tree_sessions[role]
            feats, ids, pos, mask, counts, starts = self._context(rows, group, role)
            feed = {self.feat: feats, C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask,
                    C.ROOT_INDEX: np.maximum(counts - 1, 0)}
            t0 = time.perf_counter()
            o = self._call(role, session, spec, list(TREE_OUTPUTS), feed, starts)
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
                result[b] = (tree, cand)
        return t_draft, calls
