"""The frontend's HTTP connection: uvicorn's httptools protocol with the limits a server needs.

uvicorn alone keeps a TCP connection that never finishes its request headers open for as
long as the client likes, and takes any number of connections. This protocol, registered
with the frontend's `limits.Guard` like every WebSocket:

- refuses a connection past `max_connections` at once (503, closed);
- closes one whose request headers (a WebSocket handshake's too) are not complete within
  `header_timeout_s` of its first byte being awaited (408), or that sends more than
  `MAX_HEADER_BYTES` of them (431);
- drops one whose client has read none of a response for `send_timeout_s`.

An upgrade hands the connection, still counted, to `websocket.FrontendWebSocketProtocol`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.frontend.limits import Guard, Load, Shed
from services.frontend.websocket import CLOSE_LINGER_S, GUARD

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # one request's line and headers


def _response(status: int, phrase: str, text: str) -> bytes:
    body = text.encode()
    head = f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


class FrontendHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard: Guard | None = self.app_state.get(GUARD)
        self._headers_since: float | None = None  # request headers awaited or unfinished since
        self._header_bytes = 0
        self._refused = False
        self._upgraded = False
        self._last_waiting = 0
        self._progress_at = time.monotonic()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._headers_since = time.monotonic()  # a connection that sends nothing is unfinished too
        if self.guard is not None and not self.guard.admit(self):
            self._refused = True
            limit = self.guard.limits.max_connections
            log.warning("refusing a connection: max_connections (%d) reached", limit)
            transport.write(_response(503, "Service Unavailable", f"max_connections: {limit} connections open"))
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.guard is not None and not self._upgraded:
            self.guard.release(self)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._headers_since is not None:
            self._header_bytes += len(data)  # a body that came with the headers too: reset once they end
        super().data_received(data)
        if self._headers_since is not None and self._header_bytes > MAX_HEADER_BYTES and not self._refused:
            self._refuse(431, "Request Header Fields Too Large", f"request headers over {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_since is None:  # the next request on a kept-alive connection
            self._headers_since = time.monotonic()

    def on_headers_complete(self) -> None:
        self._headers_since = None
        self._header_bytes = 0
        super().on_headers_complete()

    def handle_websocket_upgrade(self) -> None:
        # The WebSocket protocol registers itself with the guard (adopt: no second admission).
        if self.guard is not None:
            self.guard.release(self)
        self._upgraded = True
        super().handle_websocket_upgrade()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._progress_at = time.monotonic()  # what waited drained below the low-water mark: the client reads

    def _refuse(self, status: int, phrase: str, text: str) -> None:
        """Answer and close. What the client still sends is read and dropped for a moment
        (`data_received`): closing at once would answer its next bytes with a reset, which
        loses the answer on its way."""
        self._refused = True
        log.warning("closing an HTTP connection: %d %s", status, text)
        if not self.transport.is_closing():
            self.transport.write(_response(status, phrase, text))
            self.loop.call_later(CLOSE_LINGER_S, self.transport.close)

    # -- limits (`limits.Guard`) -----------------------------------------------
    def load(self, now: float) -> Load:
        waiting = self.transport.get_write_buffer_size() if self.transport is not None else 0
        # uvicorn writes a response only while under its write buffer's high-water mark, so
        # what waits shrinks only when the client reads; a client reading slowly drains it
        # below the low-water mark now and then (resume_writing).
        if waiting < self._last_waiting or waiting == 0:
            self._progress_at = now
        self._last_waiting = waiting
        return Load(
            input=self._header_bytes,
            output=waiting,
            headers_since=self._headers_since,
            stalled_since=self._progress_at if waiting else None,
        )

    def shed(self, why: Shed) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if why.drop:
            log.warning("dropping an HTTP connection: %s", why.reason)
            self.transport.abort()
        elif self._headers_since is not None:
            self._refuse(why.http_status, "Request Timeout" if why.http_status == 408 else "Service Unavailable", why.reason)
        else:
            # A request under way: its one-shot answers for itself (`app.OneShot`); the
            # connection holds little but what it writes.
            log.warning("closing an HTTP connection: %s", why.reason)
            self.transport.close()
