"""HTTP and WebSocket endpoints: `WS /generate/ws`, `POST /generate`, `WS /v1/realtime`, `/healthz`, `/`.

`create_app` wires the endpoints (`Endpoints`, one object that owns the service) to routes.
A route added later (another protocol on the same calls) is one more method there and one
more line in `routes()`. Every endpoint that starts work first runs the app's `checks`
(`Check`): whatever they refuse is answered before anything is read or opened. Before any
route, `HostCheck` refuses a Host the frontend does not answer (`hosts.py`: DNS rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.frontend.auth import Access, Grant
from services.frontend.hosts import HostRule
from services.frontend.limits import Guard, Limits, Load, Shed
from services.frontend.outbox import Outbox, Outlet, Packed, to_json
from services.frontend.protocol import Opening, ParseError, parse_message
from services.frontend.realtime.endpoint import RealtimeHub
from services.frontend.relayed_call import RelayedCall
from services.frontend.service import FrontendService
from services.frontend.shares import Share, Shares, open_shared
from services.frontend.socket_session import SocketSession, error_body
from services.frontend.websocket import DRAIN, GUARD, OUTLET
from shared.runtime.config import ServingConfig
from shared.runtime.errors import (
    BodyTooLarge,
    CallTimeout,
    DuplexError,
    LimitExceeded,
    Overloaded,
    ProtocolError,
    TooManyCalls,
    Unauthorized,
)
from shared.runtime.health import liveness, readiness
from shared.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from shared.runtime.process import TimeSlice, cancel_and_wait

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"

Check = Callable[[HTTPConnection], Awaitable[DuplexError | None]]
"""Runs before an endpoint does any work (reads a body, accepts a socket): an error refuses
the request with its status (a socket: refused at the handshake)."""


def error_response(rid: str | None, err: DuplexError, close: bool = False) -> JSONResponse:
    """The error as a response; `close`: the connection closes after it (its request's body
    was not read to the end, so nothing more on it can be read as a request)."""
    headers = {"connection": "close"} if close else {}
    if err.status == 401:
        headers["www-authenticate"] = 'Bearer realm="duplexbus"'
    return JSONResponse(error_body(rid, err), status_code=err.status, headers=headers or None)


class OneShot:
    """`POST /generate`: one opening as JSON, run as a one-shot, its messages as NDJSON lines.

    Its messages wait in an `Outbox` for the response to send them; outputs wait in the
    stream while the client is slower than they come. A client that leaves ends the call.
    What it holds (the body being read, messages waiting) counts against the frontend's
    memory budget (`limits.Guard`, which may end it), and its body must be complete
    within `message_timeout_s`.
    """

    def __init__(
        self, service: FrontendService, request: Request, guard: Guard | None = None, share: Share | None = None
    ) -> None:
        self.service = service
        self.request = request
        self.guard = guard
        self.share = share  # its token's (shares.py)
        self.request_id: str | None = None
        self.call: RelayedCall | None = None
        self.outbox = Outbox(pause_at=service.config.max_send_buffer_bytes, on_overflow=self._overflowed)
        self._body_bytes = 0
        self._body_since: float | None = None
        self._reader: asyncio.Task[bytes | DuplexError] | None = None
        self._shed: Shed | None = None

    async def respond(self) -> Response:
        if self.guard is not None:
            self.guard.adopt(self, counted=False)  # its TCP connection is the one counted
        try:
            response = await self._respond()
        except BaseException:
            self._release()
            raise
        if not isinstance(response, StreamingResponse):
            self._release()
        return response

    def _release(self) -> None:
        if self.guard is not None:
            self.guard.release(self)

    async def _respond(self) -> Response:
        body = await self._read_body()
        if isinstance(body, DuplexError):
            return error_response(None, body, close=True)
        msg = parse_message(body, one_shot=True)
        if isinstance(msg, ParseError):
            return error_response(msg.request_id, msg.error)
        if not isinstance(msg, Opening):
            err = ProtocolError("POST /generate takes an opening (no append, end_input alone or abort)")
            return error_response(msg.request_id, err)
        self.request_id = msg.request_id
        try:
            self.call = await open_shared(self.share, self.service.open_call, msg, self.outbox, lambda _: self.outbox.close())
        except DuplexError as e:
            return error_response(msg.request_id, e)
        # Watched from now: a client that leaves before the response starts ends its call too.
        # Under ASGI 2.3 Starlette also watches (and cancels _lines); under 2.4 only this
        # does. Both end in abort_soon, which aborts once.
        watcher = self.service.tasks.spawn(self._abort_when_gone(self.call))
        return StreamingResponse(self._lines(self.call, watcher), media_type="application/x-ndjson")

    async def _read_body(self) -> bytes | DuplexError:
        """The body, in a task of its own that the guard may end (`shed`)."""
        self._body_since = time.monotonic()
        self._reader = asyncio.get_running_loop().create_task(self._body())
        try:
            return await self._reader
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._shed is None or (current is not None and current.cancelling()):
                raise
            return CallTimeout(self._shed.reason) if self._shed.http_status == 408 else Overloaded(self._shed.reason)
        finally:
            self._reader = None
            self._body_since = None
            self._body_bytes = 0

    async def _body(self) -> bytes | DuplexError:
        limit = self.service.config.max_message_bytes
        chunks: list[bytes] = []
        async for part in self.request.stream():
            self._body_bytes += len(part)
            if self._body_bytes > limit:
                return LimitExceeded("max_message_mb", f"a request body over the limit of {limit} bytes")
            chunks.append(part)
            if self.guard is not None:
                for conn, why in self.guard.report(self, self._body_bytes, time.monotonic()):
                    conn.shed(why)
        return b"".join(chunks)

    # -- limits (`limits.Guard`) -----------------------------------------------
    def load(self, now: float) -> Load:
        return Load(input=self._body_bytes, output=self.outbox.queued_bytes, message_since=self._body_since)

    def shed(self, why: Shed) -> None:
        log.warning("ending a POST /generate: %s", why.reason)
        self._shed = why
        if self._reader is not None:
            self._reader.cancel()
        elif self.call is not None:
            err = CallTimeout(why.reason) if why.http_status == 408 else Overloaded(why.reason)
            self.outbox.last(error_body(self.request_id, err))
            self.service.abort_soon(self.call, err.message, err.status)

    def _overflowed(self) -> None:
        err = Overloaded(f"the client was not reading its results ({self.outbox.queued_bytes} bytes waiting)")
        self.outbox.last(error_body(self.request_id, err))
        if self.call is not None:
            self.service.abort_soon(self.call, err.message, err.status)

    async def _lines(self, call: RelayedCall, watcher: asyncio.Task[Any]) -> AsyncIterator[bytes]:
        try:
            # Ended by the outbox, which closes once the call's last message is in it.
            while (msg := await self.outbox.get()) is not None:
                yield to_json(msg) + b"\n"
        finally:
            watcher.cancel()
            self._release()
            self.service.abort_soon(call, "client went away", 499)

    async def _abort_when_gone(self, call: RelayedCall) -> None:
        """A client that leaves ends its call. Under ASGI 2.4 Starlette notices a client that
        left only when a send fails, and a one-shot that is queued, or whose model is quiet,
        sends nothing for a while: so watch the connection (its body is read by now)."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self._release()
        self.service.abort_soon(call, "client went away", 499)


