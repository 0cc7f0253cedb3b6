"""K/V cache buffers for the runtime (host memory, numpy).

Each layer's K and V live in one contiguous buffer ``(B, kv_heads, capacity, head_dim)`` that is
passed to the graph whole, so ONNX Runtime reads it without a copy. Which columns hold a real
token is a per-sequence boolean row ``valid (B, capacity)``: the attention mask is built from it,
so sequences that accepted different numbers of tokens simply leave holes (masked columns) and
all sequences share one write pointer. Capacity grows in buckets (amortised copy).

After a verify step the accepted rows of the graph's ``present`` output (K/V of the new positions)
are moved into place with one gather per buffer::

    cache[:, :, w : w + A] = take_along_axis(present, idx (B, A))     # idx: accepted node indices
    valid[b, w : w + count[b]] = True                                  # the rest of b's A are holes
"""

from __future__ import annotations

import numpy as np

from graphs import contract as C


def alloc_buffer(rows: int, kv_heads: int, cap: int, head_dim: int, dtype, layout: str = "bhsd",
                 lead: tuple = ()) -> np.ndarray:
    """One K or V buffer as a (rows, kv_heads, cap, head_dim) array. Layout ``bsh`` (the graphs that
    write K/V in place, graphs.contract.kv_layout) stores it (rows, cap, kv_heads, head_dim) and returns
    the transposed view, so every write of the caches is layout-blind. Zeros, not empty: masked
    columns are still multiplied by softmax weights of 0. ``lead``: leading dimensions of several such
    buffers in one array (``lead + (rows, kv_heads, cap, head_dim)``; each ``[i]`` is one buffer)."""
    k = len(lead)
    if layout == "bsh":
        axes = (*range(k), k, k + 2, k + 1, k + 3)
        return np.zeros((*lead, rows, cap, kv_heads, head_dim), dtype=dtype).transpose(axes)
    return np.zeros((*lead, rows, kv_heads, cap, head_dim), dtype=dtype)


def graph_view(buf: np.ndarray, layout: str) -> np.ndarray:
    """``buf`` (from :func:`alloc_buffer`) as the graph reads it, without a copy: itself, or its
    (rows, cap, kv_heads * head_dim) storage."""
    if layout == "bsh":
        r, h, cap, d = buf.shape
        return buf.transpose(0, 2, 1, 3).reshape(r, cap, h * d)
    return buf


class Columns:
    """Which cache columns hold a real token, per sequence, and where the next write goes.

    The engine keeps one row per request instead (:mod:`graphs.slots`); this single-batch cache is
    what ``exporter.tune`` measures verify costs with.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype, bucket: int):
        self.num_layers, self.batch, self.kv_heads, self.head_dim = num_layers, batch, kv_heads, head_dim
        self.dtype = np.dtype(dtype)
        self.bucket = bucket
        self.capacity = 0
        self.w = 0  # write pointer: columns [0, w) are written (valid or holes)
        self.valid = np.zeros((batch, 0), dtype=bool)  # (B, capacity)

    def _new_capacity(self, extra: int) -> int | None:
        """The grown capacity if ``extra`` more columns do not fit, else None."""
        need = self.w + extra
        if need <= self.capacity:
            return None
        # grow by half at least: each growth copies every buffer, so copies stay O(1) per column
        return max(-(-need // self.bucket) * self.bucket, self.bucket, self.capacity + self.capacity // 2)

    def _grow_valid(self, cap: int) -> None:
        valid = np.zeros((self.batch, cap), dtype=bool)
        valid[:, : self.w] = self.valid[:, : self.w]
        self.valid, self.capacity = valid, cap

    def _mark(self, a: int, counts: np.ndarray) -> int:
        """Columns w..w+a-1 were written; the first counts[b] are real for sequence b."""
        w = self.w
        self.valid[:, w : w + a] = np.arange(a)[None, :] < counts[:, None]
        self.w = w + a
        return w

    def past_mask(self) -> np.ndarray:
        """(B, capacity) bool: the columns each sequence may attend."""
        return self.valid

    def truncate(self, w: int) -> None:
        """Forget every column from ``w`` on (temporary draft-tree rows)."""
        self.valid[:, w : self.w] = False
        self.w = w


class KVCache(Columns):
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype, bucket: int = 64,
                 layout: str = "bhsd"):
        super().__init__(num_layers, batch, kv_heads, head_dim, dtype, bucket)
        self.layout = layout  # "bsh": stored (B, capacity, kv*hd), keys/values are 4-D views (graphs.slots)
        self.generation = 0  # bumped whenever the buffers are reallocated
        self.bindings: dict = {}  # graph -> its IO bindings of these buffers (graphs.sessions.InPlaceRun.run_on)
        self.keys = [self._alloc(0) for _ in range(num_layers)]
        self.values = [self._alloc(0) for _ in range(num_layers)]

    def _alloc(self, cap: int) -> np.ndarray:
        return alloc_buffer(self.batch, self.kv_heads, cap, self.head_dim, self.dtype, self.layout)

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more columns beyond the write pointer."""
        cap = self._new_capacity(extra)
        if cap is None:
            return
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = self._alloc(cap)
                new[:, :, : self.w] = old[:, :, : self.w]
                bufs[i] = new
        self._grow_valid(cap)
        self.generation += 1
        self.bindings.clear()  # they hold the old buffers

    def feed(self) -> dict[str, np.ndarray]:
        """The past inputs of a graph: ``past_key_values.{i}.key/value`` -> whole buffers."""
        feed = {}
        for i in range(self.num_layers):
            feed[C.past_key(i)] = graph_view(self.keys[i], self.layout)
            feed[C.past_value(i)] = graph_view(self.values[i], self.layout)
        return feed

    def write_columns(self, rows=None) -> np.ndarray:
        """(B,) int64: where a graph that writes K/V in place puts the next new rows (the write pointer)."""
        return np.full(self.batch, self.w, dtype=np.int64)

    def reserve_columns(self, columns: int) -> None:
        self.reserve(columns - self.w)

    def append(self, presents: list[np.ndarray] | None, idx: np.ndarray | None, counts: np.ndarray,
               width: int | None = None) -> int:
        """Write accepted rows of the new positions; returns the first column written.

        presents: the graph's ``present.{i}.key, present.{i}.value`` in layer order, (B, kv, S, hd);
            None: the graph wrote its S new rows at columns w.. already (in place): the kept ones are
            gathered from there
        idx (B, A) int: which of the S new positions go to columns w..w+A-1 (pad with any index);
            None: all of them in order (then ``width`` = S)
        counts (B,) int: how many of those A are real for each sequence (the rest are holes)
        """
        a = idx.shape[1] if idx is not None else width
        self.reserve(a)
        w = self.w
        if presents is None:  # written in place at w + node: gather the kept nodes down to w + j
            if idx is not None:
                for bufs in (self.keys, self.values):
                    for buf in bufs:
                        if self.batch == 1:
                            buf[:, :, w : w + a] = buf[:, :, w + idx[0]]
                        else:
                            b = np.arange(self.batch)[:, None]
                            buf[:, :, w : w + a] = buf[b, :, w + idx].transpose(0, 2, 1, 3)
            return self._mark(a, counts)
        if idx is None:  # all S new rows, in order (temporary draft-tree rows)
            for i in range(self.num_layers):
                self.keys[i][:, :, w : w + a] = presents[2 * i]
                self.values[i][:, :, w : w + a] = presents[2 * i + 1]
        elif self.batch == 1:  # the common case: a plain take along the sequence axis
            rows = idx[0]
            for i in range(self.num_layers):
                self.keys[i][:, :, w : w + a] = presents[2 * i][:, :, rows]
                self.values[i][:, :, w : w + a] = presents[2 * i + 1][:, :, rows]
        else:
            b = np.arange(self.batch)[:, None]  # (B, 1) with idx (B, A): picks (B, A, kv, hd)
            for i in range(self.num_layers):
                self.keys[i][:, :, w : w + a] = presents[2 * i][b, :, idx].transpose(0, 2, 1, 3)
                self.values[i][:, :, w : w + a] = presents[2 * i + 1][b, :, idx].transpose(0, 2, 1, 3)
        return self._mark(a, counts)


