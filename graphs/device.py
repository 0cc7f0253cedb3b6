"""IO binding: K/V that stays on the device (CUDA EP; the same code runs on the CPU EP for tests).

Each K/V buffer is one preallocated ``OrtValue`` ``(B, kv_heads, capacity, head_dim)`` on the
device, bound to the graph's ``past_key_values.*`` inputs as it is (no copy). The graphs'
``present.*`` outputs are left on the device by ORT, and the exported ``kv_update`` graph writes
the accepted rows into the buffers in place (its outputs are bound to the same buffers as its
inputs): per step one small graph run, no host copy of K/V. Only token ids, positions, the mask
(host inputs) and logits / hidden states / top-k (host outputs) cross the bus.
"""

from __future__ import annotations

import numpy as np

from graphs import contract as C
from graphs.kv import Columns
from graphs.sessions import ort  # the one import of onnxruntime: missing, it is a one-line error


class DeviceKVCache(Columns):
    """Same interface as :class:`graphs.kv.KVCache`, buffers on ``device``."""

    def __init__(self, update_session: ort.InferenceSession, num_layers: int, batch: int, kv_heads: int,
                 head_dim: int, dtype, device: str = "cuda", device_id: int = 0, capacity: int = 256,
                 bucket: int = 64):
        super().__init__(num_layers, batch, kv_heads, head_dim, dtype, bucket)
        self.update = update_session
        self.device, self.device_id = device, device_id
        self.buffers: list[ort.OrtValue] = []  # K0, V0, K1, V1, ... (the kv_update graph's order)
        self.reserve(max(capacity, 1))  # always allocate: the past is bound before the first write

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` columns past the write pointer; growing copies once through the host
        (rare: capacity is sized for the whole generation up front)."""
        cap = self._new_capacity(extra)
        if cap is None:
            return
        new = []
        for j in range(2 * self.num_layers):
            buf = np.zeros((self.batch, self.kv_heads, cap, self.head_dim), dtype=self.dtype)
            if self.buffers:
                buf[:, :, : self.w] = self.buffers[j].numpy()[:, :, : self.w]
            new.append(ort.OrtValue.ortvalue_from_numpy(buf, self.device, self.device_id))
        self.buffers = new
        self._grow_valid(cap)

    def bind_past(self, io: ort.IOBinding) -> None:
        for i in range(self.num_layers):
            io.bind_ortvalue_input(C.past_key(i), self.buffers[2 * i])
            io.bind_ortvalue_input(C.past_value(i), self.buffers[2 * i + 1])

    def append(self, presents: list[ort.OrtValue], idx: np.ndarray | None, counts: np.ndarray,
               width: int | None = None) -> int:
        """Write ``presents[j][:, :, idx[b]]`` to columns w..w+A-1 in place (one graph run).

        ``idx`` None: all ``width`` new rows in order."""
        if idx is None:
            idx = np.broadcast_to(np.arange(width), (self.batch, width))
        a = idx.shape[1]
        self.reserve(a)
        w = self.w
        io = self.update.io_binding()
        for j, buf in enumerate(self.buffers):
            io.bind_ortvalue_input(C.cache_in(j), buf)
            io.bind_ortvalue_output(C.cache_out(j), buf)  # same buffer: in place
            io.bind_ortvalue_input(C.cache_new(j), presents[j])
        io.bind_cpu_input(C.ACCEPT_INDEX, np.ascontiguousarray(idx, dtype=np.int64))
        io.bind_cpu_input(C.WRITE_START, np.array([w], dtype=np.int64))
        self.update.run_with_iobinding(io)
        return self._mark(a, counts)


def run_bound(session: ort.InferenceSession, spec: C.GraphSpec, feed: dict[str, np.ndarray],
              kv: DeviceKVCache, host_outputs: list[str], device: str, device_id: int = 0) -> dict:
    """Run ``session`` with host inputs ``feed`` and the past bound from ``kv``.

    Returns host numpy arrays for ``host_outputs`` and device OrtValues for every ``present.*``.
    """
    io = session.io_binding()
    for name, arr in feed.items():
        io.bind_cpu_input(name, np.ascontiguousarray(arr))
    kv.bind_past(io)
    presents = [t.name for t in spec.outputs if t.name.startswith("present.")]
    for name in host_outputs:
        io.bind_output(name, "cpu")
    for name in presents:
        io.bind_output(name, device, device_id)
    session.run_with_iobinding(io)
    names = [*host_outputs, *presents]
    values = io.get_outputs()
    out = {}
    for name, value in zip(names, values):
        out[name] = value.numpy() if name in host_outputs else value
    return out
