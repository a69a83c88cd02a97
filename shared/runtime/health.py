"""`/livez`, `/readyz` and `/metrics` for the services that have no HTTP server of their own
(workers, the conductor): a small HTTP/1.1 server on asyncio, GET only.

- `/livez`: 200 while the process's event loop runs (it answers, so it lives) and can mend
  what fails by itself; 503 once it cannot (its bus connection lost for good: the liveness
  checks, shared/bus/link.py), so that its supervisor replaces it.
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
"""Readiness: name -> passing (connected to NATS, stream present, a conductor alive, ...);
liveness: name -> passing (the bus connection not lost, ...)."""

MAX_REQUEST_BYTES = 8192  # a request line and headers; anything longer is not a probe
REQUEST_TIMEOUT_S = 5.0


def readiness(checks: Mapping[str, bool]) -> tuple[int, bytes]:
    """(status, JSON body) of a readiness answer."""
    ok = all(checks.values())
    body = json.dumps({"ready": ok, "checks": dict(checks)}).encode()
    return (200 if ok else 503), body


def liveness(checks: Mapping[str, bool]) -> tuple[int, bytes]:
    """(status, JSON body) of a liveness answer: 503 once a check fails (the process cannot
    mend it by itself)."""
    ok = all(checks.values())
    body = json.dumps({"live": ok, "checks": dict(checks)}).encode()
    return (200 if ok else 503), body


def _no_checks() -> Mapping[str, bool]:
    return {}


class HealthServer:
    """Serves the three paths on `host:port` until `close()`."""

    def __init__(
        self, metrics: Metrics | None, checks: Checks, host: str = "0.0.0.0", port: int = 0, live: Checks = _no_checks
    ) -> None:
        """`metrics` None: no /metrics here (a frontend's are on its serving port, behind its token)."""
        self.metrics, self.checks, self.live = metrics, checks, live
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Serve; a port that cannot be had is logged, not fatal (the service works without it)."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as e:
            log.error("no /livez, /readyz or /metrics: cannot listen on %s:%d: %s", self.host, self.port, e)
            return
        self.port = self._server.sockets[0].getsockname()[1]
        paths = "/livez, /readyz" + (", /metrics" if self.metrics is not None else "")
        log.info("health on http://%s:%d (%s)", self.host, self.port, paths)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):  # connections still open are cut: nothing to keep
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path` (pure: tested without sockets)."""
        path = path.split("?", 1)[0]
        if path == "/livez":
            status, body = liveness(self.live())
            return status, "application/json", body
        if path == "/readyz":
            status, body = readiness(self.checks())
            return status, "application/json", body
        if path == "/metrics" and self.metrics is not None:
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
