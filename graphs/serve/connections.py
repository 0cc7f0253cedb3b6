"""Connection limits that uvicorn lacks: header and body read timeouts, and a cap on open connections.

uvicorn (0.55, h11) starts no timer before a response is complete (``timeout_keep_alive`` covers
only the idle time between requests), so a client that sends half a header, or its headers and half
a body, keeps its connection and file descriptor for ever. ``limit_concurrency`` answers 503 only
once a request's headers are complete, so stalled connections are never refused, and
``h11_max_incomplete_event_size`` bounds a header's bytes, not its time. uvicorn's own H11Protocol,
subclassed, adds:

    header timer   armed when a connection opens, or when bytes of its next request arrive; disarmed
                   when the headers are complete. Fires: 408 (if any of a request came), closed
    body timer     armed when the headers are complete and the body is not; disarmed when it is.
                   Fires: 408 unless a response has started (the app then reads a disconnect), closed
    cap            a connection beyond ``max_connections`` gets a 503 at once and is closed when its
                   request arrives (or after REFUSED_LINGER_S); beyond REFUSED_POLITE more, closed at once

    http = guarded_protocol(header_timeout=10, body_timeout=30, max_connections=512)
    uvicorn.Config(app, http=http, ...)        # h11 whatever is installed (httptools has the same gaps)
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REFUSED_LINGER_S = 1.0  # a refused connection's request is read and dropped this long (a close with
# unread bytes is a TCP reset, which can destroy the 503 before the client reads it)
REFUSED_POLITE = 32  # refused connections that may wait for their 503 at once; beyond, closed at once
BACKLOG = 128  # the listen queue, and so asyncio's accept batch: descriptors taken before any check runs
FD_RESERVE = 32 + REFUSED_POLITE + BACKLOG  # descriptors the cap leaves free (the server's own: 11 measured)


def raw_error(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body, written outside h11 (the connection closes)."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + (f"retry-after: {retry_after}\r\n" if retry_after is not None else "") + "connection: close\r\n\r\n")
    return head.encode() + body


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int, retry_after: int = 1,
                     on_refuse=None) -> type[H11Protocol]:
    """uvicorn's H11Protocol with the limits above; ``on_refuse(reason)`` counts each refusal
    (``header_timeout``, ``body_timeout``, ``connections``)."""
    count = on_refuse or (lambda reason: None)

    class GuardedH11Protocol(H11Protocol):
        _timer = None
        _timer_kind: str | None = None
        _refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refused = True
                count("connections")
                if len(self.connections) > max_connections + REFUSED_POLITE:  # a flood: no descriptor to spare
                    transport.abort()
                    return
                transport.write(raw_error(503, "Service Unavailable",
                                          f"the server holds {max_connections} connections, its limit; retry later",
                                          "too_many_connections", retry_after))
                self._arm("refused", REFUSED_LINGER_S, self._close)
                return
            self._arm("header", header_timeout, self._expired)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # its request is read: closing now sends no reset over unread bytes
                self._close()
                return
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()  # a body the app did not read (an early 401/413) is still timed

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _track(self) -> None:
            """Arm the timer the connection's state calls for (kept, not restarted, while it stays)."""
            if self.transport.is_closing():
                self._disarm()
                return
            state = self.conn.their_state
            if state is h11.IDLE and self.conn.our_state is h11.IDLE:
                if self.timeout_keep_alive_task is not None:  # idle between requests: uvicorn's keep-alive
                    self._disarm()
                elif self._timer_kind != "header":
                    self._arm("header", header_timeout, self._expired)
            elif state is h11.SEND_BODY:
                if self._timer_kind != "body":
                    self._arm("body", body_timeout, self._expired)
            elif self._timer_kind in ("header", "body"):
                self._disarm()

        def _arm(self, kind: str, seconds: float, callback) -> None:
            self._disarm()
            self._timer_kind = kind
            self._timer = self.loop.call_later(seconds, callback)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._timer_kind = None

        def _expired(self) -> None:
            kind, seconds = self._timer_kind, header_timeout if self._timer_kind == "header" else body_timeout
            self._timer = self._timer_kind = None
            if self.transport.is_closing():
                return
            count(f"{kind}_timeout")
            cycle = self.cycle if kind == "body" else None
            if kind == "header" and not self.conn.trailing_data[0]:
                pass  # nothing of a request arrived (a new or idle connection): closed without a word
            elif cycle is None or not cycle.response_started:
                self.transport.write(raw_error(408, "Request Timeout",
                                               f"the request's {'headers' if kind == 'header' else 'body'} did not "
                                               f"arrive within {seconds:g} s", "request_timeout"))
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's receive() answers http.disconnect, its sends are dropped
                cycle.message_event.set()
            self._close()

        def _close(self) -> None:
            self._timer = self._timer_kind = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
