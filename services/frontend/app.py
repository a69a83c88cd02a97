"""HTTP and WebSocket endpoints: `WS /generate/ws`, `POST /generate`, `/healthz`, `/`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.frontend.calls import InputState
from services.frontend.protocol import (
    AbortCall,
    Append,
    ClientMessage,
    EndInput,
    Opening,
    ParseError,
    parse_message,
    valid_request_id,
)
from services.frontend.realtime.endpoint import RealtimeHub
from services.frontend.service import Call, FrontendService, Reply, to_json
from services.frontend.websocket import DRAIN, SEND_NOW
from shared.runtime.config import ServingConfig
from shared.runtime.errors import Aborted, Conflict, DuplexError, LimitExceeded, Overloaded, ProtocolError, UnknownCall

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
SEND_QUEUE = 8192  # server -> client messages waiting for a slow reader; past it the socket (or one-shot) ends
LANE_MAX = 256  # messages of one call waiting behind its opening or end: past it the socket waits
LANES_MAX = 64  # calls of one socket with an opening, end or abort under way: past it the socket waits
CLOSE_WAIT_S = 10.0  # on close, how long an opening under way may take before the socket's calls are aborted
NO_CALL = "no live call with this request_id on this socket (never opened here, or ended)"
INTERNAL = DuplexError("internal error")  # status 500: a bug, not the client's doing


def error_body(rid: str | None, err: DuplexError, append: bool = False) -> dict[str, Any]:
    """The client's error message: the call's, or (append=True) a refused append's."""
    body: dict[str, Any] = {"request_id": rid, "error": err.message, "status": err.status}
    if append:
        body["append"] = True
    return body


def error_response(rid: str | None, err: DuplexError) -> JSONResponse:
    return JSONResponse(error_body(rid, err), status_code=err.status)


