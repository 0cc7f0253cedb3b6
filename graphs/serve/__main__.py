"""``python -m graphs.serve OUT_DIR [flags]``: the OpenAI-compatible server (see graphs/serve/__init__.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from graphs.errors import InputError
from graphs.serve.config import ServeConfig

log = logging.getLogger("graphs.serve")

FLAGS = {  # field -> help (the dataclass holds the defaults and the long explanations)
    "host": "address to bind (default 127.0.0.1: loopback only)",
    "port": "port (default 8000; 0: a free one, printed at start)",
    "provider": "ONNX Runtime provider: cpu, cuda, auto (default cpu)",
    "threads": "ONNX Runtime intra-op threads (default 2)",
    "max_running": "requests decoding at once: the engine's K/V rows (default 8)",
    "max_queue": "requests waiting for a row; beyond them 429 with Retry-After (default 64)",
    "max_model_len": "positions per request, prompt + completion (default: the model's context, <= 2048)",
    "max_tokens": "ceiling of a request's max_tokens, 400 above it; the default when a request sets none "
                  "(default: the room the prompt leaves)",
    "request_timeout": "seconds a request may run from arrival (default 300)",
    "api_key_file": "file holding the API key; /v1 routes then need 'Authorization: Bearer <key>' (default: no key)",
    "served_model_name": "model id in /v1/models and responses (default: the export directory's name)",
    "max_body_bytes": "largest request body; larger is a 413 (default 1 MiB)",
    "max_messages": "chat messages a request may hold; more is a 400 (default 1024)",
    "header_timeout": "seconds a connection may take to send a request's headers; then 408, closed (default 10)",
    "body_timeout": "seconds a request may take to send its body after its headers; then 408, closed (default 30)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open (default 30)",
    "max_connections": "open connections at most; one more gets a 503 and is closed (default 512, lowered to "
                       "the open-file limit - 192)",
    "graceful_timeout": "on SIGTERM: seconds in-flight requests may finish in; then each ends with an error "
                        "body or error chunk + [DONE] (default 30)",
    "prep_threads": "threads that render chat templates and tokenize long prompts (default 1)",
    "prep_queue": "requests that may wait for them; beyond: 429 (default 8)",
    "prefill_chunk": "prompt tokens per prefill call (default 64)",
    "step_tokens": "token budget of one engine step (default 256)",
    "max_tree": "largest tree (nodes) a request may ask for (default 64)",
    "plain_run_s": "seconds of autoregressive steps run in a row while nothing arrives or ends "
                   "(default 0.01; 0: one step at a time)",
    "retry_after": "seconds in a 429's Retry-After header (default 1)",
    "template_timeout": "seconds a chat template may render for (default 1)",
    "template_max_chars": "characters a rendered chat template may reach (default 1 Mi)",
    "eagle_draft": "EAGLE drafting: auto, one_call, stepwise (default auto)",
    "verify": "manifest sha256 check at load: auto, true, false (default auto)",
}


def parse_args(argv=None) -> tuple[str, ServeConfig, str]:
    p = argparse.ArgumentParser(prog="python -m graphs.serve", description=__doc__)
    p.add_argument("out_dir", help="an export directory (python -m exporter.export ...)")
    defaults = ServeConfig()
    for f in dataclasses.fields(ServeConfig):
        if f.name not in FLAGS:
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=getattr(defaults, f.name),
                       help=FLAGS[f.name])
    p.add_argument("--no-shared-pool", action="store_true",
                   help="a thread pool per ONNX Runtime session (default: one shared pool, as the CLIs)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="default speculation 'on' instead of 'adaptive' (requests may still choose)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's and the server's logging (default info; debug adds the access log)")
    a = vars(p.parse_args(argv))
    out_dir, level = a.pop("out_dir"), a.pop("log_level")
    a["adaptive"] = not a.pop("no_adaptive")
    a["shared_pool"] = not a.pop("no_shared_pool")
    return out_dir, ServeConfig(**a), level


def main(argv=None) -> int:
    try:
        out_dir, config, level = parse_args(argv)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs fastapi, uvicorn, prometheus-client and jinja2: pip install fastapi uvicorn "
              "prometheus-client jinja2 (torch-free; in a dev checkout: pip install -e '.[cpu,serve]')",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from graphs.serve.app import create_app

    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_failure(message):
        failed.append(message)
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(out_dir, config, on_load_failure=on_failure)
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = make_server(app, config, level)
    server.run()
    if failed:
        print(f"error: cannot serve {out_dir}: {failed[0]}", file=sys.stderr)
        return 2
    return 0


def make_server(app, config: ServeConfig, level: str = "info"):
    """uvicorn with the connection limits of graphs.serve.connections and a shutdown that ends the
    requests still running with an error the client can read (ServerState.drain)."""
    import uvicorn

    from graphs.serve.connections import BACKLOG, guarded_protocol

    state = app.state.serve
    http = guarded_protocol(config.header_timeout, config.body_timeout, connection_cap(config.max_connections),
                            retry_after=config.retry_after, on_refuse=state.metrics.reject)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.drain(config.graceful_timeout)
            await super().shutdown(sockets=sockets)

    return Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=level, http=http, backlog=BACKLOG,
                                 timeout_keep_alive=config.keep_alive_timeout,
                                 timeout_graceful_shutdown=config.graceful_timeout, access_log=level == "debug"))


def connection_cap(wanted: int) -> int:
    """``wanted``, or fewer where the process's open-file limit would run out first (connections.FD_RESERVE
    left free: the server's own files, refused connections waiting for their 503, one accept batch)."""
    from graphs.serve.connections import FD_RESERVE

    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # not on this platform
        return wanted
    if soft == resource.RLIM_INFINITY or soft - FD_RESERVE >= wanted:
        return wanted
    cap = max(1, soft - FD_RESERVE)
    log.warning("max_connections %d lowered to %d: the open-file limit is %d (ulimit -n)", wanted, cap, soft)
    return cap


if __name__ == "__main__":
    sys.exit(main())
