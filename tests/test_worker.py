"""The server's engine thread (graphs.serve.worker) under faults, without HTTP (issue 39).

Every case is made deterministic with a hook in the engine's step (it waits for the test, or raises),
never with sleeps: adds queued while a failing step runs go to the rebuilt engine, failed requests are
counted, a request whose deadline passes in the queue ends with an error event, one request's own
failure ends it alone, and admission takes exactly max_running + max_queue.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import graphs
from graphs.engine import EngineConfig
from graphs.errors import CapacityError
from graphs.serve.worker import ErrorEvent, Worker

PROMPT = [5, 9, 3]
WAIT = 60  # seconds a test waits for the worker before it fails (a hang, never a timing)


@pytest.fixture(scope="module")
def dec(exported):
    return graphs.load(exported("medusa"), provider="cpu", threads=1)


class Recorder:
    """A stand-in for graphs.serve.metrics.Metrics: the finish reason of every event it observes."""

    def __init__(self):
        self.finished: list[tuple[int, str]] = []

    def observe(self, h, ev, live_req, now) -> None:
        if ev.finish_reason is not None:
            self.finished.append((h.id, ev.finish_reason))

    def engine_step(self, engine, snapshot) -> None:
        pass


class Gate:
    """Hooks the worker's current engine's step: the next call signals ``entered`` and waits for
    ``release()``; then it runs the real step, or raises ``fail``."""

    def __init__(self, worker: Worker, fail: Exception | None = None):
        self.entered, self.go = threading.Event(), threading.Event()
        engine, real = worker.engine, worker.engine.step

        def step():
            if not self.go.is_set():
                self.entered.set()
                assert self.go.wait(WAIT), "the test never released the step"
                if fail is not None:
                    raise fail
            return real()

        engine.step = step

    async def inside(self) -> None:
        """Until the worker is inside the hooked step."""
        assert await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, WAIT)

    def release(self) -> None:
        self.go.set()


async def _posted(coro):
    """Start a submit and return once its add is in the worker's queue (the task ran up to its await)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


async def _finish(h) -> tuple[list[int], object]:
    """All of a request's events: (tokens, last event)."""
    toks = []
    while True:
        ev = await asyncio.wait_for(h.queue.get(), WAIT)
        toks += ev.token_ids
        if ev.finish_reason is not None:
            return toks, ev


def _with_worker(dec, config, body, max_queue=None, metrics=None):
    w = Worker(dec, config, metrics, max_queue=max_queue)
    w.start()
    try:
        return asyncio.run(body(w))
    finally:
        w.stop()


def test_adds_queued_during_a_failing_step_go_to_the_rebuilt_engine(dec):
    """A step raises (a failed shared call) while a second request's add and a retry wait in the queue:
    the live request ends with the engine's error, counted as finished with reason "error"; the queued
    add and the retry the client posts as soon as it hears are served by the rebuilt engine, with ids
    past the old engine's (a late cancel of an old id never ends a new request). They were failed with
    "the engine failed" before (Worker._fail drained the queue after telling the clients)."""
    want = dec.generate(PROMPT, max_new_tokens=6).token_ids
    metrics = Recorder()

    async def body(w):
        gate = Gate(w, RuntimeError("injected graph failure"))
        a = await w.submit(PROMPT, {}, 6)
        await gate.inside()
        queued = await _posted(w.submit(PROMPT, {}, 6))  # reaches the queue while the step fails
        gate.release()
        _, ev = await _finish(a)
        assert isinstance(ev, ErrorEvent) and ev.code == "engine_error" and "injected graph failure" in ev.message
        retry = await w.submit(PROMPT, {}, 6)  # at once, as a client that heard
        b = await asyncio.wait_for(queued, WAIT)
        assert b.id > a.id and retry.id > a.id
        got = [await _finish(h) for h in (b, retry)]
        assert [(t, e.finish_reason) for t, e in got] == [(want, "length")] * 2
        assert w.failures == 1
        return a.id

    a_id = _with_worker(dec, EngineConfig(max_batch=4, plain_run_s=0), body, metrics=metrics)
    assert (a_id, "error") in metrics.finished  # counted, as vllm:request_success_total{finished_reason="error"}


