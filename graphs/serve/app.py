"""The FastAPI application: OpenAI's routes on one engine (see graphs/serve/__init__.py for the tour).

    app = create_app("spec-demo/onnx", ServeConfig(max_running=8))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The export loads in a background thread when the app starts: ``/health`` answers 503 until the
engine is ready (and says why if loading failed), then 200 with the engine's occupancy.

A request, in order, each step refusing before the next costs anything: the key (401), readiness
(503), admission (429 when running + waiting + being prepared reach max_running + max_queue), the
body (413 from Content-Length and as it arrives, 408 past body_timeout), JSON (400 for anything
unreadable, protocol.loads), the parameters and message count (400), the prompt's length in
characters (400: it cannot fit the context), then rendering and tokenizing in a small bounded pool
(429 when its queue is full), then the engine (its own 429 at the exact limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from graphs.errors import CapacityError, InputError
from graphs.serve.config import ServeConfig
from graphs.serve.metrics import CONTENT_TYPE, Metrics, finished_reason
from graphs.serve.protocol import (
    DONE,
    FINISH,
    APIError,
    Limits,
    Spec,
    bad,
    chunk,
    loads,
    parse_chat,
    parse_completion,
    response,
    spec_stats,
    sse,
    usage,
)

log = logging.getLogger("graphs.serve")
INLINE_CHARS = 8192  # prompts up to this long are tokenized on the event loop, longer ones in the pool
PROMPT_CHARS_SLACK = 2  # max_prompt_chars = max_len x the longest token's characters x this (a normalizer
# may drop characters before tokenizing; the bound only has to refuse what can never fit)
REJECT_REASONS = {400: "bad_request", 401: "auth", 404: "not_found", 405: "bad_method", 408: "timeout",
                  413: "body_too_large", 429: "capacity", 499: "client_left", 500: "internal",
                  503: "unavailable"}


class ErrorJSONResponse(JSONResponse):
    """Error bodies as ASCII JSON: they may quote what a client sent, and no client text can then
    break the response (a lone surrogate cannot be encoded as UTF-8)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":"), default=repr).encode()


class PrepPool:
    """Chat template rendering and tokenizing of long prompts, off the event loop, bounded: ``threads``
    at work and ``queue`` waiting; one more is a 429 (``server_busy``) before any of its work is done.
    Tokenizing goes through ``encode_batch``, which releases the GIL (``encode`` holds it: a 1 MB
    prompt stalled the event loop for half a second)."""

    def __init__(self, threads: int, queue: int):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="prep")
        self.limit = threads + queue
        self.busy = 0
        self._lock = threading.Lock()

    async def run(self, fn, *args, retry_after: int = 1):
        with self._lock:
            if self.busy >= self.limit:
                raise APIError(429, f"the server is busy preparing {self.busy} prompts (at most {self.limit}); "
                               "retry later", code="server_busy", headers={"Retry-After": str(retry_after)})
            self.busy += 1
        fut = self.pool.submit(fn, *args)
        fut.add_done_callback(self._done)  # counted until the thread is done, even if its client left
        return await asyncio.wrap_future(fut)

    def _done(self, fut) -> None:
        with self._lock:
            self.busy -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Ending:
    """A last event the app puts in a request's queue itself (the server is shutting down)."""

    def __init__(self, error: APIError):
        self.error, self.text, self.token_ids, self.stats = error, "", [], None
        self.finish_reason = "error"
        self.message = error.message


