"""K/V for an engine of many requests: one row (slot) per request, each with its own length.

Each layer's K and V are one buffer ``(slots, kv_heads, capacity, head_dim)``. Row ``b`` holds the
K/V of its request's positions ``0 .. lens[b] - 1`` in columns of the same index, with no holes: the
attention mask of a row is ``column < lens[b]`` and a new token's position is its column. The
occupied rows are always ``0 .. n - 1`` (a request that leaves has the last row moved into its
place), so a graph call over every live request is fed ``buffer[:n]``, a contiguous view (no copy),
and one request alone ``buffer[b : b + 1]``::

    slot 0  [k0 k1 k2 k3 k4 . . .]   lens[0] = 5
    slot 1  [k0 k1 . . . . . . . ]   lens[1] = 2      a verify call over n = 2 rows reads columns
    slot 2  (free)                                    0 .. capacity-1, masked per row

After a verify, each row's accepted nodes are written at its own length with one fancy-indexed
assignment per buffer (rows, columns and node indices flattened)::

    cache[rows, :, lens[rows] + j] = present[rows, :, idx[rows, j]]     for j < counts[rows]

All of them are views of one array, ``store`` (2 x layers, slots, ...): a move of columns (the
compaction after a verify, a row that leaves, a growth) is one numpy operation over every layer,
not one per buffer (24 on a 12-layer model: most of the Python time of a verify step's commit).

Capacity grows in buckets (an amortised copy, an eighth at least) and never past
``max_len + headroom``, the budget fixed when the cache is made: ``budget_bytes`` is what the buffers
can ever hold, ``allocated_bytes`` what they hold now. ``headroom`` leaves room past a full row for
temporary rows (EAGLE's step-wise draft tree), written at ``top = max(lens)`` for every row and
dropped after the step.
"""

from __future__ import annotations

import numpy as np

from graphs import contract as C
from graphs.kv import alloc_buffer, graph_view


