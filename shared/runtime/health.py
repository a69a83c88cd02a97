"""`/livez`, `/readyz` and `/metrics` for the services that have no HTTP server of their own
(workers, the conductor): a small HTTP/1.1 server on asyncio, GET only.

- `/livez`: 200 while the process's event loop runs (it answers, so it lives).
- `/readyz`: 200 when every readiness check passes, else 503; the body names each check.
- `/metrics`: the process's Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping

from shared.runtime.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

Checks = Callable[[], Mapping[str, bool]]
"""Readiness: name -> passing (connected to NATS, stream present, a conductor alive, ...)."""

MAX_REQUEST_BYTES = 8192  # a request line and headers; anything longer is not a probe
REQUEST_TIMEOUT_S = 5.0


def readiness(checks: Mapping[str, bool]) -> tuple[int, bytes]:
    """(status, JSON body) of a readiness answer."""
    ok = all(checks.values())
    body = json.dumps({"ready": ok, "checks": dict(checks)}).encode()
    return (200 if ok else 503), body


class HealthServer:
    """Serves the three paths on `host:port` until `close()`."""

    def __init__(self, metrics: Metrics, checks: Checks, host: str = "0.0.0.0", port: int = 0) -> None:
        self.metrics, self.checks = metrics, checks
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health and metrics on http://%s:%d (/livez, /readyz, /metrics)", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):  # connections still open are cut: nothing to keep
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path` (pure: tested without sockets)."""
        path = path.split("?", 1)[0]
        if path == "/livez":
            return 200, "application/json", b'{"live": true}'
        if path == "/readyz":
            status, body = readiness(self.checks())
            return status, "application/json", body
        if path == "/metrics":
            return 200, CONTENT_TYPE, self.metrics.render()
        return 404, "application/json", b'{"error": "not found: /livez, /readyz, /metrics"}'

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            method, path = _request_line(head)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "application/json", b'{"error": "GET only"}'
            else:
                status, ctype, body = self.answer(path)
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            headers = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(headers.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass  # a probe that hung up, timed out or sent nonsense: nothing to answer
        finally:
            writer.close()


def _request_line(head: bytes) -> tuple[str, str]:
    if len(head) > MAX_REQUEST_BYTES:
        raise ValueError("request too long")
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3:
        raise ValueError("not an HTTP request line")
    return parts[0], parts[1]