class SocketSession:
    """One WebSocket: its calls (by request_id) and the way messages go out to it.

    Under the frontend's own protocol (`websocket.FrontendWebSocketProtocol`) a message is
    handed to the connection at once, which bounds what waits for a slow client. Under
    another ASGI server they go through a bounded queue and a writer task.
    """

    def __init__(self, ws: WebSocket, service: FrontendService) -> None:
        self.ws = ws
        self.service = service
        self.calls: dict[str, Call] = {}
        # Messages of a call whose opening, end of input or abort is under way, by request_id:
        # they wait for it, while other calls' messages on this socket go on.
        self.lanes: dict[str | None, deque[ClientMessage | ParseError]] = {}
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._lane_moved = asyncio.Event()
        self.closed = False
        self.send_now: Callable[[bytes], None] | None = ws.scope.get("extensions", {}).get(SEND_NOW)
        self.queue: asyncio.Queue[Reply] = asyncio.Queue(SEND_QUEUE)
        self.overflowed = False

    def send(self, msg: Reply) -> None:
        if self.send_now is not None:
            with contextlib.suppress(OSError):  # the socket is gone: its calls are being aborted
                self.send_now(to_json(msg))
            return
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            # The client is not reading: better to end its socket than to buffer without bound.
            self.overflowed = True

    async def writer(self) -> None:
        """The send path under an ASGI server other than the frontend's own."""
        while True:
            msg = await self.queue.get()
            if self.overflowed:
                return
            await self.ws.send_text(to_json(msg).decode())

    def live(self, rid: str | None) -> Call | None:
        return self.calls.get(rid) if rid is not None else None

    def _forget(self, call: Call) -> None:
        """The call ended: its request_id is free on this socket (and the socket holds no
        trace of it, however many calls it runs over its life)."""
        if call.request_id is not None and self.calls.get(call.request_id) is call:
            del self.calls[call.request_id]

    def append_error(self, rid: str | None, err: DuplexError) -> None:
        """The reply to an append, end_input or abort that was refused; no call ends by it."""
        self.send(error_body(rid, err, append=True))

    async def handle(self, data: str | bytes) -> None:
        """One client message. A plain append is handled at once; an opening, an end of input
        or an abort waits on round trips to the bus, so it runs in a lane of its call's own,
        and that call's later messages queue behind it, in order: one call's slow opening
        does not hold up the appends of the others on the socket."""
        msg = parse_message(data, max_bytes=self.service.config.max_message_bytes)
        rid = msg.request_id
        # Backpressure: past either bound the socket reads no more until a lane moves on.
        while ((lane := self.lanes.get(rid)) is not None and len(lane) >= LANE_MAX) or (
            lane is None and not _plain_append(msg) and len(self.lanes) >= LANES_MAX
        ):
            self._lane_moved.clear()
            await self._lane_moved.wait()
        if lane is not None:
            lane.append(msg)
        elif _plain_append(msg):
            await self._handle(msg)
        else:
            self.lanes[rid] = deque()
            task = asyncio.get_running_loop().create_task(self._run_lane(rid, msg))
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)

    async def _run_lane(self, rid: str | None, first: ClientMessage | ParseError) -> None:
        lane = self.lanes[rid]
        try:
            await self._handle(first)
            while lane:
                msg = lane.popleft()
                self._lane_moved.set()
                await self._handle(msg)
        finally:
            del self.lanes[rid]
            self._lane_moved.set()

    async def _handle(self, msg: ClientMessage | ParseError) -> None:
        try:
            if isinstance(msg, ParseError):
                await self._refused(msg)
            elif isinstance(msg, Opening):
                await self._open(msg)
            elif isinstance(msg, Append | EndInput):
                await self._append(msg)
            else:
                await self._abort(msg)
        except DuplexError as e:
            self.send(error_body(msg.request_id, e))
        except Exception:  # I-4: a bug here ends at most the call it concerns, never the socket
            log.exception("handling a %s failed", type(msg).__name__)
            call = None if isinstance(msg, Opening) else self.live(msg.request_id)
            if call is not None:
                await self.service.abort(call, INTERNAL.message, INTERNAL.status, tell_client=True)
            else:
                self.send(error_body(msg.request_id, INTERNAL))

    async def _refused(self, p: ParseError) -> None:
        call = self.live(p.request_id) if valid_request_id(p.request_id) else None
        if p.append:
            if call is not None:  # a malformed append is a rejected append: it ends the call
                await self._reject_append(call, p.error)
            else:
                self.append_error(p.request_id, p.error)
            return
        if p.kind == "opening" and call is not None:
            # An opening under a live request_id is a 409 whatever else is wrong with it: an
            # error reply of any other status under a live request_id means that call ended.
            err = Conflict(f"request_id {p.request_id!r} is already in use by a live call ({p.error.message})")
            self.send(error_body(p.request_id, err))
            return
        self.send(error_body(p.request_id, p.error))

    async def _open(self, o: Opening) -> None:
        if self.live(o.request_id) is not None:
            raise Conflict(f"request_id {o.request_id!r} is already in use by a live call")
        call = await self.service.open_call(o, self.send, self, on_end=self._forget)
        if self.closed:  # the socket closed while the call was opening
            await self.service.abort(call, "socket closed", 499)
            return
        if o.request_id is not None:
            self.calls[o.request_id] = call

    async def _append(self, a: Append | EndInput) -> None:
        call = self.live(a.request_id)
        if call is None:
            self.append_error(a.request_id, UnknownCall(NO_CALL))
            return
        if call.input.state is not InputState.OPEN:
            self.append_error(a.request_id, Conflict("the call's input has ended (end_input); the call goes on"))
            return
        try:
            if isinstance(a, Append):
                await self.service.append(call, a)
            else:
                await self.service.end_input(call, a)
        except DuplexError as e:
            await self._reject_append(call, e)

    async def _abort(self, a: AbortCall) -> None:
        call = self.live(a.request_id)
        if call is None:
            self.append_error(a.request_id, UnknownCall(NO_CALL))
        else:
            err = Aborted("aborted by the client")
            await self.service.abort(call, err.message, err.status, tell_client=True)

    async def _reject_append(self, call: Call, e: DuplexError) -> None:
        """A rejected append ends the call with its error and no finish."""
        await self.service.abort(call, e.message, e.status, tell_client=True)

    async def close(self) -> None:
        """The socket closed: abort its calls, which frees their admission slots.

        What its lanes still held is dropped; an opening under way is let finish (for up to
        CLOSE_WAIT_S), and a call it opens after this is aborted at once (`_open`).
        One-shots first (they may be queued): were a live call's slot freed first, the
        conductor could admit this socket's own queued one-shot into it, ahead of others.
        (One-shots without a request_id are not in self.calls, hence the scan.)
        """
        self.closed = True
        for lane in self.lanes.values():
            lane.clear()
        if self._lane_tasks:
            await asyncio.wait(list(self._lane_tasks), timeout=CLOSE_WAIT_S)
        mine = [c for c in self.service.calls.values() if c.owner is self]
        for call in sorted(mine, key=lambda c: c.live):
            await self.service.abort(call, "socket closed", 499)


def _plain_append(msg: ClientMessage | ParseError) -> bool:
    """An append that ends no stream: it is framed and published without a round trip."""
    return isinstance(msg, Append) and msg.end_input is None


