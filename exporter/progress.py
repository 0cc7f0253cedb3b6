"""A line at least every ``EVERY_S`` seconds while a long step runs, from a watcher thread.

    with heartbeat("trace base graph", log):   # "trace base graph: 20 s so far" every 10 s
        trace(...)

For steps that cannot report their own progress (torch.onnx tracing, ONNX Runtime's optimizer, a
dequantization inside transformers): the user sees the step is alive and how long it has run.
"""

from __future__ import annotations

import contextlib
import threading
import time

EVERY_S = 10.0


@contextlib.contextmanager
def heartbeat(label: str, log, every_s: float | None = None):
    every = EVERY_S if every_s is None else every_s
    t0 = time.perf_counter()
    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            log(f"{label}: {time.perf_counter() - t0:.0f} s so far", flush=True)

    watcher = threading.Thread(target=beat, daemon=True, name=f"heartbeat {label}")
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