class ServerState:
    """What the routes share: the decoder, the engine's worker, metrics, the chat template."""

    def __init__(self, out_dir, config: ServeConfig):
        self.out_dir, self.config = Path(out_dir), config
        self.model = config.served_model_name or self.out_dir.resolve().name
        self.metrics = Metrics(self.model)
        self.status, self.error = "loading", None
        self.dec = self.worker = self.template = self.limits = None
        self.template_error: str | None = None
        self.created = int(time.time())
        self.api_key: bytes | None = read_api_key(config.api_key_file) if config.api_key_file else None
        self.prep = PrepPool(config.prep_threads, config.prep_queue)
        self.preparing = 0  # requests past admission, not yet on the engine (the event loop's count)
        self.handles: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # live requests by id
        self.draining = False

    def load(self) -> None:
        """Load the export and start the engine's thread (the loader thread)."""
        import graphs
        from graphs.chat import ChatTemplate
        from graphs.engine import EngineConfig
        from graphs.serve.worker import Worker

        cfg = self.config
        verify = {"auto": "auto", "true": True, "false": False}.get(str(cfg.verify).lower(), cfg.verify)
        if cfg.shared_pool and cfg.provider != "cuda":
            from graphs.sessions import use_shared_thread_pool

            use_shared_thread_pool(cfg.threads)  # the server owns its process: one pool for base, draft, K/V
        dec = graphs.load(self.out_dir, provider=cfg.provider, threads=cfg.threads, verify=verify,
                          eagle_draft=cfg.eagle_draft, adaptive=cfg.adaptive)
        ecfg = EngineConfig(max_batch=cfg.max_running, max_len=cfg.max_model_len, prefill_chunk=cfg.prefill_chunk,
                            step_tokens=cfg.step_tokens, max_tree=cfg.max_tree, plain_run_s=cfg.plain_run_s)
        worker = Worker(dec, ecfg, self.metrics, max_queue=cfg.max_queue)
        try:
            self.template = ChatTemplate.from_export(self.out_dir, time_limit=cfg.template_timeout,
                                                     max_chars=cfg.template_max_chars)
        except InputError as e:
            self.template_error = str(e)
            log.warning("chat completions are off: %s", e)
        if self.template is None and self.template_error is None:
            self.template_error = (f"the export {self.model} has no chat template (chat_template.jinja or "
                                   f"tokenizer_config.json's chat_template); use /v1/completions")
        if cfg.max_running > 1:  # batches of trees run the base graph: load it now, not mid-traffic
            dec.load_sessions()
        dec.generate([1], max_new_tokens=2)  # the first call of each graph is slow: not a user's
        self.dec = dec
        max_len = worker.engine.max_len
        self.limits = Limits(self.model, max_len, cfg.max_tokens, max_tree=cfg.max_tree, max_messages=cfg.max_messages,
                             max_prompt_chars=max_len * longest_token(dec.tokenizer) * PROMPT_CHARS_SLACK)
        worker.start()
        self.worker = worker
        self.metrics.gauges(worker.snapshot)
        self.status = "ready"
        log.info("serving %s (%s, %s) on the engine: %d rows of %d positions, queue %d", self.model,
                 dec.kind or "base only", cfg.provider, cfg.max_running, worker.engine.max_len, cfg.max_queue)

    def ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(self.config.retry_after), "Connection": "close"})
        if self.status != "ready":
            raise APIError(503, f"the model is {self.status}" + (f": {self.error}" if self.error else ""),
                           code="model_not_ready", headers={"Retry-After": str(self.config.retry_after)})
        if not self.worker.alive:
            raise APIError(503, "the engine thread is not running", code="engine_stopped")

    def check_key(self, request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            raise APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")


    def admit(self) -> None:
        """429 before any work when the engine's running + waiting + those being prepared reach its
        capacity (the worker counts the exact limit again when the request reaches it)."""
        cfg, snap = self.config, self.worker.snapshot
        live = snap.get("live", snap.get("running", 0) + snap.get("waiting", 0))
        if live + self.preparing >= cfg.max_running + cfg.max_queue:
            raise APIError(429, f"the server is full ({cfg.max_running} running, {cfg.max_queue} waiting, "
                           f"{self.preparing} being prepared); retry later", code="server_full",
                           headers={"Retry-After": str(cfg.retry_after)})

    def drain(self, grace: float) -> None:
        """Shutdown begins (the event loop): new requests 503; requests still running when ``grace``
        is nearly over end with an error the client can read (stream: an error chunk and [DONE]),
        before the server cancels what is left (which would cut streams and answer plain-text 500s)."""
        self.draining = True
        margin = min(1.0, grace / 4)
        asyncio.get_running_loop().call_later(max(grace - margin, 0.0), self.end_all)

    def end_all(self) -> None:
        error = APIError(503, "the server is shutting down before this request finished; retry on another "
                         "server or later", code="server_shutting_down")
        for h in list(self.handles.values()):
            if not h.done:
                h.queue.put_nowait(Ending(error))
                with contextlib.suppress(RuntimeError):
                    self.worker.cancel(h.id)


def read_api_key(path) -> bytes:
    """The key in ``path``: printable ASCII (an HTTP header carries it; a non-ASCII key could never
    match and every request would be a 401), or a one-line InputError."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise InputError(f"cannot read the API key file {path}: {e.strerror or e}") from None
    if not key:
        raise InputError(f"{path} is empty: put the API key in it")
    if not all(33 <= b <= 126 for b in key):
        raise InputError(f"{path}: the API key must be printable ASCII without spaces (an HTTP header carries "
                         "it); make one with: python -c 'import secrets; print(secrets.token_urlsafe())'")
    return key


def longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token (a prompt of n characters has at least n / this
    tokens); 64 without a tokenizer (token-id prompts only)."""
    if tokenizer is None:
        return 64
    return max((len(t) for t in tokenizer.get_vocab()), default=64)


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids``, through encode_batch: the same ids, and the GIL released."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def create_app(out_dir, config: ServeConfig | None = None, on_load_failure=None, state: ServerState | None = None):
    """The app; the export loads in the background when it starts (unless ``state`` is already
    loaded: the Ray deployment loads before it takes traffic). ``on_load_failure(message)``: called
    if it cannot load."""
    config = config or ServeConfig()
    state = state or ServerState(out_dir, config)

    def loader():
        try:
            state.load()
        except Exception as e:
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"
            if isinstance(e, InputError):
                log.error("cannot serve %s: %s", out_dir, e)
            else:
                log.error("loading %s failed:\n%s", out_dir, traceback.format_exc())
            if on_load_failure is not None:
                on_load_failure(state.error)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.status == "loading":
            threading.Thread(target=loader, name="loader", daemon=True).start()
        yield
        state.prep.shutdown()
        if state.worker is not None:
            await run_in_threadpool(state.worker.stop)

    app = FastAPI(title="specexport", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    def refuse(e: APIError) -> ErrorJSONResponse:
        state.metrics.reject(e.code if e.code in ("server_busy", "server_shutting_down") else
                             REJECT_REASONS.get(e.status, str(e.status)))
        return ErrorJSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return refuse(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return refuse(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        log.error("bug while answering %s:\n%s", request.url.path, traceback.format_exc())
        return refuse(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    async def read_json(request):
        limit = config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body of {length} bytes is over the limit of {limit}",
                           code="body_too_large")  # (the connection stays: the rest is read and dropped,
            # under the body timeout; closing over unread bytes would reset it and lose this answer)

        async def read() -> bytes:
            parts, size = [], 0
            async for piece in request.stream():
                size += len(piece)
                if size > limit:
                    raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
                parts.append(piece)
            return b"".join(parts)

        try:  # (uvicorn's protocol times the body too, connections.py; this holds behind any server)
            raw = await asyncio.wait_for(read(), config.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {config.body_timeout:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise APIError(499, "the client left before sending its body", code="client_left") from None
        return loads(raw)

    async def generate(request, kind: str):
        state.check_key(request)
        state.ready()
        state.admit()
        state.preparing += 1
        try:
            body = await read_json(request)
            arrival = time.perf_counter()
            spec, ids = await prepare(body, kind)
            max_new = _max_new(spec, len(ids), state.limits)
            h = await state.worker.submit(ids, spec.params, max_new, deadline_s=config.request_timeout,
                                          arrival=arrival)
        except RecursionError:  # a deep value reached a check that recurses (protocol.loads caps depth)
            raise bad("the request body is nested too deeply", code="invalid_json") from None
        except InputError as e:
            raise bad(str(e)) from None
        except CapacityError as e:
            raise APIError(429, f"the server is full ({config.max_running} running, {config.max_queue} "
                           f"waiting): {e}", code="server_full",
                           headers={"Retry-After": str(config.retry_after)}) from None
        finally:
            state.preparing -= 1
        state.handles[h.id] = h
        if spec.stream:
            return StreamingResponse(stream(h, spec), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, h, spec)

    async def prepare(body, kind: str):
        """The checked request and its prompt's token ids; what costs (rendering, long prompts) in the pool."""
        limits = state.limits
        if kind == "chat":
            spec, messages = parse_chat(body, limits)
            if state.template is None:
                raise bad(state.template_error, "messages", "no_chat_template")
            tok = state.dec.tokenizer
            if tok is None:
                raise bad(f"the export {state.model} has no tokenizer.json: chat needs one", "messages")
            ids = await state.prep.run(render_and_encode, messages, retry_after=config.retry_after)
            return spec, ids
        spec = parse_completion(body, limits)
        if isinstance(spec.prompt, list):
            return spec, spec.prompt
        too_long(spec.prompt, "prompt")
        if len(spec.prompt) <= INLINE_CHARS or state.dec.tokenizer is None:  # tens of microseconds: inline
            return spec, state.dec.encode(spec.prompt)
        return spec, await state.prep.run(encode, state.dec.tokenizer, spec.prompt, True,
                                          retry_after=config.retry_after)

    def too_long(text: str, where: str) -> None:
        cap = state.limits.max_prompt_chars
        if cap is not None and len(text) > cap:
            raise bad(f"This model's maximum context length is {state.limits.max_len} tokens. However, your {where} "
                      f"has {len(text)} characters, more than any {state.limits.max_len} tokens of this tokenizer "
                      f"span. Please shorten it.", where, "context_length_exceeded")

    def render_and_encode(messages) -> list[int]:  # (a prep thread)
        text = state.template.render(messages)
        too_long(text, "messages")
        return encode(state.dec.tokenizer, text, False)

    async def collect(request, h, spec: Spec):
        watcher = asyncio.create_task(_on_disconnect(request, lambda: state.worker.cancel(h.id)))
        texts, ev = [], None
        try:
            while True:
                ev = await h.queue.get()
                texts.append(ev.text)
                if ev.finish_reason is not None:
                    break
        finally:
            watcher.cancel()
            if ev is None or ev.finish_reason is None:  # cancelled (the client left, or shutdown)
                state.worker.cancel(h.id)
        error = failure(h, ev)
        if error is not None:
            return ErrorJSONResponse(error.body(), status_code=error.status, headers=error.headers)
        if ev.finish_reason == "cancelled":  # the client left: nobody reads this
            return Response(status_code=499)
        use = usage(h.prompt_tokens, ev.stats.new_tokens)
        return JSONResponse(response(spec, state.model, "".join(texts), FINISH[ev.finish_reason], use,
                                     spec_stats(ev.stats, h.speculation)))

    def failure(h, ev) -> APIError | None:
        """The error a last event means, if any (counted as finished_reason="error" once): the engine
        failed (500), the server is shutting down (503), the deadline passed before any token, i.e.
        while the request waited for a row (503, not a 200 with no text), or a reason this server
        does not know (500)."""
        reason = ev.finish_reason
        if isinstance(ev, Ending):
            error = ev.error
        elif reason == "error":  # the worker's ErrorEvent: its status and code when it has them
            status = getattr(ev, "status", None) or 500
            error = APIError(status, getattr(ev, "message", None) or "the engine failed",
                             code=getattr(ev, "code", None) or "engine_error",
                             headers={"Retry-After": str(config.retry_after)} if status in (429, 503) else None)
        elif finished_reason(ev) == "error":
            if "timeout" in str(reason) or "deadline" in str(reason):
                error = APIError(503, f"timeout while queued: the request's {config.request_timeout:g} s timeout "
                                 "passed before its first token (the server is busy); retry later",
                                 code="queue_timeout", headers={"Retry-After": str(config.retry_after)})
            else:
                error = APIError(500, f"the engine ended the request with {reason!r}", code="engine_error")
        else:
            return None
        state.metrics.finished(h, "error")
        return error

    async def stream(h, spec: Spec):
        finished = False
        model = state.model
        try:
            if spec.kind == "chat":
                yield sse(chunk(spec, model, None, role=True))
            while True:
                ev = await h.queue.get()
                text = ev.text
                while ev.finish_reason is None and not h.queue.empty():  # a slow reader: one chunk for all
                    ev = h.queue.get_nowait()
                    text += ev.text
                if ev.finish_reason is None:
                    if text:
                        yield sse(chunk(spec, model, text))
                    continue
                finished = True
                error = failure(h, ev)
                if error is not None:
                    if text:
                        yield sse(chunk(spec, model, text))
                    yield sse(error.body())
                    yield DONE
                    return
                if ev.finish_reason == "cancelled":
                    return
                stats = spec_stats(ev.stats, h.speculation)
                finish = FINISH[ev.finish_reason]
                if spec.kind == "chat":
                    if text:
                        yield sse(chunk(spec, model, text))
                    yield sse(chunk(spec, model, None, finish, stats=stats))
                else:
                    yield sse(chunk(spec, model, text, finish, stats=stats))
                if spec.include_usage:
                    yield sse(chunk(spec, model, None, use=usage(h.prompt_tokens, ev.stats.new_tokens), stats=stats,
                                    no_choice=True))
                yield DONE
                return
        finally:
            if not finished:  # the client left (the generator was cancelled or closed)
                state.worker.cancel(h.id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_key(request)
        data = [{"id": state.model, "object": "model", "created": state.created, "owned_by": "specexport",
                 "root": state.model, "parent": None,
                 "max_model_len": state.limits.max_len if state.limits else None}]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if state.status != "ready" or not state.worker.alive:
            body = {"status": state.status if state.status != "ready" else "engine stopped", "error": state.error}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(config.retry_after)})
        return {"status": "ok", "model": state.model, **state.worker.snapshot, "engine_failures": state.worker.failures,
                "pid": os.getpid()}

    @app.get("/metrics")
    async def metrics():
        if state.worker is not None:
            state.metrics.gauges(state.worker.snapshot)
            state.metrics.times(state.worker.step_seconds, state.worker.worker_seconds)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _max_new(spec: Spec, n_prompt: int, limits: Limits) -> int:
    """New tokens for this request: asked for (checked against the context), else the room left."""
    if n_prompt == 0:
        raise bad("the prompt is empty after tokenization", "prompt" if spec.kind == "completion" else "messages")
    where = "messages" if spec.kind == "chat" else "prompt"
    room = limits.max_len - n_prompt
    if spec.max_tokens is None:
        if room < 1:
            raise bad(f"This model's maximum context length is {limits.max_len} tokens. However, your {where} "
                      f"has {n_prompt} tokens, which leaves no room for a completion. Please shorten it.",
                      where, "context_length_exceeded")
        return min(room, limits.max_tokens or room)
    if n_prompt + spec.max_tokens > limits.max_len:
        raise bad(f"This model's maximum context length is {limits.max_len} tokens. However, you requested "
                  f"{n_prompt + spec.max_tokens} tokens ({n_prompt} in the {where}, {spec.max_tokens} in the "
                  f"completion). Please reduce the length of the {where} or completion ({spec.max_tokens_param}).",
                  spec.max_tokens_param if n_prompt < limits.max_len else where, "context_length_exceeded")
    return spec.max_tokens


async def _on_disconnect(request, callback) -> None:
    """Call ``callback`` when the client disconnects (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            callback()
            return