async def _abort_when_gone(request: Request, svc: FrontendService, call: Call) -> None:
    """A `POST /generate` client that leaves ends its call. Under ASGI 2.4 Starlette notices
    a client that left only when a send fails, and a one-shot that is queued, or whose model
    is quiet, sends nothing for a while: so watch the connection (its body is read by now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    _abort_soon(svc, call)


def _abort_soon(svc: FrontendService, call: Call) -> None:
    """Abort in a task of the service's own: the response's task may be in a cancelled
    scope (Starlette cancels it when the client leaves), where every await is cancelled too,
    and an abort cut short would leave the call, queued or running, to the conductor."""
    if not call.ended.is_set():
        svc.tasks.spawn(svc.abort(call, "client went away", 499))


def create_app(config: ServingConfig, service: FrontendService | None = None) -> Starlette:
    svc = service or FrontendService(config)
    hub = RealtimeHub(svc)

    async def realtime_ws(ws: WebSocket) -> None:
        """`WS /v1/realtime?model=NAME`: the OpenAI Realtime API (docs/realtime.md)."""
        await hub.serve(ws)

    async def generate_ws(ws: WebSocket) -> None:
        await ws.accept()
        session = SocketSession(ws, svc)
        writer = None if session.send_now is not None else asyncio.get_running_loop().create_task(session.writer())
        try:
            while not session.overflowed:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""  # a binary frame: parsed as UTF-8 JSON all the same
                await session.handle(data)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            await session.close()
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(BaseException):
                    await writer
            if session.overflowed:
                with contextlib.suppress(Exception):
                    await ws.close(1008, "client not reading")

    async def generate(request: Request) -> Response:
        """`POST /generate`: one opening as JSON, run as a one-shot, results as NDJSON lines."""
        limit = config.max_message_bytes
        chunks: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                big = LimitExceeded("max_message_mb", f"a request body over the limit of {limit} bytes")
                return error_response(None, big)
            chunks.append(part)
        msg = parse_message(b"".join(chunks), one_shot=True)
        if isinstance(msg, ParseError):
            return error_response(msg.request_id, msg.error)
        if not isinstance(msg, Opening):
            err = ProtocolError("POST /generate takes an opening (no append, end_input alone or abort)")
            return error_response(msg.request_id, err)
        buf: deque[Reply] = deque()
        more = asyncio.Event()
        opened: list[Call] = []
        overflowed = False

        def sink(m: Reply) -> None:
            nonlocal overflowed
            if overflowed:
                return
            if len(buf) >= SEND_QUEUE:
                # The client is not reading: end the call rather than buffer without bound.
                overflowed = True
                err = Overloaded(f"the client was not reading its results ({SEND_QUEUE} messages waiting)")
                buf.append(error_body(msg.request_id, err))
                if opened:
                    svc.tasks.spawn(svc.abort(opened[0], err.message, err.status))
            else:
                buf.append(m)
            more.set()

        try:
            call = await svc.open_call(msg, sink, request, on_end=lambda _: more.set())
        except DuplexError as e:
            return error_response(msg.request_id, e)
        opened.append(call)
        # Under ASGI 2.3 Starlette also watches (and cancels lines()); under 2.4 only this
        # does. Both end in _abort_soon, which aborts once.
        watcher = svc.tasks.spawn(_abort_when_gone(request, svc, call))

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    while not buf:
                        # Ended by the call's state, not by the look of a message: the call's
                        # last reply (if any) is in buf before it counts as ended.
                        if call.ended.is_set():
                            return
                        more.clear()
                        await more.wait()
                    yield to_json(buf.popleft()) + b"\n"
            finally:
                watcher.cancel()
                _abort_soon(svc, call)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def healthz(request: Request) -> Response:
        ok = svc.ready.is_set()
        return JSONResponse(
            {"ready": ok, "frontend_id": svc.frontend_id, "pid": os.getpid(), "calls": len(svc.calls)},
            status_code=200 if ok else 503,
        )

    async def index(request: Request) -> Response:
        page = STATIC / "index.html"
        if page.exists():
            return FileResponse(page)
        return JSONResponse({"service": "duplexbus", "ws": "/generate/ws"})

    async def favicon(request: Request) -> Response:
        # A browser asks for /favicon.ico whatever the page says: both get the one icon.
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await svc.start()
        try:
            yield {DRAIN: svc.drain}  # the WebSocket protocol drains before it closes its socket
        finally:
            await hub.close()
            await svc.close()

    routes = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/favicon.svg", favicon),
        Route("/favicon.ico", favicon),
        Route("/generate", generate, methods=["POST"]),
        WebSocketRoute("/generate/ws", generate_ws),
        WebSocketRoute("/v1/realtime", realtime_ws),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = svc
    return app
