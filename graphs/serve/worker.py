"""The engine's thread: the only one that touches the engine; asyncio handlers talk to it by commands.

    worker = Worker(decoder, EngineConfig(max_batch=8), metrics, max_queue=64)
    worker.start()
    handle = await worker.submit(ids, params, max_new=64)   # InputError from the engine, CapacityError
    while (event := await handle.queue.get()).finish_reason is None: ...
    worker.cancel(handle.id)                                 # a client that left: freed within one step

One loop::

    drain     adds and cancels posted since the last step are applied (engine.add_request /
              remove_request), each add answering its handler's future (its id, or the engine's error)
    step      engine.step() when anything is pending, else sleep until a command arrives
    deliver   the step's events go to their requests' asyncio queues in one call_soon_threadsafe;
              metrics are observed here, at the time the engine emitted the tokens

Errors, each an :class:`ErrorEvent` (finish_reason "error") with a ``code`` for the handler to map:

- ``request_error`` (500): one request's own sampling, stop strings or text raised inside the step
  (graphs.engine): that request alone ends, the step goes on for the others;
- ``queue_timeout`` (503): the request's deadline passed before its first token (still queued, or
  prefilling behind others): "timeout while queued", never an empty 200 with finish_reason "length";
- ``engine_error`` (500): a step raised (a bug, a failed graph call the batch shares): every live
  request ends with it, each counted as finished with reason "error", and the engine is rebuilt
  (its request ids continue the old one's). Adds still queued, and retries posted after the clients
  heard, go to the new engine: no request hangs, none that came after the failure is failed by it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from graphs.errors import CapacityError, InputError
from graphs.results import RequestEvent

log = logging.getLogger("graphs.serve")


@dataclass
class Handle:
    """One request as its handler sees it."""

    id: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    prompt_tokens: int
    speculation: str | None = None
    deadline_s: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    done: bool = False
    seen: dict = field(default_factory=dict)  # the spec-decode counters already counted


@dataclass
class ErrorEvent:
    """This request ended without its answer: ``code`` says why (module doc), ``status`` the HTTP status
    it suggests (engine_error / request_error 500, queue_timeout 503)."""

    message: str
    request_id: int = -1
    token_ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: str = "error"
    stats: object = None
    code: str = "engine_error"
    status: int = 500


class Worker:
    def __init__(self, decoder, config, metrics=None, max_queue: int | None = None, idle_wait: float = 0.5):
        """``config``: the engine's (max_batch: the running cap); ``max_queue``: requests that may wait
        beyond it (None: unbounded). The bound is the worker's, on live requests (running + waiting):
        the engine's own max_waiting would also count requests added since the last step while rows
        are free (they take their rows in the next step)."""
        self.dec, self.config, self.metrics = decoder, config, metrics
        self.capacity = None if max_queue is None else config.max_batch + max_queue
        self.engine = decoder.engine(config)
        self.idle_wait = idle_wait
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._handles: dict[int, Handle] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.snapshot: dict = self._memory()
        self.steps = 0
        self.failures = 0
        self._next_id = 0  # past every request id handed out (a rebuilt engine starts here)
        self.step_seconds = 0.0  # inside engine.step()
        self.worker_seconds = 0.0  # the worker's own work around the steps (commands, events, metrics)

    # ------------------------------------------------------------------ any thread / the event loop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, prompt, params: dict, max_new: int, deadline_s: float | None = None,
                     arrival: float | None = None) -> Handle:
        """Queue a request on the engine; its Handle, or the engine's InputError / CapacityError."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        arrival = time.perf_counter() if arrival is None else arrival
        self._post(("add", prompt, params, max_new, deadline_s, arrival, loop, fut))
        return await fut

    def cancel(self, request_id: int) -> None:
        """Remove a request (a client that disconnected); thread-safe, applied before the next step."""
        self._post(("cancel", request_id))

    def _post(self, command) -> None:
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        self._commands.append(command)
        self.engine.interrupt()  # a run of plain steps in progress ends after its current step
        self._wake.set()

    # ------------------------------------------------------------------ the engine's thread

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            t0 = time.perf_counter()
            self._drain()
            try:
                pending = self.engine.has_pending_requests()
                if pending:
                    t1 = time.perf_counter()
                    events = self.engine.step()
                    t2 = time.perf_counter()
                    self.steps += 1
                    self._deliver(events)
                    self.step_seconds += t2 - t1
                    self.worker_seconds += time.perf_counter() - t0 - (t2 - t1)
            except Exception as e:  # a bug or a failed graph: fail every live request, rebuild, go on
                self._fail(e)
                continue
            if not pending:
                self._wake.wait(self.idle_wait)
        self._fail(RuntimeError("the server is shutting down"), rebuild=False)

    def _drain(self) -> None:
        if not self._commands:
            return
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "cancel":
                if cmd[1] in self._handles:
                    self.engine.remove_request(cmd[1])
                continue
            _, prompt, params, max_new, deadline_s, arrival, loop, fut = cmd
            if self.capacity is not None and len(self._handles) >= self.capacity:
                e = CapacityError(f"{len(self._handles)} requests are running or waiting (at most "
                                  f"{self.config.max_batch} + {self.capacity - self.config.max_batch}); retry later")
                loop.call_soon_threadsafe(_set, fut, None, e)
                continue
            try:
                rid = self.engine.add_request(prompt, max_new_tokens=max_new, deadline_s=deadline_s, **params)
            except (InputError, CapacityError) as e:
                loop.call_soon_threadsafe(_set, fut, None, e)
                continue
            except Exception as e:  # a bug in the engine's checks: the handler answers 500
                log.error("add_request failed:\n%s", traceback.format_exc())
                loop.call_soon_threadsafe(_set, fut, None, e)
                continue
            self._next_id = max(self._next_id, rid + 1)
            req = self.engine.request(rid)
            h = Handle(rid, loop, asyncio.Queue(), arrival, len(req.prompt), speculation=req.speculation,
                       deadline_s=deadline_s)
            self._handles[rid] = h
            loop.call_soon_threadsafe(_set, fut, h, None, self, rid)
        self.snapshot = self._memory()

    def _deliver(self, events: list) -> None:
        now = time.perf_counter()
        batches: dict = {}
        for ev in events:
            h = self._handles.get(ev.request_id)
            if h is None:
                continue
            if ev.finish_reason == "error" or (ev.finish_reason == "deadline" and ev.stats is not None
                                               and ev.stats.new_tokens == 0):
                ev = _error_event(h, ev)
            if self.metrics is not None:
                self.metrics.observe(h, ev, self.engine.request(ev.request_id), now)
            if ev.finish_reason is not None:
                h.done = True
                del self._handles[ev.request_id]
            batches.setdefault(h.loop, []).append((h.queue, ev))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        self.snapshot = self._memory()
        if self.metrics is not None:
            self.metrics.engine_step(self.engine, self.snapshot)

    def _fail(self, error: Exception, rebuild: bool = True) -> None:
        if rebuild:
            self.failures += 1
            log.error("engine step failed; ending %d live requests and rebuilding the engine:\n%s",
                      len(self._handles), "".join(traceback.format_exception(error)))
        message = f"the engine failed: {type(error).__name__}: {error}"
        if rebuild:  # before the requests hear of it: a client that retries at once finds a fresh engine
            self.engine = self.dec.engine(self.config, first_id=self._next_id)
        else:  # shutting down: adds still queued will never be applied (on a rebuild the next drain
            # gives them, and retries posted once the clients heard, to the new engine)
            while self._commands:
                cmd = self._commands.popleft()
                if cmd[0] == "add":
                    cmd[6].call_soon_threadsafe(_set, cmd[7], None, RuntimeError(message))
        now = time.perf_counter()
        batches: dict = {}
        for rid, h in list(self._handles.items()):
            h.done = True
            ev = ErrorEvent(message, rid)
            self._count(h, ev, now)
            batches.setdefault(h.loop, []).append((h.queue, ev))
        self._handles.clear()
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        self.snapshot = self._memory()

    def _count(self, h: Handle, ev, now: float) -> None:
        """A request that ends outside the engine's events: finished with reason "error" in the metrics."""
        if self.metrics is None:
            return
        try:
            self.metrics.observe(h, ev, None, now)
        except Exception:  # the metrics must never stop the requests from hearing
            log.error("metrics could not count a failed request:\n%s", traceback.format_exc())

    def _memory(self) -> dict:
        m = self.engine.memory()
        return {"running": m["rows_used"], "waiting": m["waiting"], "kv_allocated_bytes": m["kv_allocated_bytes"],
                "kv_budget_bytes": m["kv_budget_bytes"], "max_running": self.config.max_batch,
                "max_waiting": None if self.capacity is None else self.capacity - self.config.max_batch,
                "live": len(self._handles)}


def _error_event(h: Handle, ev) -> ErrorEvent:
    """The handler's event for an engine event that ends ``h`` without its answer (module doc)."""
    if ev.finish_reason == "deadline":
        return ErrorEvent(f"timeout while queued: the request's {h.deadline_s:g} s timeout passed before its first "
                          f"token (the server is busy); retry later", ev.request_id, stats=ev.stats,
                          code="queue_timeout", status=503)
    e = ev.error
    log.error("request %d failed alone (the others go on):\n%s", ev.request_id,
              "".join(traceback.format_exception(e)) if e is not None else "no exception")
    return ErrorEvent(f"the request failed: {type(e).__name__}: {e}", ev.request_id, list(ev.token_ids), ev.text,
                      stats=ev.stats, code="request_error")


def _set(fut: asyncio.Future, value, error, worker: Worker | None = None, rid: int | None = None) -> None:
    """On the event loop: answer an add; a handler that gave up meanwhile has its request removed."""
    if fut.cancelled():
        if worker is not None and rid is not None:
            worker.cancel(rid)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _put_all(items) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)


__all__ = ["ErrorEvent", "Handle", "RequestEvent", "Worker"]