# ---------------------------------------------------------------- graphs that write K/V in place


def inplace_mask(past: np.ndarray, starts: np.ndarray, tree: np.ndarray) -> np.ndarray:
    """(B, 1, S, P) bool: the attention mask of a graph that writes row b's S new K/V rows into the
    buffer at columns ``starts[b] ..`` (graphs.contract.kv_in_place): the past columns each new row
    may see, ``past`` (B, P) (the same for the S) or (B, S, P), with ``tree`` (B, S, S) placed at
    the new rows' own columns. What :func:`graphs.slots.attention_mask` is for the concat contract."""
    bsz, s, _ = tree.shape
    if s == 1 and past.ndim == 2:  # a plain step: the past and the token itself, no scatter
        mask = past.copy()
        mask[np.arange(bsz), starts] = tree[:, 0, 0]
        return mask[:, None, None, :]
    mask = np.zeros((bsz, 1, s, past.shape[-1]), dtype=bool)
    mask[:, 0] = past[:, None, :] if past.ndim == 2 else past
    cols = starts[:, None] + np.arange(s)[None, :]  # (B, S): where each row's new rows go
    mask[np.arange(bsz)[:, None], 0, :, cols] = tree.transpose(0, 2, 1)  # [b, j, i] = tree[b, i, j]
    return mask


def as_inplace_feed(feed: dict, spec: C.GraphSpec):
    """A feed of the concat contract (pasts (B, kv, P, hd), mask over P+S) for a graph that writes its
    K/V in place (:func:`graphs.contract.kv_in_place`): each past padded to P+S columns (zeros) in the
    graph's layout, every row written at column P, the mask unchanged (its columns line up).

    Returns (feed, cut): ``cut(outputs)`` turns the graph's outputs back into the concat contract's
    (each ``present.*`` the S new rows, (B, kv, S, hd)). What parity checks, ``compare`` and tests
    feed both layouts with; the runtime keeps real buffers (:class:`graphs.slots.SlotCache`)."""
    k0 = feed[C.past_key(0)]
    bsz, kvh, p, hd = k0.shape
    s = feed[C.INPUT_IDS].shape[1]
    bsh = C.kv_layout(spec) == "bsh"
    out = dict(feed)
    for t in spec.inputs:
        if t.name.startswith("past_key_values."):
            x = np.concatenate([feed[t.name], np.zeros((bsz, kvh, s, hd), dtype=feed[t.name].dtype)], axis=2)
            out[t.name] = np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(bsz, p + s, kvh * hd) if bsh else x)
    out[C.KV_WRITE] = np.full(bsz, p, dtype=np.int64)

    def cut(outputs: dict) -> dict:
        res = {}
        for k, v in outputs.items():
            if k.startswith("present."):
                v = v[:, p : p + s].reshape(bsz, s, kvh, hd).transpose(0, 2, 1, 3) if bsh else v[:, :, p : p + s]
            res[k] = v
        return res

    return out, cut