class SlotCache:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype, max_len: int,
                 headroom: int = 0, bucket: int = 64, layout: str = "bhsd"):
        self.num_layers, self.slots, self.kv_heads, self.head_dim = num_layers, slots, kv_heads, head_dim
        # "bsh": each buffer is stored (slots, capacity, kv_heads * head_dim), the layout of the graphs
        # that write K/V in place (graphs.contract.kv_layout); self.keys / self.values are then
        # (slots, kv_heads, capacity, head_dim) views of it, so every write below is layout-blind
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self.limit = int(max_len) + int(headroom)  # columns a buffer may ever have
        self.bucket = bucket
        self.capacity = 0
        self.n = 0  # occupied rows: 0 .. n-1
        self.lens = np.zeros(slots, dtype=np.int64)  # (slots,) committed columns per row
        self.temp = 0  # temporary columns written at [top, top + temp) this step
        self.generation = 0  # bumped whenever the buffers are reallocated (the bindings of the old ones dropped)
        self.bindings: dict = {}  # graph -> its IO bindings of these buffers (InPlaceRun.run_on; one thread)
        self._set_store(self._alloc(0))

    # ---------------------------------------------------------------- memory

    def _alloc(self, cap: int) -> np.ndarray:
        """(2 * layers, slots, kv_heads, cap, head_dim): every K and V buffer, in ``layout``'s storage
        (graphs.kv.alloc_buffer: for "bsh" the transposed view of (..., slots, cap, kv_heads, head_dim))."""
        return alloc_buffer(self.slots, self.kv_heads, cap, self.head_dim, self.dtype, self.layout,
                            lead=(2 * self.num_layers,))

    def _set_store(self, store: np.ndarray) -> None:
        self.store = store  # keys[i] is store[2i], values[i] store[2i + 1]: contiguous in their own layout
        self.keys = [store[2 * i] for i in range(self.num_layers)]
        self.values = [store[2 * i + 1] for i in range(self.num_layers)]

    @property
    def bytes_per_column(self) -> int:
        return 2 * self.num_layers * self.slots * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def budget_bytes(self) -> int:
        return self.bytes_per_column * self.limit

    @property
    def allocated_bytes(self) -> int:
        return self.bytes_per_column * self.capacity

    def reserve(self, columns: int) -> None:
        """Make every row able to hold ``columns`` columns (grows by an eighth at least, up to the limit).

        The attention reads every column of the capacity (masked or not), so the capacity tracks the
        longest row closely: at most 1/8 above it past 512 columns (with growth by half it was up to
        1.5x, the attention's cost with it). Each growth copies the rows, O(1) amortised per column
        (about 8x the final size in all: ~0.4% of the steps' time measured at 2048 tokens)."""
        if columns <= self.capacity:
            return
        if columns > self.limit:
            raise ValueError(f"SlotCache: {columns} columns exceed the budget of {self.limit}")
        cap = min(max(-(-columns // self.bucket) * self.bucket, self.capacity + self.capacity // 8), self.limit)
        top = int(self.lens[: self.n].max(initial=0)) + self.temp
        new = self._alloc(cap)
        new[:, : self.n, :, :top] = self.store[:, : self.n, :, :top]
        self._set_store(new)
        self.capacity = cap
        self.generation += 1
        self.bindings.clear()  # every binding holds the old buffers: they would stay alive

    def shrink(self) -> None:
        """Give the memory back while no row is occupied (the next request allocates again)."""
        if self.n == 0 and self.capacity:
            self._set_store(self._alloc(0))
            self.capacity = 0
            self.generation += 1
            self.bindings.clear()  # the bindings hold the old buffers: the memory goes back only without them

    # ---------------------------------------------------------------- rows

    def add_row(self) -> int:
        """Occupy the next free row (empty); returns its index."""
        if self.n >= self.slots:
            raise ValueError("SlotCache: no free row")
        b = self.n
        self.lens[b] = 0
        self.n += 1
        return b

    def remove_row(self, b: int) -> int | None:
        """Free row ``b``: the last occupied row moves into it. Returns the index it moved from
        (the caller re-points that request to ``b``), or None when ``b`` was the last row."""
        last = self.n - 1
        self.n -= 1
        moved = None
        if b != last:
            w = int(self.lens[last])
            self.store[:, b, :, :w] = self.store[:, last, :, :w]
            self.lens[b] = w
            moved = last
        self.lens[last] = 0
        return moved

    # ---------------------------------------------------------------- graph inputs

    def past_mask(self, rows: slice | None = None) -> np.ndarray:
        """(B, capacity) bool: the committed columns of rows ``rows`` (default: every occupied row)."""
        rows = rows or slice(0, self.n)
        return np.arange(self.capacity)[None, :] < self.lens[rows][:, None]

    def feed(self, rows: slice | None = None) -> dict[str, np.ndarray]:
        """The past inputs of a graph over ``rows``: contiguous views of the whole buffers."""
        rows = rows or slice(0, self.n)
        feed = {}
        for i in range(self.num_layers):
            feed[C.past_key(i)] = graph_view(self.keys[i], self.layout)[rows]
            feed[C.past_value(i)] = graph_view(self.values[i], self.layout)[rows]
        return feed

    # ---------------------------------------------------------------- writes

    def write_columns(self, rows: slice | None = None) -> np.ndarray:
        """(B,) int64: the column where each row's next new rows go (its length), for a graph that
        writes K/V in place."""
        rows = rows or slice(0, self.n)
        return self.lens[rows].copy()

    def reserve_columns(self, columns: int) -> None:
        self.reserve(columns)

    def commit(self, presents: list[np.ndarray] | None, idx: np.ndarray, counts: np.ndarray, first: int = 0
               ) -> None:
        """Append accepted new rows to rows ``first .. first + B - 1`` at their own lengths.

        presents: the graph's ``present.{i}.key, present.{i}.value`` in layer order, (B, kv, S, hd);
            None: the graph wrote its S new rows into the buffers at each row's length already
            (:func:`graphs.contract.kv_in_place`): the accepted ones are moved down in place
        idx (B, A) int: which of the S new positions to keep, in order (pad with any index)
        counts (B,) int: how many of those A each row keeps (0: nothing, e.g. a row along for the ride)
        """
        if presents is None and idx.shape[1] == 1:  # a plain step written in place: only the lengths move
            self.keep_new(counts, first)
            return
        counts = np.asarray(counts, dtype=np.int64)
        bsz, a = idx.shape
        if presents is None and bsz == 1:  # one row written in place (a request alone)
            self._compact_one(first, idx[0], int(counts[0]))
            return
        rows = first + np.arange(bsz)
        lens = self.lens[rows]
        if presents is None:
            self._compact(rows, lens, idx, counts)
            return
        need = int((lens + counts).max(initial=0))
        self.reserve(need + self.temp)
        if bsz == 1:  # one row: slices, no fancy indexing
            c, w = int(counts[0]), int(lens[0])
            if c:
                nodes = idx[0, :c]
                sel = slice(int(nodes[0]), int(nodes[0]) + c) if np.all(np.diff(nodes) == 1) else nodes
                for i in range(self.num_layers):
                    self.keys[i][first, :, w : w + c] = presents[2 * i][0][:, sel]  # (kv, c, hd)
                    self.values[i][first, :, w : w + c] = presents[2 * i + 1][0][:, sel]
            self.lens[first] += c
            return
        keep = np.arange(a)[None, :] < counts[:, None]  # (B, A)
        b_loc, j = np.nonzero(keep)  # flattened (row, k-th kept)
        if b_loc.size:
            dst_rows = rows[b_loc]
            cols = lens[b_loc] + j
            nodes = idx[b_loc, j]
            for i in range(self.num_layers):
                # advanced indices on axes 0 and 2 (a slice between): both sides are (N, kv, hd)
                self.keys[i][dst_rows, :, cols] = presents[2 * i][b_loc, :, nodes]
                self.values[i][dst_rows, :, cols] = presents[2 * i + 1][b_loc, :, nodes]
        self.lens[rows] += counts

    def keep_new(self, counts, first: int = 0) -> None:
        """A plain step written in place: row ``first + b`` keeps the ``counts[b]`` (0 or 1) column the
        graph wrote at its length (what :meth:`commit` does for it, without its index arrays)."""
        self.lens[first : first + len(counts)] += counts

    def _compact(self, rows: np.ndarray, lens: np.ndarray, idx: np.ndarray, counts: np.ndarray) -> None:
        """Rows written in place at ``lens`` (node j at column lens + j): node ``idx[b, j]`` moves to
        column ``lens[b] + j`` for j < counts[b]. Nodes already in place (a prefill, a plain step, a
        chain's accepted prefix) move nothing; the others are a few small copies per buffer. (One row
        alone: :meth:`_compact_one`.)"""
        keep = (np.arange(idx.shape[1])[None, :] < counts[:, None]) & (idx != np.arange(idx.shape[1])[None, :])
        b_loc, j = np.nonzero(keep)
        if b_loc.size:
            dst_rows, cols, src = rows[b_loc], lens[b_loc] + j, lens[b_loc] + idx[b_loc, j]
            # every layer's K and V at once; the right side is gathered (a copy) before the write, so
            # overlapping moves are safe
            self.store[:, dst_rows, :, cols] = self.store[:, dst_rows, :, src]
        self.lens[rows] += counts

    def _compact_one(self, r: int, idx: np.ndarray, c: int) -> None:
        """:meth:`_compact` of one row ``r`` (a request alone): the moves as Python lists, one copy of them."""
        w = int(self.lens[r])
        moves = [(w + j, w + x) for j, x in enumerate(idx[:c].tolist()) if x != j]
        if moves:
            dst, src = (list(m) for m in zip(*moves))
            self.store[:, r, :, dst] = self.store[:, r, :, src]  # every layer; the right side is a copy
        self.lens[r] += c

    def top(self) -> int:
        """First column past every occupied row (where temporary rows go)."""
        return int(self.lens[0]) if self.n == 1 else int(self.lens[: self.n].max(initial=0))

    def write_temp(self, presents: list[np.ndarray] | None, width: int | None = None) -> int:
        """Write all S new rows of every occupied row at ``top() + temp`` (temporary draft-tree rows);
        ``presents`` None: a graph wrote its ``width`` new rows there in place already.

        Returns the first column written; :meth:`drop_temp` forgets them all."""
        start = self.top() + self.temp
        if presents is None:
            self.reserve(start + width)
            self.temp += width
            return start
        s = presents[0].shape[2]
        self.reserve(start + s)
        n = self.n
        for i in range(self.num_layers):
            self.keys[i][:n, :, start : start + s] = presents[2 * i]
            self.values[i][:n, :, start : start + s] = presents[2 * i + 1]
        self.temp += s
        return start

    def drop_temp(self) -> None:
        self.temp = 0


def attention_mask(past: np.ndarray, tree: np.ndarray) -> np.ndarray:
    """(B, 1, S, P+S) bool from the past columns each row may see and the (B, S, S) new block.

    ``past`` is (B, P) (the same for every new position of a row) or (B, S, P) (per position).
    """
    bsz, s, _ = tree.shape
    if past.ndim == 2:
        past = np.broadcast_to(past[:, None, :], (bsz, s, past.shape[1]))
    return np.concatenate([past, tree], axis=2)[:, None]


def block_mask(past: np.ndarray, new: np.ndarray, s: int, starts: np.ndarray | None = None) -> np.ndarray:
    """(B, 1, S, P+A+S) bool, a DFlash draft call's mask (graphs.contract.dflash_graph_spec): each of
    the block's S queries sees the row's cached columns ``past`` (B, P), its real new context rows
    ``new`` (B, A) and the whole block (bidirectional). ``starts`` (B,): the graph writes the A new
    rows into the buffer at those columns (graphs.contract.inplace_dflash_spec): (B, 1, S, P+S), the
    new rows marked at their columns."""
    bsz = past.shape[0]
    if starts is None:
        cols = np.concatenate([past, new, np.ones((bsz, s), dtype=bool)], axis=1)  # (B, P+A+S)
    else:
        buf = past.copy()  # (B, P): P holds the A new columns of every row (reserved)
        a = new.shape[1]
        buf[np.arange(bsz)[:, None], starts[:, None] + np.arange(a)[None, :]] = new
        cols = np.concatenate([buf, np.ones((bsz, s), dtype=bool)], axis=1)  # (B, P+S)
    return np.ascontiguousarray(np.broadcast_to(cols[:, None, None, :], (bsz, 1, s, cols.shape[1])))
