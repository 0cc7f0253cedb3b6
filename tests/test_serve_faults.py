"""The server under faults: it stays up, frees every row, and every request it accepted completes or
ends with a clear error.

Through a server on a loopback port (as test_serve): 100 of 200 streaming clients disconnecting at
random points, malformed JSON, bodies over the size limit, a client that reads its stream very slowly.
Through uvicorn in this process (its engine held while a client leaves, so no timing decides the
outcome): a disconnect mid-stream through the openai client and one of a non-streamed request. In-process
(FastAPI's test client): /health 503 while loading, a failing engine step (a 500, or an error chunk
and [DONE] in a stream; then the next request served by a rebuilt engine), the per-request deadline
and the max_tokens ceiling, an export that cannot load. 4x more concurrent requests than the cap
and a prompt over the context are in test_serve (test_overload_is_429_with_retry_after,
test_prompt_over_the_context).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import run_module
from serve_helpers import Server, free_port, metric, with_chat_template

for _name in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):  # the serve extra (also in dev)
    pytest.importorskip(_name)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

PROMPT = "def main("
BOUND_S = 30.0  # the most any wait here lasts: a bound for a hung server, never a timing under test


@pytest.fixture(scope="module")
def export_dir(exported, tmp_path_factory):
    return with_chat_template(exported("medusa"), tmp_path_factory.mktemp("faults") / "tiny-medusa")


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    with Server(export_dir, tmp_path_factory.mktemp("server"), "--max-running", "8", "--max-queue", "256",
                "--max-body-bytes", "4096") as s:
        yield s


def _still_serves(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_200_streams_half_of_them_disconnecting(server):
    rng = random.Random(0)
    # a leaver asks for 480 tokens: it most likely leaves early (its row freed, an abort), though on a
    # fast machine it may get them all before the server reads its FIN (a length); either is right
    plans = [{"max_tokens": 480, "leave_after": rng.randint(0, 6)} if i % 2
             else {"max_tokens": rng.randint(4, 40), "leave_after": None} for i in range(200)]
    rng.shuffle(plans)

    async def one(c, plan):
        body = {"prompt": PROMPT, "max_tokens": plan["max_tokens"], "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if plan["leave_after"] is not None and len(events) > plan["leave_after"]:
                    return None  # leaves: the context closes the connection mid-stream
        return events

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=200, max_keepalive_connections=0)) as c:
            return await asyncio.gather(*[one(c, p) for p in plans])

    before = server.metrics()
    results = asyncio.run(main())
    stayed = [(p, ev) for p, ev in zip(plans, results) if p["leave_after"] is None]
    assert len(stayed) == 100
    for plan, events in stayed:
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][6:])["usage"]
        assert usage["completion_tokens"] == plan["max_tokens"]
    health = server.wait_idle()
    assert health["kv_allocated_bytes"] == 0 and health["engine_failures"] == 0
    after = server.metrics()
    name = "vllm:request_success_total"
    aborted = metric(after, name, finished_reason="abort") - metric(before, name, finished_reason="abort")
    finished = metric(after, name, finished_reason="length") - metric(before, name, finished_reason="length")
    # each left early, or after its last token (no lower bound: whether a leaver's FIN comes before its
    # last token is a race; the two tests below make an abort certain)
    assert aborted + finished == 200 and aborted <= 100
    _still_serves(server)


class _Held:
    """Hooks an in-process server's engine: once a step gave a request a token, the next step waits
    (the request holds its row, unfinished, on a machine of any speed) until ``leave()``: that one
    returns no events without running, so the worker applies the commands posted meanwhile (the
    cancel of a client that left) before the engine runs again; later steps run as usual."""

    def __init__(self, state):
        self.worker, self.engine = state.worker, state.worker.engine
        self.holding, self.go, self.cancelled = threading.Event(), threading.Event(), threading.Event()
        self.cancels: list[int] = []
        step, cancel = self.engine.step, self.worker.cancel
        armed = False

        def held_step():
            nonlocal armed
            if armed and not self.go.is_set():
                self.holding.set()
                assert self.go.wait(BOUND_S), "the test never let the engine go"
                armed = False
                return []
            events = step()
            armed = armed or (not self.go.is_set() and any(ev.token_ids for ev in events))
            return events

        def cancelling(request_id):
            cancel(request_id)
            self.cancels.append(request_id)
            self.cancelled.set()

        self.engine.step, self.worker.cancel = held_step, cancelling

    def wait_holding(self) -> None:
        assert self.holding.wait(BOUND_S), "no step gave a token"

    def leave(self) -> None:
        """After the server cancelled the request (its client left): the engine goes on."""
        assert self.cancelled.wait(BOUND_S), "the server never cancelled the request of the client that left"
        self.go.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.go.set()
        del self.engine.step, self.worker.cancel  # the instance's hooks: the class's methods again


class _Live:
    """The app under uvicorn (graphs.serve's make_server: its connection handling) on a loopback port,
    in this process: its engine can be held (_Held) where a subprocess could only be stopped whole."""

    def __init__(self, export_dir):
        from graphs.serve import ServeConfig, create_app
        from graphs.serve.__main__ import make_server

        config = ServeConfig(port=free_port(), threads=1, shared_pool=False, max_running=8, max_queue=256)
        self.app = create_app(export_dir, config)
        self.url = f"http://127.0.0.1:{config.port}"
        self.uvicorn = make_server(self.app, config, "warning")
        self.thread = threading.Thread(target=self.uvicorn.run, name="uvicorn", daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + BOUND_S * 3
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process server never came up"
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(BOUND_S)

    @property
    def state(self):
        return self.app.state.serve

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=BOUND_S).json()

    def aborted(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=BOUND_S).text
        return metric(text, "vllm:request_success_total", finished_reason="abort")

    def wait_idle(self) -> dict:
        deadline = time.monotonic() + BOUND_S
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["live"] == 0:
                return h
            assert time.monotonic() < deadline, f"the server is not idle: {h}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def live(export_dir):
    with _Live(export_dir) as s:
        yield s


def test_disconnect_mid_stream_frees_the_row(live):
    """A stream closed while its request holds a row and has tokens to go (the engine held meanwhile,
    so it cannot finish first): the server cancels it, the row is freed, an abort is counted."""
    before = live.aborted()
    with openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=BOUND_S) as c:
        model = c.models.list().data[0].id
        with _Held(live.state) as held:
            stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=480, stream=True,
                                          extra_body={"ignore_eos": True})  # (returns once the headers came)
            held.wait_holding()  # it has tokens, 479 at most of them, and its row
            h = live.health()
            assert h["running"] == 1 and h["live"] == 1, h
            stream.close()  # mid-stream: what the engine said so far may be unread
            held.leave()
            h = live.wait_idle()
        assert h["kv_allocated_bytes"] == 0 and held.cancels
        assert live.aborted() == before + 1
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 6


def test_a_non_streamed_client_that_leaves_frees_its_row(live):
    """A non-streamed request whose client times out while the request holds a row (the engine held
    until the client has certainly left): the server cancels it, frees the row, counts an abort."""
    before = live.aborted()
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with _Held(live.state) as held, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=0.5)
        held.wait_holding()
        with pytest.raises(httpx.TimeoutException):  # nothing can answer it while the engine is held
            fut.result(BOUND_S)
        held.leave()
        h = live.wait_idle()
    assert h["kv_allocated_bytes"] == 0 and held.cancels
    assert live.aborted() == before + 1
    r = httpx.post(live.url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=BOUND_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("body", [b"{bad", b"[1, 2]", b"", b'{"prompt": "x", "max_tokens": 4', b"\xff\xfe{}",
                                  b'"just a string"', b"null"])
def test_malformed_json_is_a_400(server, body):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=10)
    assert r.status_code == 400


def test_a_body_over_the_limit_is_a_413(server):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 4}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=10)
    assert r.status_code == 413 and "over the limit of 4096" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=10)
    assert r.status_code == 413
    _still_serves(server)


def test_a_slow_reader_holds_no_row(server):
    """A client reading its stream a few hundred bytes at a time: its request finishes in the engine
    (the row freed) long before it has read its stream, others are served meanwhile, and it gets
    every chunk and [DONE] in the end."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    data = s.recv(256)
    assert data.startswith(b"HTTP/1.1 200")
    server.wait_idle(timeout=10)  # its tokens are all generated; most are still unread
    _still_serves(server)
    s.settimeout(10)
    while True:
        time.sleep(0.01)
        piece = s.recv(512)
        if not piece:
            break
        data += piece
    s.close()
    text = _dechunk(data.split(b"\r\n\r\n", 1)[1]).decode()
    assert text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0


def _dechunk(raw: bytes) -> bytes:
    """HTTP/1.1 chunked transfer coding, undone."""
    out, i = b"", 0
    while True:
        j = raw.index(b"\r\n", i)
        n = int(raw[i:j], 16)
        if n == 0:
            return out
        out += raw[j + 2 : j + 2 + n]
        i = j + 2 + n + 2


def test_hostile_chat_messages_do_not_break_the_server(server):
    for messages in ([{"role": "user", "content": "{{ 7 * 7 }}{% for x in range(9) %}"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "tool", "content": "x"}], [{"content": "no role"}], []):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=10)
        if messages and isinstance(messages[0].get("content"), str) and messages[0].get("role") == "user":
            assert r.status_code == 200  # message text is data, never template code
        else:
            assert r.status_code == 400, r.text


