"""The device path: K/V and logits stay on the session's device; only a few small arrays come back.

:class:`DeviceModel` holds what a decoder loads once for it (the base's sessions, the chosen attention
form's, and the small graphs ``exporter.optimize`` builds beside a base that writes K/V in place,
listed in the manifest: ``device.select``, ``device.kv_compact``, ``device.kv_copy``, ``device.rows``,
``device.sample``; ``device.draft_kv_copy`` beside an EAGLE / DFlash drafter);
:class:`DeviceExecutor` is one engine's :class:`graphs.executor.Executor` on it::

    K/V        per layer one K and one V buffer, an OrtValue on the device (slots rows, capacity columns)
               bound in place by pointer: a call over rows r0..r1 binds that part of each buffer
    verify     the base writes each row's tree at the row's own column (TensorScatter); its logits and
               features are OrtValues on the device; device.select runs right after it: argmax and
               "non-finite" per node come back (B x S x 9 bytes), the acceptance walk runs on the host
    commit     device.kv_compact: the accepted nodes of every row moved down in every buffer, one call
    rows       device.kv_copy: growth (old buffers into larger, zero-padded ones), a row moved into a
               freed one (pads 0, bound to the two rows' memory)
    features   device.rows: the rows the host asks for (Medusa's hidden state at the last accepted
               node, EAGLE's / DFlash's features of the accepted nodes, a prefill's last logits)
               and nothing else
    drafter    EAGLE-1 / EAGLE-3 (step-wise, one-call trees) and DFlash: the drafter's K/V
               (:class:`DeviceDraftKV`, ``draft_kv``) OrtValues its graphs write in place; its
               commits move only lengths; device.draft_kv_copy grows it and moves a freed row.
               Its top-k (and step-wise its hidden output) come back, its logits stay

The same code runs on the CPU EP (OrtValues on the CPU device: ``graphs.load(out, provider="cpu",
device_resident=True)``) and on CUDA. Every byte an output brings to the host is counted in
``host_bytes`` (host-bound outputs, the rows fetched); nothing calls ``OrtValue.numpy`` or
``IOBinding.copy_outputs_to_cpu``.

Not yet on the device: Medusa's typical acceptance brings its tree's logits rows back (graphs.sampling
on the host, as the host path); the drafter's inputs are host arrays copied in (features fetched by
device.rows for the accepted nodes only).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from graphs import contract as C
from graphs.eagle_draft import step_feed
from graphs.errors import InputError, NonFiniteLogitsError
from graphs.executor import ModelInfo
from graphs.kv import inplace_mask
from graphs.sampling import check_finite, draw_excluding, greedy_walk, process_logits, sample_walk
from graphs.schema import check_session, load_graph
from graphs.slots import block_mask

_BOUND = 16  # bound calls kept per executor (shapes: rows x width); made again in ~0.1 ms when needed
_KEEP_WIDTH = 64  # calls of at most this many new tokens a row are kept (trees, plain steps, short chunks)


def _fix_message(out_dir, why: str) -> str:
    return (f"{out_dir}: the device path needs the graphs `python -m exporter.optimize` builds beside a base "
            f"that writes its K/V in place ({why}); optimize the export again with this version: "
            f"python -m exporter.optimize {out_dir}")


class DeviceModel:
    """The device path's sessions of one export, over the host model's (graphs.host.HostModel)."""

    def __init__(self, model, make_session, args: tuple, device_id: int = 0):
        m = self.manifest = model.manifest
        self.model, self.out_dir = model, model.out_dir
        self.device = "cuda" if model.provider == "cuda" else "cpu"
        self.device_id = device_id if self.device == "cuda" else 0
        base = model.base_spec
        missing = [r for r in C.DEVICE_ROLES if r not in m.graphs]
        if not C.kv_in_place(base):
            raise InputError(_fix_message(self.out_dir, "its base concatenates K/V"))
        if missing:
            raise InputError(_fix_message(self.out_dir, f"it lists no {', '.join(missing)}"))
        if model.kind not in (None, "medusa", "eagle", "dflash"):
            raise InputError(f"{self.out_dir}: the device path runs the base, Medusa, EAGLE and DFlash drafters; "
                             f"a {model.kind} export decodes on the host path (device_resident=False)")
        if model.kind in ("eagle", "dflash"):  # the drafter's graphs write its K/V in place; its buffers' copy graph
            drafter = [("draft", model.draft_spec)] + [(r, m.graphs[r]) for r in model.tree_sessions]
            if not all(C.kv_in_place(spec) for _, spec in drafter):
                raise InputError(_fix_message(self.out_dir, "its drafter concatenates K/V"))
            if C.DRAFT_COPY_ROLE not in m.graphs:
                raise InputError(_fix_message(self.out_dir, f"it lists no {C.DRAFT_COPY_ROLE}"))
        if model.min_rows != 1:
            raise InputError(f"{self.out_dir}: the optimize rows check asks for calls of at least {model.min_rows} "
                             f"rows, which the device path does not pad yet; use device_resident=False")
        self.sessions = {}
        for role in C.DEVICE_ROLES:
            spec = m.graphs[role]
            sess = load_graph(make_session, self.out_dir / spec.file, *args)
            check_session(spec, sess, role)
            self.sessions[role] = sess
        if model.kind in ("eagle", "dflash"):
            spec = m.graphs[C.DRAFT_COPY_ROLE]
            sess = load_graph(make_session, self.out_dir / spec.file, *args)
            check_session(spec, sess, C.DRAFT_COPY_ROLE)
            self.sessions[C.DRAFT_COPY_ROLE] = sess
        self.dtype = model.dtype
        self.kv_dims = C.kv_layout(base)  # "bsh" | "bhsd"
        src = m.source
        self.num_layers, self.kv_heads, self.head_dim = src["num_layers"], src["num_kv_heads"], src["head_dim"]
        self.names = [n for i in range(self.num_layers) for n in (C.past_key(i), C.past_value(i))]
        self.outputs = [(t.name, np.dtype(t.dtype), tuple(t.dims[2:])) for t in base.outputs
                        if not t.name.startswith("present.")]
        # the base's forms (docs/optimize.md): on the CPU the host model's choice (the one-sequence
        # GroupQueryAttention graph for one-token steps and one sequence, the base for batched trees); on
        # CUDA the form the optimize stage chose (attention: the base for every call; gqa: the
        # one-sequence graph for those calls, batched trees staying on the ONNX Attention form)
        self.one, self.one_columns = None, 0
        if model._one_sequence is not None:
            self.one, self.one_columns = model._one_sequence.session, model._one_sequence_columns
        elif self.device == "cuda" and m.attention_form == "gqa" and m.one_sequence_file:
            self.one = load_graph(make_session, self.out_dir / m.one_sequence_file, *args)
            check_session(base, self.one, "base")
            self.one_columns = int(m.one_sequence.get("max_columns", 0)) or (1 << 30)

    def base_session(self, columns: int, s: int, one_sequence: bool):
        if self.one is not None and columns <= self.one_columns and (s == 1 or one_sequence):
            return self.one
        return self.model.base

    def info(self) -> ModelInfo:
        return self.model.info()


class _Growing:
    """Device K/V buffers (``buffers``, ``capacity`` columns a row) that grow in place of a copy to the
    host: the base's (:class:`DeviceExecutor`) and the drafter's (:class:`DeviceDraftKV`); each gives
    ``_shape``, ``_alloc``, ``_copy`` (its copy graph), ``_grown`` (after new buffers) and ``slots``, ``limit``,
    ``bucket``, ``_hold``, and ``bytes_per_column``."""

    @property
    def budget_bytes(self) -> int:
        return self.bytes_per_column * self.limit

    @property
    def allocated_bytes(self) -> int:
        return self.bytes_per_column * self.capacity

    def reserve(self, columns: int) -> None:
        """Every row able to hold ``columns`` columns: larger buffers (by an eighth at least, up to the
        budget), the old ones copied into them on the device (the copy graph, zero-padded)."""
        if columns <= self.capacity:
            return
        if columns > self.limit:
            raise ValueError(f"{type(self).__name__}: {columns} columns exceed the budget of {self.limit}")
        cap = min(max(-(-columns // self.bucket) * self.bucket, self.capacity + self.capacity // 8), self.limit)
        old, old_cap, hold = self.buffers, self.capacity, self._hold
        new = self._alloc(cap)
        if old and old_cap:
            rank = len(self._shape(1, 1))
            pads = [0] * (2 * rank)
            pads[rank + rank - 2] = cap - old_cap  # the end of the column axis (rank - 2)
            self._copy(old, 0, new, 0, self.slots, old_cap, cap, pads)
        del hold
        self.buffers, self.capacity = new, cap
        self._grown()


class DeviceExecutor(_Growing):
    """One engine's :class:`graphs.executor.Executor` with its K/V on the device (see the module)."""

    def __init__(self, model: DeviceModel, slots: int, max_len: int, headroom: int):
        self.dm = dm = model
        self.info = dm.info()
        self.slots, self.limit = slots, max_len + headroom
        self.dev, self.dev_id = dm.device, dm.device_id
        self.n, self.temp, self.capacity, self.generation = 0, 0, 0, 0
        self.lens = np.zeros(slots, dtype=np.int64)
        self.bucket = 64
        self.buffers: list = []  # 2 x layers OrtValues (slots, capacity, D) or (slots, kv, capacity, hd)
        self._hold: list = []  # host arrays an OrtValue on the CPU device shares memory with
        self._calls: dict = {}  # (session, first, rows, width, generation) -> _BaseCall
        self._rows_calls: dict = {}  # (output, rows, features, k) -> _Bound of device.rows
        self._heads: dict = {}  # Medusa: (drafting rows, top-k) -> the heads' _Bound
        self.draft_kv = None
        m = dm.model
        if m.kind in ("eagle", "dflash"):  # the drafter's own K/V on the device, one row per request
            d = m.drafter
            self.draft_kv = DeviceDraftKV(self, d["num_layers"], d["num_kv_heads"], d["head_dim"],
                                          C.kv_layout(m.draft_spec))
        self.host_bytes = 0  # every byte brought to the host by an output (counted where it is bound)
        self.itemsize = np.dtype(dm.dtype).itemsize

    # ------------------------------------------------------------------ the K/V buffers
    @property
    def kv(self):  # (the engine's `kv`: what its decoder reads of an idle cache; this executor lends none)
        return self

    @property
    def rows(self) -> int:
        return self.n

    def _shape(self, rows: int, cap: int) -> tuple:
        dm = self.dm
        if dm.kv_dims == "bsh":
            return (rows, cap, dm.kv_heads * dm.head_dim)
        return (rows, dm.kv_heads, cap, dm.head_dim)

    @property
    def bytes_per_column(self) -> int:
        return 2 * self.dm.num_layers * self.slots * self.dm.kv_heads * self.dm.head_dim * self.itemsize

    def memory(self) -> dict:
        got = {"kv_budget_bytes": self.budget_bytes, "kv_allocated_bytes": self.allocated_bytes}
        if self.draft_kv is not None:
            got |= {"drafter_kv_budget_bytes": self.draft_kv.budget_bytes,
                    "drafter_kv_allocated_bytes": self.draft_kv.allocated_bytes}
        return got

    def _alloc(self, cap: int) -> list:
        shape = self._shape(self.slots, cap)
        if self.dev == "cpu" or not self.buffers:  # zeros (masked columns are still multiplied by 0 weights)
            zeros = [np.zeros(shape, dtype=self.dm.dtype) for _ in self.dm.names]
            if self.dev == "cpu":
                self._hold = zeros
            return [ort.OrtValue.ortvalue_from_numpy(z, self.dev, self.dev_id) for z in zeros]
        # on the device a growth's Pad writes every element of the new buffers
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dm.dtype, self.dev, self.dev_id)
                for _ in self.dm.names]

    def _grown(self) -> None:  # new buffers: the bound calls point at the old ones
        self.generation += 1
        self._calls.clear()

    def _view(self, value, first: int, rows: int, cap: int | None = None) -> tuple:
        """(pointer, shape) of rows first .. first + rows of a buffer of capacity ``cap``."""
        shape = self._shape(rows, self.capacity if cap is None else cap)
        stride = int(np.prod(shape[1:])) * self.itemsize
        return value.data_ptr() + first * stride, shape

    def _bind_kv(self, io, first: int, rows: int, names_in, names_out, buffers=None, cap=None) -> None:
        for value, nin, nout in zip(buffers or self.buffers, names_in, names_out):
            ptr, shape = self._view(value, first, rows, cap)
            if nin:
                io.bind_input(nin, self.dev, self.dev_id, self.dm.dtype, shape, ptr)
            if nout:
                io.bind_output(nout, self.dev, self.dev_id, self.dm.dtype, shape, ptr)

    def _copy(self, src: list, r_src: int, dst: list, r_dst: int, rows: int, cap_src: int, cap_dst: int,
              pads: list) -> None:
        sess = self.dm.sessions[C.COPY_ROLE]
        io = sess.io_binding()
        n = len(self.dm.names)
        pad_arr = np.asarray(pads, dtype=np.int64)
        io.bind_cpu_input(C.PADS, pad_arr)
        self._bind_kv(io, r_src, rows, [C.cache_in(j) for j in range(n)], [None] * n, src, cap_src)
        self._bind_kv(io, r_dst, rows, [None] * n, [C.cache_out(j) for j in range(n)], dst, cap_dst)
        sess.run_with_iobinding(io)

    def shrink(self, keep_base: bool = False) -> None:
        if self.n == 0 and self.capacity and not keep_base:
            self.buffers, self._hold, self.capacity = [], [], 0
            self.generation += 1
            self._calls.clear()
        if self.draft_kv is not None:
            self.draft_kv.shrink()

    def add_row(self) -> int:
        if self.n >= self.slots:
            raise ValueError("DeviceExecutor: no free row")
        if self.draft_kv is not None:
            self.draft_kv.add_row()
        b = self.n
        self.lens[b] = 0
        self.n += 1
        return b

    def remove_row(self, b: int) -> None:
        """Free row ``b``: the last occupied row moves into it on the device (device.kv_copy, one call)."""
        last = self.n - 1
        self.n -= 1
        if b != last:
            if self.lens[last]:
                self._copy(self.buffers, last, self.buffers, b, 1, self.capacity, self.capacity,
                           [0] * (2 * len(self._shape(1, 1))))
            self.lens[b] = self.lens[last]
        self.lens[last] = 0
        self._calls = {k: v for k, v in self._calls.items() if k[1] + k[2] <= self.n}  # (first, rows, ...)
        if self.draft_kv is not None:
            self.draft_kv.remove_row(b)

    def past_mask(self, rows: slice | None = None) -> np.ndarray:
        rows = rows or slice(0, self.n)
        return np.arange(self.capacity)[None, :] < self.lens[rows][:, None]

    def top(self) -> int:
        return int(self.lens[: self.n].max(initial=0))

    # ------------------------------------------------------------------ base calls
    def _call(self, first: int, rows: int, s: int, columns: int, one_sequence: bool) -> _BaseCall:
        """The bound call of ``s`` new tokens for rows first .. first + rows, kept for the next step
        where ``s`` is a step's width (a prompt chunk's, whose outputs hold rows x S x vocabulary
        logits, is made for its call alone)."""
        self.reserve(columns)
        sess = self.dm.base_session(columns, s, one_sequence)
        key = (id(sess), first, rows, s, self.generation)
        call = self._calls.pop(key, None)
        if call is None:
            call = _BaseCall(self, sess, first, rows, s)
        if s <= _KEEP_WIDTH:
            self._keep(key, call)  # the most recently used last
        return call

    def prefill(self, first: int, ids, pos, mask) -> dict:
        bsz, s = ids.shape
        rows = slice(first, first + bsz)
        starts = self.lens[rows].copy()
        top = int(starts.max(initial=0)) + s
        one = bsz == 1 and (starts[0] > 0 or (np.array_equal(pos[0], np.arange(s))
                                               and np.array_equal(mask[0], np.tri(s, dtype=bool))))
        call = self._call(first, bsz, s, top, one)
        call.ids[:] = ids
        call.pos[:] = pos
        call.write[:] = starts
        call.mask[:] = inplace_mask(self.past_mask(rows), starts, mask)
        return call.run(select=False)

    def verify(self, trees: list, tokens: list) -> dict:
        n, width = len(tokens), max(len(t) for t in tokens)
        lens = self.lens[:n]
        call = self._call(0, n, width, self.top() + width, n == 1 and lens[0] > 0)
        call.fill_trees(trees, tokens, lens, self.info.pad)
        return call.run(select=True)

    def select(self, out: dict, picks: list) -> list:
        """Each row's walk on the host over what the selection graphs bring back: greedy rows over the
        argmax; sampled rows (lossless acceptance) over each node's probabilities of the tree's tokens
        and a few draws from each node (device.sample, the request's own uniforms). Medusa's typical
        acceptance brings its tree's logits rows back (graphs.sampling on the host, as the host path)."""
        best, bad = out.argmax, out.nonfinite
        on_device = best is not None
        sampled = [b for b, pick in enumerate(picks) if on_device and pick is not None and pick[0].temperature > 0
                   and pick[0].acceptance != "typical"]
        drawn = out.call.sample(picks, sampled) if sampled else None
        got = []
        for b, pick in enumerate(picks):
            if pick is None:
                got.append(None)
                continue
            sampler, tree, tokens = pick
            try:
                if sampler.temperature == 0 and on_device:
                    accepted, t = greedy_walk(tree, tokens, best[b, : tree.size].tolist())
                    if bad[b, accepted].any():
                        check_finite(float("nan"))
                    got.append((accepted, t))
                elif drawn is not None and b in sampled:
                    if bad[b, : tree.size].any():  # (process_logits checks every node of the tree)
                        check_finite(float("nan"))
                    got.append(self._sampled_walk(out, b, sampler, tree, np.asarray(tokens), *drawn))
                else:
                    got.append(sampler.accept(tree, tokens, out[C.LOGITS][b, list(range(tree.size))]))
            except Exception as e:  # this request's own: the engine ends it alone
                got.append(e)
        return got

    def _sampled_walk(self, out, b: int, sampler, tree, tokens, node_probs, draws):
        """graphs.sampling.sample_walk over row b's selection: p_n(child) from node_probs, the bonus the
        first draw from p_n not rejected (i.i.d. draws from p_n kept when outside ``rejected`` are draws
        from p_n with those zeroed: the residual sample_accept draws from). Where every draw was
        rejected (or rounding ran out of mass), the node's logits row comes back and the host draws."""
        vocab = self.info.vocab
        probs, ds = node_probs[b], draws[b]

        def draw(n, rejected):
            for d in ds[n].tolist():
                if d >= vocab:
                    break
                if d not in rejected:
                    return d
            p = process_logits(out[C.LOGITS][b, n], sampler.temperature, sampler.top_p, sampler.top_k)
            return draw_excluding(p, rejected, sampler.rng)

        return sample_walk(tree, tokens, sampler.rng, lambda n: 1.0, lambda n, c: float(probs[n, c]), draw)

    def commit(self, idx: np.ndarray, counts: np.ndarray, first: int = 0) -> None:
        """Row ``first + b`` keeps nodes ``idx[b, :counts[b]]`` (written at its length): the ones not in
        place already move down in every buffer in one call of device.kv_compact."""
        counts = np.asarray(counts, dtype=np.int64)
        bsz, a = idx.shape
        rows = slice(first, first + bsz)
        j = np.arange(a)[None, :]
        keep = j < counts[:, None]
        src = np.where(keep, idx, j)  # (B, A): padding columns move onto themselves
        if (src != j).any():
            call = self._compact_call(first, bsz, a)
            lens = self.lens[rows]
            np.add(lens[:, None], src, out=call.inputs[C.SRC_COLUMNS])
            call.inputs[C.KV_WRITE][:] = lens
            call.run()
        self.lens[rows] += counts

    def _compact_call(self, first: int, bsz: int, a: int) -> _Bound:
        key = ("compact", first, bsz, a, self.generation)
        call = self._calls.get(key)
        if call is None:
            n = len(self.dm.names)
            call = _Bound(self.dm.sessions[C.COMPACT_ROLE], {C.SRC_COLUMNS: ((bsz, a), np.int64),
                                                            C.KV_WRITE: ((bsz,), np.int64)}, {})
            self._bind_kv(call.io, first, bsz, [C.cache_in(i) for i in range(n)], [C.cache_out(i) for i in range(n)])
            self._keep(key, call)
        return call

    def _keep(self, key, call) -> None:
        if len(self._calls) >= _BOUND:
            self._calls.pop(next(iter(self._calls)))
        self._calls[key] = call

    def keep_new(self, counts, first: int = 0) -> None:
        self.lens[first : first + len(counts)] += counts

    def plain_run(self, most: int):
        top = self.top()
        k = max(1, min(int(most), self.limit - top))
        one = self.dm.one
        if one is not None and top + 1 <= self.dm.one_columns:
            k = min(k, self.dm.one_columns - top)
        call = self._call(0, self.n, 1, top + k, False)
        return _PlainRun(call, k, self.lens[: self.n])

    # ------------------------------------------------------------------ drafter (Medusa)
    def draft_heads(self, hidden: list, k: int) -> np.ndarray:
        """Medusa: the heads' top-``k`` ids (D, 1, heads, k) over ``hidden`` (D rows of (H,)): the heads'
        logits stay in the session; only the ids come back."""
        m = self.dm.model
        d = len(hidden)
        key = ("heads", d, k)
        call = self._heads.get(key)
        if call is None:
            if len(self._heads) >= _BOUND:
                self._heads.clear()
            h_in, ids_out = m.draft_spec.input(C.HIDDEN), m.draft_spec.output(C.TOPK_IDS)
            call = _Bound(m.draft, {C.HIDDEN: ((d, 1, h_in.dims[2]), h_in.dtype), C.TOPK_IN: ((1,), np.int64)},
                          {C.TOPK_IDS: ((d, 1, ids_out.dims[2], k), ids_out.dtype)})
            call.inputs[C.TOPK_IN][:] = k
            self._heads[key] = call
        rows = call.inputs[C.HIDDEN]
        for j, h in enumerate(hidden):
            rows[j, 0] = h
        ids = call.run()[C.TOPK_IDS]
        self.host_bytes += ids.nbytes
        return ids

    # ------------------------------------------------------------------ drafters with K/V (EAGLE, DFlash)
    def draft_in_place(self, role: str) -> bool:
        return self.draft_kv is not None  # (every drafter graph writes its K/V in place: checked at load)

    def draft_step(self, feats, ids, pos, mask, topk: int, rows: slice | None = None, is_aux: bool = False,
                   starts: np.ndarray | None = None) -> dict:
        """One EAGLE drafter forward over ``rows`` of ``draft_kv`` (default: every occupied row), its
        K/V written in place on the device; ``hidden_states_out`` and the top-k come back (counted)."""
        m = self.dm.model
        feed = step_feed(m, feats, ids, pos, mask, topk, is_aux)
        return self._draft_run(m.draft, m.draft_spec, feed, starts, rows, (C.HIDDEN_OUT, C.TOPK_IDS, C.TOPK_LOGPROBS),
                               topk)

    def draft_tree(self, role: str, feed: dict, starts: np.ndarray) -> dict:
        """One call of a baked EAGLE tree graph (graphs.eagle_draft) on the drafter's device K/V: the
        tree's few small outputs come back."""
        m = self.dm.model
        spec = m.manifest.graphs[role]
        names = tuple(t.name for t in spec.outputs if not t.name.startswith("present."))
        return self._draft_run(m.tree_sessions[role], spec, dict(feed), starts, None, names, 0)

    def draft_block(self, feats, ctx_pos, ids, pos, past, new, topk: int, starts: np.ndarray) -> dict:
        """One DFlash drafter call over every occupied row of ``draft_kv`` (graphs.executor.Executor): the
        new context rows written in place at ``starts`` on the device; the block's top-k come back."""
        m = self.dm.model
        feed = {C.AUX_HIDDEN: feats, C.CONTEXT_POSITION_IDS: ctx_pos, C.INPUT_IDS: ids, C.POSITION_IDS: pos,
                C.ATTENTION_MASK: block_mask(past, new, ids.shape[1], starts),
                C.TOPK_IN: np.array([topk], dtype=np.int64)}
        return self._draft_run(m.draft, m.draft_spec, feed, starts, None, (C.TOPK_IDS, C.TOPK_LOGPROBS), topk)

    def _draft_run(self, session, spec, feed: dict, starts, rows: slice | None, wanted: tuple, topk: int) -> dict:
        """A drafter graph over ``rows`` of ``draft_kv``: host inputs copied in, each layer's K/V bound to
        the rows' part of the device buffers (written in place at ``starts``), the ``wanted`` outputs
        brought back into host arrays (counted in ``host_bytes``), the others left on the device."""
        kv = self.draft_kv
        rows = rows or slice(0, kv.n)
        bsz = rows.stop - rows.start
        s = feed[C.INPUT_IDS].shape[1]
        feed[C.KV_WRITE] = np.asarray(starts, dtype=np.int64)
        io = session.io_binding()
        held = []
        for name, arr in feed.items():
            arr = np.ascontiguousarray(arr)
            held.append(arr)
            io.bind_cpu_input(name, arr)
        kv.bind(io, rows.start, bsz)
        aux = feed.get(C.AUX_HIDDEN)
        sizes = {C.BATCH: bsz, C.SEQ: s, C.TOPK: topk, C.BLOCK_DRAFTS: s - 1,
                 C.AUX_SEQ: 0 if aux is None else aux.shape[1]}
        got = {}
        for t in spec.outputs:
            if t.name.startswith("present."):
                continue
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.dims)
            if t.name in wanted:
                arr = got[t.name] = np.empty(shape, dtype=t.dtype)
                io.bind_output(t.name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            else:  # (the drafter's logits: read by nothing on the host)
                io.bind_ortvalue_output(t.name, ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, np.dtype(t.dtype), self.dev, self.dev_id))
        session.run_with_iobinding(io)
        self.host_bytes += sum(a.nbytes for a in got.values())
        del held
        return got

    # ------------------------------------------------------------------ rows back to the host
    def fetch(self, value, shape: tuple, index: list) -> np.ndarray:
        """Rows ``index`` (flat over the first two axes) of an output (B, S, F) on the device."""
        b, s, f = shape[0], shape[1], int(np.prod(shape[2:]))
        key = (value.data_ptr(), b * s, f, len(index))
        call = self._rows_calls.get(key)
        if call is None:
            if len(self._rows_calls) >= _BOUND:
                self._rows_calls.pop(next(iter(self._rows_calls)))
            call = _Bound(self.dm.sessions[C.ROWS_ROLE], {C.ROW_INDEX: ((len(index),), np.int64)},
                          {C.ROWS_OUT: ((len(index), f), self.dm.dtype)})
            call.io.bind_input(C.ROWS_IN, self.dev, self.dev_id, self.dm.dtype, (b * s, f), value.data_ptr())
            call.value = value  # (alive while bound)
            if s <= _KEEP_WIDTH:  # (a prompt chunk's outputs are not kept alive by a binding)
                self._rows_calls[key] = call
        call.inputs[C.ROW_INDEX][:] = index
        out = call.run()[C.ROWS_OUT]
        self.host_bytes += out.nbytes
        return out.reshape(len(index), *shape[2:]).copy()