class Endpoints:
    """The frontend's endpoints; they share one service, which they start and stop, and one
    `limits.Guard`, which every connection reports to (through the lifespan's state, for
    the protocols in `http.py` and `websocket.py`) and which the lifespan sweeps."""

    def __init__(self, service: FrontendService, checks: Sequence[Check] = ()) -> None:
        self.service = service
        auth = service.config.auth
        self.access = Access(auth.tokens, auth.allowed_origins)
        self.checks = [self._stopping, self._access, *checks]
        self.guard = Guard(Limits.from_config(service.config))
        self.shares = Shares.from_config(service.config, self._refused_share)
        self.hub = RealtimeHub(service)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.index),
            Route("/healthz", self.healthz),
            Route("/livez", self.livez),
            Route("/readyz", self.readyz),
            Route("/metrics", self.metrics),
            Route("/favicon.svg", self.favicon),
            Route("/favicon.ico", self.favicon),
            Route("/generate", self.generate, methods=["POST"]),
            WebSocketRoute("/generate/ws", self.generate_ws),
            WebSocketRoute("/v1/realtime", self.realtime_ws),
        ]

    async def _access(self, conn: HTTPConnection) -> DuplexError | None:
        """Tokens and origins (auth.py); a socket's token may come as a subprotocol, which the
        socket is then accepted with (kept in the connection's state)."""
        protocols = conn.headers.getlist("sec-websocket-protocol")
        offered = [p.strip() for line in protocols for p in line.split(",") if p.strip()]
        verdict = self.access.check(conn.headers, conn.url.scheme, offered)
        if isinstance(verdict, Grant):
            conn.state.subprotocol = verdict.subprotocol
            conn.state.client = verdict.client
            return None
        return verdict

    def _share(self, conn: HTTPConnection, socket: bool) -> Share:
        """The connection's share of calls (`shares.py`), once `_access` let it in."""
        return self.shares.client(getattr(conn.state, "client", None), socket)

    def _refused_share(self, err: TooManyCalls) -> None:
        self.service.metrics.refusals.labels(str(err.status)).inc()

    async def _stopping(self, conn: HTTPConnection) -> DuplexError | None:
        """A stopping frontend takes no new call, and says so before the handshake or the
        body (nothing read, nothing sent): a gateway may send the request to another one."""
        return Overloaded("the frontend is stopping") if self.service.stopping else None

    async def refused(self, conn: HTTPConnection) -> DuplexError | None:
        """The first refusal of the app's checks, if any."""
        for check in self.checks:
            err = await check(conn)
            if err is not None:
                return err
        return None

    async def generate(self, request: Request) -> Response:
        err = await self.refused(request)
        if err is not None:
            return error_response(None, err)
        if (err := announced_too_large(request, self.service.config.max_message_bytes)) is not None:
            return error_response(None, err, close=True)  # its body unread: the connection cannot go on
        return await OneShot(self.service, request, self.guard, self._share(request, socket=False)).respond()

    async def generate_ws(self, ws: WebSocket) -> None:
        if (err := await self.refused(ws)) is not None:
            await _deny(ws, err)
            return
        await ws.accept(subprotocol=getattr(ws.state, "subprotocol", None))
        outlet: Any = ws.scope.get("extensions", {}).get(OUTLET)
        outbox = Outbox(_as_outlet(outlet), pause_at=self.service.config.max_send_buffer_bytes)
        session = SocketSession(outbox, self.service, self._share(ws, socket=True))
        if outlet is not None:
            outlet.busy = lambda: session.has_calls  # a socket with a call is not idle
        # Under the frontend's own protocol (`websocket.FrontendWebSocketProtocol`) a message
        # is handed to the connection at once, which bounds what waits for a slow client.
        # Under another ASGI server they wait in the outbox for a writer task.
        writer = None if outbox.direct else asyncio.get_running_loop().create_task(_write_all(ws, outbox))
        try:
            await _read_all(ws, session)
        finally:
            await session.close()
            if writer is not None:
                await cancel_and_wait(writer)
            if outbox.overflowed:
                await _close_quietly(ws, 1008, "client not reading")

    async def realtime_ws(self, ws: WebSocket) -> None:
        """`WS /v1/realtime?model=NAME`: the OpenAI Realtime API (docs/realtime.md)."""
        if (err := await self.refused(ws)) is not None:
            await _deny(ws, err)
            return
        await self.hub.serve(ws, getattr(ws.state, "subprotocol", None), self._share(ws, socket=False))

    async def healthz(self, request: Request) -> Response:
        ok = self.service.ready.is_set()
        buffered = self.guard.buffered(time.monotonic())
        body = {
            "ready": ok,
            "frontend_id": self.service.frontend_id,
            "calls": len(self.service.calls),
            "connections": len(self.guard),
            "buffered_bytes": sum(buffered),
            "buffered": {"input": buffered[0], "output": buffered[1]},
            "shed": self.guard.shed_count,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def livez(self, request: Request) -> Response:
        """Live: it answers, and its bus connection is not lost for good (shared.bus.readiness)."""
        status, body = liveness(self.service.readiness.live())
        return Response(body, status_code=status, media_type="application/json")

    async def readyz(self, request: Request) -> Response:
        """Ready: connected to NATS, the stream there, a conductor alive (shared.bus.readiness)."""
        status, body = readiness(self.service.readiness())
        return Response(body, status_code=status, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        """Behind a token where tokens are set: the metrics say what the frontend serves, and how much."""
        if self.access.needs_token and not self.access.bearer(request.headers):
            return error_response(None, Unauthorized("/metrics needs a bearer token (auth.tokens): Authorization: Bearer TOKEN"))
        m = self.service.metrics
        m.sockets.set(len(self.guard))
        m.socket_queue.set(self.guard.buffered(time.monotonic())[1])
        return Response(m.render(), media_type=METRICS_CONTENT_TYPE)

    async def index(self, request: Request) -> Response:
        page = STATIC / "index.html"
        if page.exists():
            return FileResponse(page)
        return JSONResponse({"service": "duplexbus", "ws": "/generate/ws"})

    async def favicon(self, request: Request) -> Response:
        # A browser asks for /favicon.ico whatever the page says: both get the one icon.
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await self.service.start()
        sweeper = asyncio.get_running_loop().create_task(self._sweep())
        try:
            # The WebSocket protocol drains before it closes its socket; every connection
            # reports to the guard.
            yield {DRAIN: self.service.drain, GUARD: self.guard}
        finally:
            await cancel_and_wait(sweeper)
            await self.hub.close()
            await self.service.close()

    async def _sweep(self) -> None:
        """End the connections past a timeout (or over the memory budget), now and then."""
        while True:
            await asyncio.sleep(self.guard.limits.sweep_s)
            for conn, why in self.guard.sweep(time.monotonic()):
                try:
                    conn.shed(why)
                except Exception:  # no bus here: a bug in one connection's shed must not stop the sweep of all
                    log.exception("ending a connection (%s) failed", why.key)


def announced_too_large(request: Request, limit: int) -> BodyTooLarge | None:
    """A body whose Content-Length is over `limit`: refused (413) before a byte of it is read.
    (A body without one, chunked, is counted as it is read: `OneShot._body`.)"""
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        return BodyTooLarge("max_message_mb", f"a request body of {announced} bytes, over the limit of {limit}")
    return None


class HostCheck:
    """ASGI middleware: a request whose Host the frontend does not answer (`hosts.HostRule`)
    gets 421 before any route runs, a WebSocket at its handshake."""

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"]
            server = scope.get("server")
            err = self.rule.refusal(hosts[0] if hosts else None, server[0] if server else None)
            if err is not None:
                log.warning("refusing a request for host %r (auth.allowed_hosts)", err.host)
                if scope["type"] == "http":
                    await error_response(None, err, close=True)(scope, receive, send)
                else:
                    await _deny(WebSocket(scope, receive, send), err)
                return
        await self.app(scope, receive, send)


async def _deny(ws: WebSocket, err: DuplexError) -> None:
    """Refuse a socket before its handshake. A 503 is answered as itself (a gateway retries
    it on another frontend: nothing was sent), a 421 too (its one line says which setting to
    change); the access checks' refusals as a close, which the client gets as 403 (as under
    a server without denial responses, a 503 or 421 too)."""
    if err.status in (421, 503) and "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(error_response(None, err, close=True))
    else:
        await ws.close(1008)


async def _read_all(ws: WebSocket, session: SocketSession) -> None:
    """Hand each client message to the session until the client leaves (or is not reading),
    giving the loop back every few milliseconds of them (TimeSlice)."""
    turn = TimeSlice()
    try:
        while not session.outbox.overflowed:
            await turn.due()
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""  # a binary frame: msgpack (`protocol.parse_frame`)
            await session.handle(data)
    except WebSocketDisconnect:
        pass


async def _write_all(ws: WebSocket, outbox: Outbox) -> None:
    """The send path under an ASGI server other than the frontend's own."""
    while (msg := await outbox.get()) is not None and not outbox.overflowed:
        if isinstance(msg, Packed):
            await ws.send_bytes(msg.data)
        else:
            await ws.send_text(to_json(msg).decode())


def _as_outlet(ext: Any) -> Outlet | None:
    """The connection's outlet (the frontend's own WebSocket protocol), or None under another server."""
    return ext if ext is not None and hasattr(ext, "send_now") and hasattr(ext, "has_room") else None


async def _close_quietly(ws: WebSocket, code: int, reason: str) -> None:
    """Close a socket that may be gone already (the client left meanwhile)."""
    try:
        await ws.close(code, reason)
    except (RuntimeError, OSError) as e:
        log.debug("closing a socket (%d %s): %s", code, reason, e)


def create_app(config: ServingConfig, service: FrontendService | None = None, checks: Sequence[Check] = ()) -> Starlette:
    endpoints = Endpoints(service or FrontendService(config), checks)
    hosts = Middleware(HostCheck, rule=HostRule.from_config(config))
    app = Starlette(routes=endpoints.routes(), lifespan=endpoints.lifespan, middleware=[hosts])
    app.state.service = endpoints.service
    return app