# ---------------------------------------------------------------------- in-process


def _client(export_dir, **kw):
    from starlette.testclient import TestClient

    from graphs.serve import ServeConfig, create_app

    # shared_pool=False: ONNX Runtime's shared pool is process-wide, and this process runs other tests
    return TestClient(create_app(export_dir, ServeConfig(threads=1, shared_pool=False, **kw)))


def test_health_is_503_while_loading(export_dir, monkeypatch):
    from graphs.serve.app import ServerState

    gate = threading.Event()
    real = ServerState.load

    def slow_load(self):
        gate.wait(30)
        real(self)

    monkeypatch.setattr(ServerState, "load", slow_load)
    with _client(export_dir) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        gate.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def _ready(c):
    state = c.app.state.serve
    deadline = time.monotonic() + 30
    while state.status != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return state


def _break(state):
    def boom():
        raise RuntimeError("injected fault")

    state.worker.engine.step = boom
    return state.worker.engine


def test_a_failing_engine_step_is_a_500_then_the_engine_is_rebuilt(export_dir):
    with _client(export_dir) as c:
        state = _ready(c)
        broken = _break(state)
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        assert state.worker.engine is not broken and state.worker.failures == 1
        _break(state)
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"  # a stream that fails says so, then ends
        assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert c.get("/health").json()["engine_failures"] == 2


