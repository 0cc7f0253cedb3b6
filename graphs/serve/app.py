"""The FastAPI application: OpenAI's routes on one engine (see graphs/serve/__init__.py for the tour).

    app = create_app("spec-demo/onnx", ServeConfig(max_running=8))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The export loads in a background thread when the app starts: ``/health`` answers 503 until the
engine is ready (and says why if loading failed), then 200 with the engine's occupancy.
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
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from graphs.errors import CapacityError, InputError
from graphs.serve.config import ServeConfig
from graphs.serve.metrics import CONTENT_TYPE, Metrics
from graphs.serve.protocol import (
    DONE,
    FINISH,
    APIError,
    Limits,
    Spec,
    bad,
    chunk,
    parse_chat,
    parse_completion,
    response,
    spec_stats,
    sse,
    usage,
)

log = logging.getLogger("graphs.serve")
INLINE_CHARS = 8192  # prompts up to this long are tokenized on the event loop, longer ones in a thread


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
        self.api_key: bytes | None = None
        if config.api_key_file:
            key = Path(config.api_key_file).read_text(encoding="utf-8").strip()
            if not key:
                raise InputError(f"{config.api_key_file} is empty: put the API key in it")
            self.api_key = key.encode()

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
        self.limits = Limits(self.model, worker.engine.max_len, cfg.max_tokens, max_tree=cfg.max_tree)
        worker.start()
        self.worker = worker
        self.metrics.gauges(worker.snapshot)
        self.status = "ready"
        log.info("serving %s (%s, %s) on the engine: %d rows of %d positions, queue %d", self.model,
                 dec.kind or "base only", cfg.provider, cfg.max_running, worker.engine.max_len, cfg.max_queue)

    def ready(self) -> None:
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
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            self.metrics.rejected.labels(self.model, "auth").inc()
            raise APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")


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
        if state.worker is not None:
            await run_in_threadpool(state.worker.stop)

    app = FastAPI(title="specexport", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        log.error("bug while answering %s:\n%s", request.url.path, traceback.format_exc())
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    async def read_json(request) -> dict:
        limit = config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body of {length} bytes is over the limit of {limit}",
                           code="body_too_large", headers={"Connection": "close"})
        parts, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large",
                               headers={"Connection": "close"})
            parts.append(piece)
        try:
            return json.loads(b"".join(parts))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    async def generate(request, kind: str):
        state.check_key(request)
        state.ready()
        body = await read_json(request)
        arrival = time.perf_counter()
        try:
            if kind == "chat":
                spec, messages = parse_chat(body, state.limits)
                if state.template is None:
                    raise bad(state.template_error, "messages", "no_chat_template")
                tok = state.dec.tokenizer
                if tok is None:
                    raise bad(f"the export {state.model} has no tokenizer.json: chat needs one", "messages")
                text = await run_in_threadpool(state.template.render, messages)
                ids = await run_in_threadpool(lambda: tok.encode(text, add_special_tokens=False).ids)
            else:
                spec = parse_completion(body, state.limits)
                if isinstance(spec.prompt, list):
                    ids = spec.prompt
                elif len(spec.prompt) <= INLINE_CHARS:  # tens of microseconds: cheaper than a thread hop
                    ids = state.dec.encode(spec.prompt)
                else:
                    ids = await run_in_threadpool(state.dec.encode, spec.prompt)
            max_new = _max_new(spec, len(ids), state.limits)
            h = await state.worker.submit(ids, spec.params, max_new, deadline_s=config.request_timeout,
                                          arrival=arrival)
        except APIError as e:
            state.metrics.rejected.labels(state.model, "bad_request" if e.status == 400 else str(e.status)).inc()
            raise
        except InputError as e:
            state.metrics.rejected.labels(state.model, "bad_request").inc()
            raise bad(str(e)) from None
        except CapacityError as e:
            state.metrics.rejected.labels(state.model, "capacity").inc()
            raise APIError(429, f"the server is full ({config.max_running} running, {config.max_queue} "
                           f"waiting): {e}", code="server_full",
                           headers={"Retry-After": str(config.retry_after)}) from None
        if spec.stream:
            return StreamingResponse(stream(h, spec), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, h, spec)

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
        if ev.finish_reason == "error":
            raise APIError(500, ev.message, code="engine_error")
        if ev.finish_reason == "cancelled":  # the client left: nobody reads this
            return Response(status_code=499)
        use = usage(h.prompt_tokens, ev.stats.new_tokens)
        return JSONResponse(response(spec, state.model, "".join(texts), FINISH[ev.finish_reason], use,
                                     spec_stats(ev.stats, h.speculation)))

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
                if ev.finish_reason == "error":
                    yield sse(APIError(500, ev.message, code="engine_error").body())
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
                  f"completion). Please reduce the length of the {where} or completion.", where,
                  "context_length_exceeded")
    return spec.max_tokens


async def _on_disconnect(request, callback) -> None:
    """Call ``callback`` when the client disconnects (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            callback()
            return
