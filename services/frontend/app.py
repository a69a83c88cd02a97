"""HTTP and WebSocket endpoints: `WS /generate/ws`, `POST /generate`, `/healthz`, `/`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from duplexbus.services.frontend.calls import InputState
from duplexbus.services.frontend.protocol import AbortCall, Append, EndInput, Opening, ParseError, parse_message
from duplexbus.services.frontend.service import Call, FrontendService
from duplexbus.shared.config import ServingConfig
from duplexbus.shared.errors import Conflict, DuplexError, LimitExceeded, ProtocolError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
SEND_QUEUE = 8192  # server -> client messages waiting for a slow socket; past it the socket is closed


class SocketSession:
    """One WebSocket: its calls (by request_id), a bounded send queue and its writer."""

    def __init__(self, ws: WebSocket, service: FrontendService) -> None:
        self.ws = ws
        self.service = service
        self.calls: dict[str, Call] = {}
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(SEND_QUEUE)
        self.overflowed = False

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            # The client is not reading: better to end its socket than to buffer without bound.
            self.overflowed = True

    async def writer(self) -> None:
        while True:
            msg = await self.queue.get()
            if msg is None or self.overflowed:
                return
            await self.ws.send_text(json.dumps(msg, separators=(",", ":")))

    def live(self, rid: str) -> Call | None:
        call = self.calls.get(rid)
        if call is not None and call.ended.is_set():
            del self.calls[rid]
            return None
        return call

    async def handle(self, text: str) -> None:
        limit = self.service.config.max_message_mb * 1024 * 1024
        if len(text) > limit:
            err = LimitExceeded("max_message_mb", f"message of {len(text)} bytes is over {limit:.0f}")
            self.send({"request_id": None, "error": err.message, "status": err.status})
            return
        msg = parse_message(text)
        if isinstance(msg, ParseError):
            await self._refused(msg)
            return
        try:
            if isinstance(msg, Opening):
                await self._open(msg)
            elif isinstance(msg, Append | EndInput):
                await self._append(msg)
            elif isinstance(msg, AbortCall):
                call = self.live(msg.request_id)
                if call is None:
                    self.send(
                        {
                            "request_id": msg.request_id,
                            "error": "no live call with this request_id on this socket",
                            "status": 404,
                        }
                    )
                else:
                    await self.service.abort(call, "aborted by the client", 499, tell_client=True)
        except DuplexError as e:
            self.send({"request_id": getattr(msg, "request_id", None), "error": e.message, "status": e.status})

    async def _refused(self, p: ParseError) -> None:
        call = self.live(p.request_id) if p.request_id else None
        if p.append and call is not None:
            await self._reject_append(call, p.error)
            return
        body: dict[str, Any] = {"request_id": p.request_id, "error": p.error.message, "status": p.error.status}
        if p.append:
            body["append"] = True
        self.send(body)

    async def _open(self, o: Opening) -> None:
        if o.request_id is not None and self.live(o.request_id) is not None:
            raise Conflict(f"request_id {o.request_id!r} is already in use by a live call")
        call = await self.service.open_call(o, self.send, self)
        if o.request_id is not None:
            self.calls[o.request_id] = call

    async def _append(self, a: Append | EndInput) -> None:
        call = self.live(a.request_id)
        if call is None:
            err = "no live call with this request_id on this socket (ended, or opened elsewhere)"
            self.send({"request_id": a.request_id, "append": True, "status": 404, "error": err})
            return
        if call.input.state is not InputState.OPEN:
            self.send(
                {"request_id": a.request_id, "append": True, "status": 409, "error": "the call's input has ended"}
            )
            return
        try:
            if isinstance(a, Append):
                await self.service.append(call, a)
            else:
                await self.service.end_input(call, a)
        except DuplexError as e:
            await self._reject_append(call, e)

    async def _reject_append(self, call: Call, e: DuplexError) -> None:
        """A rejected append ends the call with its error and no finish."""
        await self.service.abort(call, e.message, e.status, tell_client=True)

    async def close(self) -> None:
        for call in list(self.calls.values()):
            await self.service.abort(call, "socket closed", 499)
        # one-shots without a request_id are not in self.calls
        for call in [c for c in self.service.calls.values() if c.owner is self]:
            await self.service.abort(call, "socket closed", 499)


def create_app(config: ServingConfig, service: FrontendService | None = None) -> Starlette:
    svc = service or FrontendService(config)

    async def generate_ws(ws: WebSocket) -> None:
        await ws.accept()
        session = SocketSession(ws, svc)
        writer = asyncio.get_running_loop().create_task(session.writer())
        try:
            while not session.overflowed:
                text = await ws.receive_text()
                await session.handle(text)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            await session.close()
            session.queue.put_nowait(None) if not session.queue.full() else None
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
            if session.overflowed:
                with contextlib.suppress(Exception):
                    await ws.close(1008, "client not reading")

    async def generate(request: Request) -> Response:
        body = await request.body()
        msg = parse_message(body)
        if isinstance(msg, ParseError):
            return JSONResponse({"error": msg.error.message, "status": 400}, status_code=400)
        if not isinstance(msg, Opening):
            err = ProtocolError("POST /generate takes an opening")
            return JSONResponse({"error": err.message, "status": 400}, status_code=400)
        msg.end_input = True  # one-shot
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SEND_QUEUE)

        def sink(m: dict[str, Any]) -> None:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(m)

        try:
            call = await svc.open_call(msg, sink, request)
        except DuplexError as e:
            return JSONResponse(
                {"request_id": msg.request_id, "error": e.message, "status": e.status}, status_code=e.status
            )

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    m = await queue.get()
                    yield (json.dumps(m, separators=(",", ":")) + "\n").encode()
                    if "finish" in m or ("error" in m and "append" not in m):
                        return
            finally:
                if not call.ended.is_set():
                    await svc.abort(call, "client went away", 499)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def healthz(request: Request) -> Response:
        ok = svc.ready.is_set()
        return JSONResponse(
            {"ready": ok, "frontend_id": svc.frontend_id, "calls": len(svc.calls)}, status_code=200 if ok else 503
        )

    async def index(request: Request) -> Response:
        page = STATIC / "index.html"
        if page.exists():
            return FileResponse(page)
        return JSONResponse({"service": "duplexbus", "ws": "/generate/ws"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await svc.start()
        try:
            yield
        finally:
            await svc.close()

    routes = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/generate", generate, methods=["POST"]),
        WebSocketRoute("/generate/ws", generate_ws),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = svc
    return app