def test_a_request_whose_deadline_passes_in_the_queue_ends_with_an_error_event(dec):
    """One row, held by a running request; a second request's deadline passes while it waits for the
    row: it ends with an ErrorEvent (code "queue_timeout", status 503, "timeout while queued"), counted
    as an error, not an empty answer with finish_reason "deadline" (an HTTP 200 "length" before)."""
    metrics = Recorder()

    async def body(w):
        gate = Gate(w)
        a = await w.submit(PROMPT, {}, 8)
        await gate.inside()
        b = await _posted(w.submit([7, 1, 4], {}, 8, deadline_s=1e-9))
        gate.release()
        b = await asyncio.wait_for(b, WAIT)
        toks, ev = await _finish(b)
        assert toks == [] and isinstance(ev, ErrorEvent)
        assert (ev.finish_reason, ev.code, ev.status) == ("error", "queue_timeout", 503)
        assert ev.message.startswith("timeout while queued") and "retry later" in ev.message
        _, ev_a = await _finish(a)
        assert ev_a.finish_reason == "length"  # the running one is untouched
        return b.id

    b_id = _with_worker(dec, EngineConfig(max_batch=1, plain_run_s=0), body, metrics=metrics)
    assert (b_id, "error") in metrics.finished


def test_one_requests_own_failure_ends_it_alone_in_the_server(dec, monkeypatch):
    """A request whose sampler raises inside the step ends with an ErrorEvent (code "request_error",
    status 500, the exception named); the request beside it finishes with its greedy tokens, nothing is
    rebuilt (it was every live request ended and the engine rebuilt)."""
    want = dec.generate(PROMPT, max_new_tokens=8).token_ids
    real_new = dec.new_request

    def new_request(prompt, p, max_len, stream=0):
        req = real_new(prompt, p, max_len, stream)
        if prompt == [7, 1, 4]:
            def boom(*a):
                raise FloatingPointError("injected sampling fault")

            req.sampler.token = req.sampler.accept = boom
        return req

    monkeypatch.setattr(dec, "new_request", new_request)
    metrics = Recorder()

    async def body(w):
        a = await w.submit(PROMPT, {}, 8)
        b = await w.submit([7, 1, 4], {}, 8)
        _, ev_b = await _finish(b)
        toks_a, ev_a = await _finish(a)
        assert (toks_a, ev_a.finish_reason) == (want, "length")
        assert isinstance(ev_b, ErrorEvent) and (ev_b.code, ev_b.status) == ("request_error", 500)
        assert "FloatingPointError: injected sampling fault" in ev_b.message
        assert w.failures == 0
        return b.id

    b_id = _with_worker(dec, EngineConfig(max_batch=4, plain_run_s=0), body, metrics=metrics)
    assert (b_id, "error") in metrics.finished


@pytest.mark.parametrize(("max_running", "max_queue"), [(2, 0), (1, 1), (2, 2)])
def test_admission_takes_exactly_max_running_plus_max_queue(dec, max_running, max_queue):
    """Requests posted while the others are live: exactly max_running + max_queue are admitted, the next
    one gets CapacityError (the 429). With max_queue 0 the first request that would have to wait is
    refused. A ">" for ">=" in the worker's check admitted one more."""

    async def body(w):
        gate = Gate(w)
        first = await w.submit(PROMPT, {}, 30)
        await gate.inside()  # the first is live: the others reach the queue together
        tasks = [await _posted(w.submit(PROMPT, {}, 30)) for _ in range(max_running + max_queue + 2)]
        gate.release()
        admitted, refused = [first], []
        for t in tasks:
            try:
                admitted.append(await asyncio.wait_for(t, WAIT))
            except CapacityError as e:
                refused.append(str(e))
        assert len(admitted) == max_running + max_queue and len(refused) == 3
        assert all("retry later" in r for r in refused)
        for h in admitted:
            w.cancel(h.id)
        for h in admitted:
            await _finish(h)

    _with_worker(dec, EngineConfig(max_batch=max_running, plain_run_s=0), body, max_queue=max_queue)
