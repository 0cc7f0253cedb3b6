"""K/V buffer helpers of the host path (numpy): the buffers' layouts and the in-place contract's feeds.

The caches themselves are :class:`graphs.slots.SlotCache` (the engine's rows, and a one-row scratch
cache for a single forward: tune, benchmarks, tests); the device path keeps its own OrtValues
(:mod:`graphs.device`).
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