class _Bound:
    """A small graph's call bound once: host arrays by pointer (``inputs``, ``outputs``: refilled by
    each call; on a device ONNX Runtime copies them in and out), device buffers bound by the caller."""

    def __init__(self, session, inputs: dict, outputs: dict):
        self.session = session
        self.io = io = session.io_binding()
        self.inputs = {k: np.zeros(shape, dtype=dt) for k, (shape, dt) in inputs.items()}
        self.outputs = {k: np.zeros(shape, dtype=dt) for k, (shape, dt) in outputs.items()}
        for name, arr in self.inputs.items():
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        for name, arr in self.outputs.items():
            io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)

    def run(self) -> dict:
        self.session.run_with_iobinding(self.io)
        return self.outputs


class DeviceRows:
    """An output (B, S, ...) on the device, read by index: ``[j : j + 1]`` is rows j.. (no copy),
    ``[b, i]`` brings that one row back, ``[b, [i, ...]]`` those rows (device.rows)."""

    def __init__(self, ex: DeviceExecutor, value, shape: tuple, first: int = 0, rows: int | None = None):
        self.ex, self.value, self.full = ex, value, shape
        self.first = first
        self.shape = (shape[0] - first if rows is None else rows, *shape[1:])
        self.dtype = ex.dm.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("DeviceRows: a step other than 1")
            return DeviceRows(self.ex, self.value, self.full, self.first + start, max(stop - start, 0))
        if not isinstance(key, tuple):
            key = (key, slice(None))
        b, i = key[0], key[1]
        b = int(b) + self.first
        s = self.full[1]
        if isinstance(i, slice):
            idx = list(range(s))[i]
            return self.ex.fetch(self.value, self.full, [b * s + x for x in idx])
        if isinstance(i, (list, tuple, np.ndarray)):
            return self.ex.fetch(self.value, self.full, [b * s + int(x) for x in np.asarray(i).reshape(-1)])
        return self.ex.fetch(self.value, self.full, [b * s + int(i)])[0]