def test_deadline_and_max_tokens_ceiling(export_dir):
    with _client(export_dir, request_timeout=2, max_tokens=480) as c:
        engine = _ready(c).worker.engine
        step, waited = engine.step, []

        def slow_step():  # after its first tokens, the request's deadline passes before the next step
            events = step()
            for ev in events:
                req = engine.request(ev.request_id)
                if not waited and ev.token_ids and ev.finish_reason is None and req is not None:
                    waited.append(len(ev.token_ids))
                    while time.perf_counter() <= req.deadline:
                        time.sleep(req.deadline - time.perf_counter() + 1e-3)
            return events

        engine.step = slow_step
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True})
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert waited and 0 < body["usage"]["completion_tokens"] < 480  # cut by the deadline, after its tokens
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 481})
        assert r.status_code == 400 and "ceiling of 480" in r.json()["error"]["message"]
    with _client(export_dir, max_tokens=7) as c:
        _ready(c)
        r = c.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})  # no max_tokens: the ceiling
        assert r.json()["usage"]["completion_tokens"] == 7


def test_an_export_that_cannot_load(tmp_path):
    with _client(tmp_path / "missing") as c:
        deadline = time.monotonic() + 30
        while c.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "missing" in r.json()["error"]
    proc = run_module("graphs.serve", tmp_path / "missing", "--port", "0", timeout=60)
    assert proc.returncode == 2 and "error: cannot serve" in proc.stderr


def test_a_bad_plain_run_is_refused_in_one_line(tmp_path):
    from graphs.errors import InputError
    from graphs.serve.config import ServeConfig

    with pytest.raises(InputError, match=r"plain_run_s must be a number of seconds in \[0, 60\], got -1"):
        ServeConfig(plain_run_s=-1)
    proc = run_module("graphs.serve", tmp_path, "--plain-run-s", "-1", timeout=60)
    assert proc.returncode != 0 and "plain_run_s must be a number of seconds" in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) <= 2, proc.stderr
