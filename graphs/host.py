"""The host path: sessions on ONNX Runtime, K/V in host memory (numpy), one executor per engine.

:class:`HostModel` is what a decoder loads once (the sessions of an export, the calls that run them
against any K/V); :class:`HostExecutor` is one engine's :class:`graphs.executor.Executor` over it: its
own K/V rows (graphs.slots), the base's and the EAGLE or DFlash drafter's. Several engines share one model
(ONNX Runtime sessions may be run from several threads); each keeps its own executor.
"""

from __future__ import annotations

import numpy as np

from graphs import contract as C
from graphs.eagle_draft import DRAFT_MODES, baked_trees, step_feed
from graphs.errors import InputError
from graphs.executor import HostRows, ModelInfo, select_on_host
from graphs.integrity import recheck
from graphs.kv import inplace_mask
from graphs.schema import check_session, load_graph
from graphs.sessions import BoundArrays, InPlaceRun, LazySession
from graphs.slots import SlotCache, attention_mask, block_mask


class HostModel:
    """The sessions of one export and the graph calls on them (public: tune, benchmarks, tests)."""

    def __init__(self, out_dir, manifest, provider: str, make_session, threads=None, optimization: str = "all",
                 device_id: int = 0, session_options=None, provider_options=None, eagle_draft: str = "auto",
                 verify: bool = True):
        m = self.manifest = manifest
        self.out_dir, self.provider = out_dir, provider
        dtype = m.graphs["base"].output(C.LOGITS).dtype
        if dtype not in ("float32", "float16"):
            raise InputError(
                f"{out_dir} holds {dtype} graphs, which this runtime cannot feed (numpy and ONNX Runtime's "
                f"Python API have no {dtype} arrays); export with --dtype float16 or float32"
            )
        self.dtype = np.dtype(dtype)
        args = (provider, threads, optimization, device_id, session_options, provider_options)

        def session(role):
            spec = m.graphs.get(role)
            if spec is None:
                return None
            sess = load_graph(make_session, out_dir / spec.file, *args)
            check_session(spec, sess, role)  # the file's own inputs/outputs are the manifest's
            return sess

        def late_session(role):  # opened long after the check: the files must still be what it verified
            spec = m.graphs[role]
            rels = [r for r in m.files if r == spec.file or r.startswith(spec.file + ".")]  # (+ external data)
            recheck(out_dir, m.files, m.checked, rels, verify)
            sess = session(role)
            recheck(out_dir, m.files, m.checked, rels, verify)  # (and not swapped while it was read)
            return sess

        self.base_spec = m.graphs["base"]
        self.draft_spec = m.graphs.get("draft")
        # with a one-sequence graph (below) the base runs only batches of trees: made when one comes
        one_sequence = bool(m.one_sequence_file) and C.kv_in_place(self.base_spec) and provider == "cpu"
        self.base = LazySession(lambda: late_session("base")) if one_sequence else session("base")
        self.draft = session("draft")
        if eagle_draft not in DRAFT_MODES:
            raise InputError(f"unknown eagle_draft {eagle_draft!r}; accepted: {', '.join(DRAFT_MODES)}")
        # one-call EAGLE trees (graphs.eagle_draft): a session per baked (topk, depth, total_tokens)
        self.tree_sessions = {} if eagle_draft == "stepwise" else {r: session(r) for r in baked_trees(m).values()}
        self.drafter = m.drafter
        self.kind = m.drafter["kind"] if m.drafter else None
        self.pad = m.generation.get("pad_token_id") or 0
        self._base_outputs = [t.name for t in self.base_spec.outputs]
        # K/V written in place by the graph (exporter.optimize on the CPU): the manifest's spec says so
        self._in_place = InPlaceRun(self.base, self.base_spec) if C.kv_in_place(self.base_spec) else None
        self.kv_layout = C.kv_layout(self.base_spec)  # how the base's K/V buffers are laid out
        # the base's one-sequence graph (exporter.optimize, CPU): the same contract and buffers, each
        # layer's attention one GroupQueryAttention, which reads each row's own length; run for the
        # calls its CPU kernel takes (one token per row, or one sequence), the base for batched trees
        self._one_sequence = None
        if one_sequence:
            sess = load_graph(make_session, out_dir / m.one_sequence_file, *args)
            check_session(self.base_spec, sess, "base")
            self._one_sequence = InPlaceRun(sess, self.base_spec)
            # its rotary tables' length: a call reaching past it (a tree at the very end) runs the base
            self._one_sequence_columns = int(m.one_sequence.get("max_columns", 0))
        # optimize's rows check: where a one-row call rounds otherwise than calls of more rows (MLAS's
        # M == 1 int8 kernel), every one-token call runs as two rows, so all calls share kernels
        self.min_rows = int((m.optimization.get("base") or {}).get("min_rows", 1))
        self._n_layers = m.source["num_layers"]
        limits = [m.source.get("max_position_embeddings"), m.source.get("sliding_window")]
        self.max_positions = int(min([x for x in limits if x] or [1 << 30]))

    def info(self) -> ModelInfo:
        d = self.drafter or {}
        feat = C.AUX_HIDDEN if d.get("eagle3") or self.kind == "dflash" else C.HIDDEN
        dim = self.base_spec.output(feat).dims[-1] if self.kind in ("eagle", "dflash") else 0
        return ModelInfo(self.kind, self.pad, self.manifest.source["vocab_size"], self.max_positions, self.dtype,
                         feat, dim, int(d.get("block_size", 0)), int(d.get("mask_token_id", 0)))

    @property
    def lends_kv(self) -> bool:
        """Every call of one sequence runs the one-sequence graph, whose attention reads each row's own
        length: a K/V cache whose capacity an earlier request left larger may serve the next one."""
        return self._one_sequence is not None and self.min_rows == 1

    def load_sessions(self) -> None:
        if isinstance(self.base, LazySession):
            self.base.get()

    # ------------------------------------------------------------------ base calls on any K/V

    def base_forward(self, kv, ids: np.ndarray, pos: np.ndarray, tree_mask: np.ndarray, rows: slice | None = None
                     ) -> dict:
        """One base forward over S new positions per row: ids, positions (B, S), tree_mask (B, S, S)
        bool, against the columns ``kv`` holds (a :class:`graphs.slots.SlotCache`, rows ``rows`` of it).
        Returns every output by name (``present.*``: K/V of the S)."""
        if ids.shape[1] < self.min_rows:  # a padding row that sees only itself; its outputs are dropped
            return self._padded_forward(kv, ids, pos, tree_mask, rows)
        return self._forward(kv, ids, pos, tree_mask, rows)

    def plain_step(self, kv, roots) -> dict | None:
        """A plain (autoregressive) step of every occupied row of ``kv``: ``roots`` (n,) each at its row's
        length; the outputs (n, 1, ...), valid until the next call. None where the graphs take no bound
        call (K/V not written in place, or one-token calls padded to ``min_rows``): use base_forward."""
        call, _ = self.plain_steps(kv, 1)
        return None if call is None else call.step(roots, kv.lens[: kv.n])

    def plain_steps(self, kv, most: int) -> tuple:
        """``(call, k)``: the bound call of up to ``most`` plain steps in a row and how many it may run
        (K/V room reserved; k stops where the one-sequence graph's positions end, so each step runs on
        the graph a step alone would take). ``(None, 0)`` where :meth:`plain_step` returns None."""
        if self.min_rows != 1:
            return None, 0
        top = kv.top()
        k = max(1, min(int(most), kv.limit - top))
        if self._one_sequence is not None and top + 1 <= self._one_sequence_columns:
            k = min(k, self._one_sequence_columns - top)
        call = self.bound_call(kv, 1, columns=top + k)
        return (None, 0) if call is None else (call, k)

    def verify_trees(self, kv, trees: list, tokens: list) -> dict | None:
        """One verify of every occupied row of ``kv`` on a bound call: row b's tree after its length,
        padded to the widest. None where the graphs take no bound call: use :meth:`base_forward`."""
        width = max(len(t) for t in tokens)
        bound = self.bound_call(kv, width) if width >= self.min_rows else None
        return None if bound is None else bound.trees(trees, tokens, kv.lens[: kv.n], self.pad)

    def bound_call(self, kv, s: int, columns: int | None = None):
        """The :class:`graphs.sessions.BoundCall` of ``s`` new tokens per occupied row of ``kv``, growing
        ``kv`` first (``columns``: to hold that many); None without in-place K/V."""
        if self._in_place is None:
            return None
        columns = kv.top() + s if columns is None else columns
        kv.reserve_columns(columns)
        return self._graph(columns, s, kv.n == 1 and kv.lens[0] > 0).bound_on(kv, s)

    def verify(self, kv, trees: list, tokens: list) -> dict:
        """Row b of ``kv`` verifies ``trees[b]`` with ``tokens[b]`` after its length (:func:`verify_with`)."""
        return verify_with(self, kv, trees, tokens)

    def presents(self, out: dict) -> list | None:
        """The base's ``present.*`` in layer order; None when the graph wrote them in place."""
        if self._in_place is not None:
            return None
        return [out[n] for i in range(self._n_layers) for n in (C.present_key(i), C.present_value(i))]

    def _forward(self, kv, ids, pos, tree_mask, rows) -> dict:
        if self._in_place is not None:
            return self._forward_in_place(kv, ids, pos, tree_mask, rows)
        past = kv.past_mask() if rows is None else kv.past_mask(rows)
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: attention_mask(past, tree_mask)}
        kv_feed = kv.feed() if rows is None else kv.feed(rows)
        return dict(zip(self._base_outputs, self.base.run(self._base_outputs, feed | kv_feed)))

    def _padded_forward(self, kv, ids, pos, tree_mask, rows) -> dict:
        bsz, s = ids.shape
        n = self.min_rows
        ids2 = np.concatenate([ids, np.full((bsz, n - s), self.pad, dtype=ids.dtype)], axis=1)
        pos2 = np.concatenate([pos, np.repeat(pos[:, -1:], n - s, axis=1)], axis=1)
        mask2 = np.broadcast_to(np.eye(n, dtype=bool), (bsz, n, n)).copy()
        mask2[:, :s, :s] = tree_mask
        out = self._forward(kv, ids2, pos2, mask2, rows)
        # the S real rows (a K/V buffer written in place keeps the padding row past them: never attended)
        return {k: (v[:, :, :s] if k.startswith("present.") else v[:, :s]) for k, v in out.items()}

    def _forward_in_place(self, kv, ids, pos, tree_mask, rows) -> dict:
        """The base writes row b's S new rows into ``kv`` at its next write column; the outputs hold
        no ``present.*`` (the caches' ``commit`` then takes None: the rows are in place)."""
        s = ids.shape[1]
        starts = kv.write_columns(rows)
        kv.reserve_columns(int(starts.max(initial=0)) + s)
        past = kv.past_mask() if rows is None else kv.past_mask(rows)  # (B, capacity), after the growth
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: inplace_mask(past, starts, tree_mask),
                C.KV_WRITE: starts}
        bsz = ids.shape[0]
        one = bsz == 1 and (starts[0] > 0 or (np.array_equal(pos[0], np.arange(s))
                                               and np.array_equal(tree_mask[0], np.tri(s, dtype=bool))))
        return self._graph(int(starts.max(initial=0)) + s, s, one).run_on(kv, feed, rows)

    def _graph(self, columns: int, s: int, one_sequence: bool) -> InPlaceRun:
        """The one-sequence graph for calls its kernel computes as asked (one token per row, or one
        sequence after a past or its causal prefill) within its rotary tables; the base otherwise."""
        one = self._one_sequence
        if one is not None and columns <= self._one_sequence_columns and (s == 1 or one_sequence):
            return one
        return self._in_place