class DeviceOutputs(dict):
    """A call's outputs by name (:class:`DeviceRows` on the device) and the selection graph's results
    (host arrays (B, S): ``argmax``, ``nonfinite``; None after a prefill)."""

    argmax = None
    nonfinite = None
    call = None  # the _BaseCall whose outputs these are


class _BaseCall:
    """One base call shape (rows first .. first + rows, S new tokens each), bound once: host inputs by
    pointer, outputs OrtValues on the device, K/V the buffers' rows; and the selection graph on its
    logits, whose two small outputs are bound to host arrays."""

    def __init__(self, ex: DeviceExecutor, session, first: int, rows: int, s: int):
        self.ex, self.session = ex, session
        dm = ex.dm
        cap = ex.capacity
        self.ids = np.zeros((rows, s), dtype=np.int64)
        self.pos = np.zeros((rows, s), dtype=np.int64)
        self.write = self.pos.reshape(rows) if s == 1 else np.zeros(rows, dtype=np.int64)
        self.mask = np.zeros((rows, 1, s, cap), dtype=bool)
        self.columns = np.arange(cap)
        self.eye = np.eye(s, dtype=bool)
        self.rows_ix = np.arange(rows)
        io = self.io = session.io_binding()
        for name, arr in ((C.INPUT_IDS, self.ids), (C.POSITION_IDS, self.pos), (C.KV_WRITE, self.write),
                          (C.ATTENTION_MASK, self.mask)):
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        self.values = {}
        self._hold = []
        for name, dtype, dims in dm.outputs:
            shape = (rows, s, *dims)
            host = np.zeros(shape, dtype=dtype)  # (on the CPU device the OrtValue's memory; elsewhere copied once)
            v = ort.OrtValue.ortvalue_from_numpy(host, ex.dev, ex.dev_id)
            self._hold.append(host)
            io.bind_ortvalue_output(name, v)
            self.values[name] = (v, shape)
        ex._bind_kv(io, first, rows, dm.names, ["present." + x[len("past_key_values."):] for x in dm.names])
        self.out = DeviceOutputs({name: DeviceRows(ex, v, shape) for name, (v, shape) in self.values.items()})
        self.out.call = self
        self._sample = None  # device.sample on this call's logits, bound when a sampled row first comes
        # the selection graph on this call's logits
        sel = self.sel_session = dm.sessions[C.SELECT_ROLE]
        self.argmax = np.zeros((rows, s), dtype=np.int64)
        self.nonfinite = np.zeros((rows, s), dtype=bool)
        self.sel_io = sel.io_binding()
        self.sel_io.bind_ortvalue_input(C.LOGITS, self.values[C.LOGITS][0])
        for name, arr in ((C.ARGMAX, self.argmax), (C.NONFINITE, self.nonfinite)):
            self.sel_io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        self.sel_bytes = self.argmax.nbytes + self.nonfinite.nbytes
        self._flat_ids = self.ids.reshape(-1)
        self._flat_best = self.argmax.reshape(-1)

    def run(self, select: bool) -> DeviceOutputs:
        self.session.run_with_iobinding(self.io)
        out = self.out
        if select:
            self.sel_session.run_with_iobinding(self.sel_io)
            self.ex.host_bytes += self.sel_bytes
            out.argmax, out.nonfinite = self.argmax, self.nonfinite
        else:
            out.argmax = out.nonfinite = None
        return out

    def sample(self, picks: list, sampled: list) -> tuple:
        """device.sample over this call's logits for the ``sampled`` rows of ``picks`` (the others ride
        along at temperature 1): (node_probs (n, S, S), draws (n, S, R)), host arrays."""
        ex = self.ex
        n, s = self.ids.shape
        r = C.SAMPLE_DRAWS
        call = self._sample
        if call is None:
            call = self._sample = _Bound(ex.dm.sessions[C.SAMPLE_ROLE], {
                C.NODE_TOKENS: ((n, s), np.int64), C.TEMPERATURE: ((n,), np.float32), C.TOP_K: ((n,), np.int64),
                C.TOP_P: ((n,), np.float32), C.UNIFORMS: ((n, s, r), np.float32)},
                {C.NODE_PROBS: ((n, s, s), np.float32), C.DRAWS: ((n, s, r), np.int64)})
            call.io.bind_ortvalue_input(C.LOGITS, self.values[C.LOGITS][0])
        x = call.inputs
        vocab = ex.info.vocab
        x[C.TEMPERATURE].fill(1.0)
        x[C.TOP_K].fill(vocab)
        x[C.TOP_P].fill(1.0)
        x[C.UNIFORMS].fill(0.0)
        for b in sampled:
            sampler, tree, tokens = picks[b]
            x[C.NODE_TOKENS][b, : len(tokens)] = tokens
            x[C.TEMPERATURE][b] = sampler.temperature
            x[C.TOP_K][b] = sampler.top_k if 0 < sampler.top_k < vocab else vocab
            x[C.TOP_P][b] = sampler.top_p
            x[C.UNIFORMS][b, : tree.size] = sampler.rng.random((tree.size, r), dtype=np.float32)
        got = call.run()
        ex.host_bytes += got[C.NODE_PROBS].nbytes + got[C.DRAWS].nbytes
        return got[C.NODE_PROBS], got[C.DRAWS]

    def fill_trees(self, trees: list, tokens: list, lens: np.ndarray, pad: int) -> None:
        n, s = self.ids.shape
        self.ids.fill(pad)
        self.pos[:] = lens[:, None]
        self.write[:] = lens
        np.less(self.columns, lens[:, None, None], out=self.mask[:, 0])
        for b in range(n):
            tree, k, w = trees[b], len(tokens[b]), int(lens[b])
            self.ids[b, :k] = tokens[b]
            block = self.mask[b, 0, :, w : w + s]
            block[...] = self.eye
            if k > 1:
                self.pos[b, :k] += tree.depth
                block[:k, :k] = tree.mask


