"""An OpenAI-compatible server on the engine (graphs.engine), torch-free: FastAPI + uvicorn.

    python -m graphs.serve OUT_DIR [--host 127.0.0.1] [--port 8000] [--max-running 8] [--max-queue 64]

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the export's chat template, rendered
sandboxed by :mod:`graphs.chat`), ``GET /v1/models``, ``GET /health`` (503 while loading, 200 when
ready), ``GET /metrics`` (Prometheus, vLLM's names: :mod:`graphs.serve.metrics`).

The parts, one idea each:

    protocol   OpenAI bodies checked into engine arguments (400s that name the parameter), responses,
               stream chunks, error bodies; no web framework (shared with the Ray deployment)
    worker     the engine's thread: adds, cancels and steps; events to each request's asyncio queue
    metrics    the Prometheus registry, observed on the engine's thread
    app        the FastAPI routes: auth, body limits, admission (429), streaming (SSE), disconnects
    loadgen    a load generator of our own: vLLM's serving metrics, closed loop and Poisson
    ray_app    the same routes as a Ray Serve deployment, one engine per replica (extra ``[ray]``)

Install with the ``serve`` extra (``pip install -e .[cpu,serve]``); docs/serve.md is the guide.
"""

from __future__ import annotations

from graphs.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(out_dir, config: ServeConfig | None = None, on_load_failure=None):
    from graphs.serve.app import create_app as make

    return make(out_dir, config, on_load_failure)