def verify_with(model, kv, trees: list, tokens: list) -> dict:
    """``model.verify_trees``, or where the graphs take no bound call the same inputs made for this call
    and run through ``model.base_forward``: every decode step's verify (the engine's, the tuner's)."""
    out = model.verify_trees(kv, trees, tokens)
    if out is not None:
        return out
    n, width = len(tokens), max(len(t) for t in tokens)
    ids = np.full((n, width), model.pad, dtype=np.int64)
    depth = np.zeros((n, width), dtype=np.int64)
    tmask = np.broadcast_to(np.eye(width, dtype=bool), (n, width, width)).copy()
    for b, (tree, cand) in enumerate(zip(trees, tokens)):
        k = len(cand)
        ids[b, :k], depth[b, :k], tmask[b, :k, :k] = cand, tree.depth, tree.mask
    return model.base_forward(kv, ids, kv.lens[:n, None] + depth, tmask)


class HostExecutor(HostRows):
    """One engine's :class:`graphs.executor.Executor` on a :class:`HostModel`: its K/V rows in host memory."""

    def __init__(self, model: HostModel, slots: int, max_len: int, headroom: int, kv: SlotCache | None = None):
        """``kv``: an idle cache of an earlier engine to reuse (its buffers, capacity and bindings),
        taken where it fits (as many rows, none occupied, a capacity within this budget)."""
        self.model = m = model
        self.info = m.info()
        src = m.manifest.source
        limit = max_len + headroom  # the columns a row may ever have: max_len and one tree
        if not (kv is not None and kv.slots == slots and kv.n == 0 and kv.temp == 0 and kv.capacity <= limit
                and kv.layout == m.kv_layout and kv.dtype == m.dtype and kv.num_layers == src["num_layers"]):
            kv = SlotCache(src["num_layers"], slots, src["num_kv_heads"], src["head_dim"], m.dtype, max_len,
                           headroom=headroom, layout=m.kv_layout)
        kv.limit = limit
        self.kv = kv
        self.draft_kv = None
        self._draft_in_place: dict = {}
        if m.kind in ("eagle", "dflash"):  # the drafter's own K/V: one row per request
            d = m.drafter
            self.draft_kv = SlotCache(d["num_layers"], slots, d["num_kv_heads"], d["head_dim"], m.dtype, max_len,
                                      headroom=headroom)
            # drafter graphs that write its K/V in place (optimized for the CPU): bound per graph
            graphs = [("draft", m.draft, m.draft_spec)] + [(r, s, m.manifest.graphs[r])
                                                          for r, s in m.tree_sessions.items()]
            self._draft_in_place = {r: InPlaceRun(s, spec) for r, s, spec in graphs if C.kv_in_place(spec)}
        self._heads: dict = {}  # Medusa: (drafting rows, top-k) -> the heads' bound call
        self._presents = None  # the last verify's K/V where the graph did not write it in place

    # ------------------------------------------------------------------ rows
    def memory(self) -> dict:
        got = {"kv_budget_bytes": self.kv.budget_bytes, "kv_allocated_bytes": self.kv.allocated_bytes}
        if self.draft_kv is not None:
            got |= {"drafter_kv_budget_bytes": self.draft_kv.budget_bytes,
                    "drafter_kv_allocated_bytes": self.draft_kv.allocated_bytes}
        return got

    # ------------------------------------------------------------------ base
    def prefill(self, first: int, ids, pos, mask) -> dict:
        out = self.model.base_forward(self.kv, ids, pos, mask, rows=slice(first, first + ids.shape[0]))
        self._presents = self.model.presents(out)
        return out

    def verify(self, trees: list, tokens: list) -> dict:
        out = self.model.verify(self.kv, trees, tokens)
        self._presents = self.model.presents(out)
        return out

    def select(self, out: dict, picks: list) -> list:
        return select_on_host(out[C.LOGITS], picks)

    def commit(self, idx: np.ndarray, counts: np.ndarray, first: int = 0) -> None:
        presents, self._presents = self._presents, None
        self.kv.commit(presents, idx, counts, first=first)

    def plain_run(self, most: int):
        call, k = self.model.plain_steps(self.kv, most)
        return None if call is None else _BoundRun(call, k, self.kv.lens[: self.kv.n])

    def keep_new(self, counts) -> None:
        self.kv.keep_new(counts)

    # ------------------------------------------------------------------ drafter
    def draft_heads(self, hidden: list, k: int) -> np.ndarray:
        """Medusa: the heads' top-``k`` ids (D, 1, heads, k) over ``hidden`` (D rows of (H,))."""
        m = self.model
        if m.provider != "cpu":  # (host arrays bound to a CUDA session: untested here; run() is)
            feed = {C.HIDDEN: np.stack(hidden)[:, None], C.TOPK_IN: np.array([k], dtype=np.int64)}
            return m.draft.run([C.TOPK_IDS], feed)[0]
        d = len(hidden)
        call = self._heads.get((d, k))
        if call is None:
            if len(self._heads) >= 16:  # a memory, not a log (a batch's drafting rows vary)
                self._heads.clear()
            h_in, ids_out = m.draft_spec.input(C.HIDDEN), m.draft_spec.output(C.TOPK_IDS)
            call = BoundArrays(m.draft, {C.HIDDEN: ((d, 1, h_in.dims[2]), h_in.dtype), C.TOPK_IN: ((1,), np.int64)},
                               {C.TOPK_IDS: ((d, 1, ids_out.dims[2], k), ids_out.dtype)})
            call.inputs[C.TOPK_IN][:] = k
            self._heads[(d, k)] = call
        rows = call.inputs[C.HIDDEN]  # (D, 1, H)
        for j, h in enumerate(hidden):
            rows[j, 0] = h
        return call.run()[C.TOPK_IDS]

    def draft_in_place(self, role: str) -> bool:
        return role in self._draft_in_place

    def draft_step(self, feats, ids, pos, mask, topk: int, rows: slice | None = None, is_aux: bool = False,
                   starts: np.ndarray | None = None) -> dict:
        """One EAGLE drafter forward over ``rows`` of ``draft_kv`` (default: every occupied row): the
        base's features (``is_aux``: EAGLE-3 layers) or the drafter's own hidden, with ``mask`` for
        new rows going to columns ``starts``. ``present.*`` come back where not written in place."""
        m = self.model
        feed = step_feed(m, feats, ids, pos, mask, topk, is_aux)
        return self._draft_call("draft", m.draft, m.draft_spec, [C.HIDDEN_OUT, C.TOPK_IDS, C.TOPK_LOGPROBS], feed,
                                starts, rows)

    def draft_tree(self, role: str, feed: dict, starts: np.ndarray) -> dict:
        """One call of a baked EAGLE tree graph (graphs.eagle_draft): context rows in, the tree out."""
        m = self.model
        return self._draft_call(role, m.tree_sessions[role], m.manifest.graphs[role], list(TREE_OUTPUTS), feed,
                                starts)

    def draft_block(self, feats, ctx_pos, ids, pos, past, new, topk: int, starts: np.ndarray) -> dict:
        """One DFlash drafter call over every occupied row of ``draft_kv`` (graphs.executor.Executor)."""
        m = self.model
        s = ids.shape[1]
        in_place = self.draft_in_place("draft")
        feed = {C.AUX_HIDDEN: feats, C.CONTEXT_POSITION_IDS: ctx_pos, C.INPUT_IDS: ids, C.POSITION_IDS: pos,
                C.ATTENTION_MASK: block_mask(past, new, s, starts if in_place else None),
                C.TOPK_IN: np.array([topk], dtype=np.int64)}
        return self._draft_call("draft", m.draft, m.draft_spec, [C.TOPK_IDS, C.TOPK_LOGPROBS], feed, starts)

    def _draft_call(self, role, session, spec, names, feed, starts, rows=None) -> dict:
        run = self._draft_in_place.get(role)
        if run is None:
            names = names + [t.name for t in spec.outputs if t.name.startswith("present.")]
            return dict(zip(names, session.run(names, feed | self.draft_kv.feed(rows))))
        return run.run_on(self.draft_kv, feed | {C.KV_WRITE: np.asarray(starts, dtype=np.int64)}, rows)


TREE_OUTPUTS = [C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_SCORES, C.TREE_MASK]


class _BoundRun:
    """:class:`graphs.executor.PlainRun` on a bound call (graphs.sessions.BoundCall)."""

    def __init__(self, call, steps: int, lens: np.ndarray):
        self.call, self.steps, self.lens = call, steps, lens
        self.outputs = call.outputs
        self.again, self.greedy = call.again, call.greedy  # the bound call's own: no frame of ours a step

    def step(self, roots) -> dict:
        return self.call.step(roots, self.lens)

    def feed(self, tokens) -> None:
        self.call.ids[:, 0] = tokens