class _PlainRun:
    """:class:`graphs.executor.PlainRun` on the device: each step runs the base and the selection graph;
    the argmax (n,) is what comes back."""

    def __init__(self, call: _BaseCall, steps: int, lens: np.ndarray):
        self.call, self.steps, self.lens = call, steps, lens
        self.outputs = call.out

    def step(self, roots) -> dict:
        c = self.call
        c.ids[:, 0] = roots
        c.pos[:, 0] = self.lens
        np.less_equal(c.columns, self.lens[:, None], out=c.mask[:, 0, 0])
        return c.run(select=True)

    def again(self) -> dict:
        c = self.call
        c.write += 1
        c.mask[c.rows_ix, 0, 0, c.write] = True
        return c.run(select=True)

    def greedy(self) -> np.ndarray:
        c = self.call
        ids = c._flat_ids
        ids[:] = c._flat_best
        if c.nonfinite.any():
            raise NonFiniteLogitsError("the base graph returned non-finite logits (nan or inf): float16 overflow "
                                       "or damaged weights; re-export with --dtype float32 (or check the model "
                                       "in PyTorch)")
        return ids

    def feed(self, tokens) -> None:
        self.call.ids[:, 0] = tokens


class DeviceDraftKV(_Growing):
    """The EAGLE / DFlash drafter's K/V on the device: per layer one K and one V buffer, an OrtValue (slots rows,
    capacity columns) in the drafter graphs' layout, bound in place by pointer as the base's. The calls
    of :class:`graphs.slots.SlotCache` the proposers make (graphs.proposers ``_Eagle``, ``DFlash``): every drafter
    graph writes its new rows in place at the columns it is given, and what the proposers commit is
    each row's new rows in order (the context), so a commit moves only the lengths; temporary rows
    (the step-wise tree) are written at ``top + temp`` and forgotten. Growth and a row moved into a
    freed one: device.draft_kv_copy (one call, every buffer)."""

    def __init__(self, ex: DeviceExecutor, num_layers: int, kv_heads: int, head_dim: int, layout: str):
        self.ex = ex
        self.num_layers, self.kv_heads, self.head_dim, self.layout = num_layers, kv_heads, head_dim, layout
        self.slots, self.limit, self.bucket = ex.slots, ex.limit, 64
        self.dtype = np.dtype(ex.dm.dtype)
        self.itemsize = self.dtype.itemsize
        self.names = [n for i in range(num_layers) for n in (C.past_key(i), C.past_value(i))]
        self.outs = [n for i in range(num_layers) for n in (C.present_key(i), C.present_value(i))]
        self.capacity, self.n, self.temp, self.generation = 0, 0, 0, 0
        self.lens = np.zeros(self.slots, dtype=np.int64)
        self.buffers: list = []
        self._hold: list = []

    def _shape(self, rows: int, cap: int) -> tuple:
        if self.layout == "bsh":
            return (rows, cap, self.kv_heads * self.head_dim)
        return (rows, self.kv_heads, cap, self.head_dim)

    @property
    def bytes_per_column(self) -> int:
        return 2 * self.num_layers * self.slots * self.kv_heads * self.head_dim * self.itemsize

    def _alloc(self, cap: int) -> list:
        ex = self.ex
        shape = self._shape(self.slots, cap)
        if ex.dev == "cpu" or not self.buffers:
            zeros = [np.zeros(shape, dtype=self.dtype) for _ in self.names]
            if ex.dev == "cpu":
                self._hold = zeros
            return [ort.OrtValue.ortvalue_from_numpy(z, ex.dev, ex.dev_id) for z in zeros]
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, ex.dev, ex.dev_id) for _ in self.names]

    def _grown(self) -> None:  # new buffers: calls bound to the old ones are stale
        self.generation += 1

    def reserve_columns(self, columns: int) -> None:  # SlotCache's name for it
        self.reserve(columns)

    def _bind(self, io, first: int, rows: int, names_in, names_out, buffers=None, cap=None) -> None:
        ex = self.ex
        cap = self.capacity if cap is None else cap
        shape = self._shape(rows, cap)
        stride = int(np.prod(shape[1:])) * self.itemsize
        for value, nin, nout in zip(buffers or self.buffers, names_in, names_out):
            ptr = value.data_ptr() + first * stride
            if nin:
                io.bind_input(nin, ex.dev, ex.dev_id, self.dtype, shape, ptr)
            if nout:
                io.bind_output(nout, ex.dev, ex.dev_id, self.dtype, shape, ptr)

    def bind(self, io, first: int, rows: int) -> None:
        """A drafter graph's K/V inputs and their ``present.*`` outputs bound to rows first.. (in place)."""
        self._bind(io, first, rows, self.names, self.outs)

    def _copy(self, src, r_src, dst, r_dst, rows, cap_src, cap_dst, pads) -> None:
        sess = self.ex.dm.sessions[C.DRAFT_COPY_ROLE]
        io = sess.io_binding()
        n = len(self.names)
        pad_arr = np.asarray(pads, dtype=np.int64)
        io.bind_cpu_input(C.PADS, pad_arr)
        self._bind(io, r_src, rows, [C.cache_in(j) for j in range(n)], [None] * n, src, cap_src)
        self._bind(io, r_dst, rows, [None] * n, [C.cache_out(j) for j in range(n)], dst, cap_dst)
        sess.run_with_iobinding(io)

    def shrink(self) -> None:
        if self.n == 0 and self.capacity:
            self.buffers, self._hold, self.capacity = [], [], 0
            self.generation += 1

    def add_row(self) -> int:
        if self.n >= self.slots:
            raise ValueError("DeviceDraftKV: no free row")
        b = self.n
        self.lens[b] = 0
        self.n += 1
        return b

    def remove_row(self, b: int) -> int | None:
        last = self.n - 1
        self.n -= 1
        moved = None
        if b != last:
            if self.lens[last]:
                self._copy(self.buffers, last, self.buffers, b, 1, self.capacity, self.capacity,
                           [0] * (2 * len(self._shape(1, 1))))
            self.lens[b] = self.lens[last]
            moved = last
        self.lens[last] = 0
        return moved

    def past_mask(self, rows: slice | None = None) -> np.ndarray:
        rows = rows or slice(0, self.n)
        return np.arange(self.capacity)[None, :] < self.lens[rows][:, None]

    def write_columns(self, rows: slice | None = None) -> np.ndarray:
        rows = rows or slice(0, self.n)
        return self.lens[rows].copy()

    def top(self) -> int:
        return int(self.lens[: self.n].max(initial=0))

    def commit(self, presents, idx: np.ndarray, counts: np.ndarray, first: int = 0) -> None:
        """Rows ``first..`` keep their ``counts`` new rows, written in place at their lengths in order
        (``idx[b, j] == j``: the only commits the EAGLE and DFlash proposers make): the lengths move, nothing else."""
        counts = np.asarray(counts, dtype=np.int64)
        if presents is not None:
            raise ValueError("DeviceDraftKV: the drafter's graphs write their K/V in place (no present.* to commit)")
        keep = np.arange(idx.shape[1])[None, :] < counts[:, None]
        if (np.asarray(idx)[keep] != np.nonzero(keep)[1]).any():
            raise ValueError("DeviceDraftKV: a commit that moves drafter rows (only in-order new rows are kept)")
        self.lens[first : first + len(counts)] += counts

    def keep_new(self, counts, first: int = 0) -> None:
        self.lens[first : first + len(counts)] += counts

    def write_temp(self, presents, width: int | None = None) -> int:
        if presents is not None:
            raise ValueError("DeviceDraftKV: the drafter's graphs write their K/V in place")
        start = self.top() + self.temp
        self.reserve(start + width)
        self.temp += width
        return start

    def drop_temp(self) -> None:
        self.temp = 0
