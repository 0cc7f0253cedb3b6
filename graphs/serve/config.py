"""The server's settings (one dataclass; the command line's flags are its fields)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from graphs.errors import InputError


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    """Address to bind (loopback by default: exposing the server is a deliberate choice)."""
    port: int = 8000
    provider: str = "cpu"
    """ONNX Runtime provider: "cpu", "cuda" or "auto"."""
    threads: int | None = 2
    """ONNX Runtime intra-op threads (None: ONNX Runtime's default)."""
    shared_pool: bool = True
    """One ONNX Runtime thread pool for every session of the process (graphs.sessions.use_shared_thread_pool:
    what the CLIs do, measured faster on 2 cores); False: a pool per session, spinning off."""
    max_running: int = 8
    """Requests decoding at once (the engine's K/V rows, EngineConfig.max_batch)."""
    max_queue: int = 64
    """Requests that may wait for a row; beyond them a 429 with Retry-After."""
    max_model_len: int | None = None
    """Positions per request, prompt + completion (default: the model's context, at most 2048)."""
    max_tokens: int | None = None
    """Ceiling of a request's max_tokens (400 above it); also the default when a request sets none
    (None: the room the prompt leaves in max_model_len)."""
    request_timeout: float | None = 300.0
    """Seconds a request may take from arrival; then it ends (finish_reason "length", stats say deadline)."""
    api_key_file: str | None = None
    """A file holding the API key: /v1 routes then need ``Authorization: Bearer <key>``."""
    served_model_name: str | None = None
    """The model id in /v1/models and responses (default: the export directory's name)."""
    max_body_bytes: int = 1 << 20
    """Request bodies larger than this are refused (413), from Content-Length and as the body arrives."""
    max_messages: int = 1024
    """Chat messages a request may hold (400 beyond), counted before any is read or rendered."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers; then 408 and closed (uvicorn has
    no such timeout: a slowloris holds a connection forever)."""
    body_timeout: float = 30.0
    """Seconds a request may take to send its body once its headers are in; then 408 and closed."""
    keep_alive_timeout: float = 30.0
    """Seconds an idle keep-alive connection stays open between requests (uvicorn's timeout_keep_alive).
    Longer than the 5 s after which httpx's (and so openai's) pools drop an idle connection: a server
    that closed first could close one a client is sending on."""
    max_connections: int = 512
    """Open connections at most; one more is answered 503 and closed. Lowered at start to leave 192
    descriptors of the process's open-file limit free (graphs.serve.connections.FD_RESERVE)."""
    graceful_timeout: float = 30.0
    """On SIGTERM/SIGINT: seconds in-flight requests may take to finish; then each ends with an
    error (a stream: an error chunk and [DONE]; otherwise an OpenAI error body, 503)."""
    prep_threads: int = 1
    """Threads that render chat templates and tokenize long prompts (off the event loop)."""
    prep_queue: int = 8
    """Requests that may wait for those threads; beyond them a 429 with Retry-After."""
    prefill_chunk: int = 64
    step_tokens: int = 256
    max_tree: int = 64
    """Largest tree (nodes) a request's ``tree`` may ask for."""
    plain_run_s: float = 0.01
    """Seconds of autoregressive steps the engine may run in a row while no request arrives, ends or
    is cancelled (EngineConfig.plain_run_s): a stream's chunks then carry that many seconds of tokens."""
    retry_after: int = 1
    """Seconds in the Retry-After header of a 429."""
    template_timeout: float = 1.0
    """Seconds a chat template may render for."""
    template_max_chars: int = 1 << 20
    """Characters a rendered chat template may reach."""
    adaptive: bool = True
    """The decoder's default speculation: adaptive (True) or on (False); requests may choose."""
    eagle_draft: str = "auto"
    verify: str = "auto"
    """Manifest check at load: "auto" (sha256 unless a proof record matches), True (always), False."""

    def __post_init__(self):
        for name in ("max_running", "max_body_bytes", "prefill_chunk", "step_tokens", "max_tree", "retry_after",
                     "max_messages", "max_connections", "prep_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("max_queue", "prep_queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InputError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "graceful_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise InputError(f"{name} must be a number of seconds in (0, 86400], got {v!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise InputError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")
        if (isinstance(self.plain_run_s, bool) or not isinstance(self.plain_run_s, (int, float))
                or not 0 <= self.plain_run_s <= 60):
            raise InputError(f"plain_run_s must be a number of seconds in [0, 60], got {self.plain_run_s!r}")
        if not 0 <= self.port <= 65535:
            raise InputError(f"port must be in [0, 65535], got {self.port}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
