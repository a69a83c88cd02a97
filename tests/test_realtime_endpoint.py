"""The realtime endpoint's shell in process, without NATS or a server: a stand-in socket
drives `RealtimeHub` and its `EventSender` (their task handling and what they tell a client)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.frontend.realtime import endpoint
from services.frontend.realtime.endpoint import EventSender, LiveSession, RealtimeHub
from services.frontend.service import FrontendService
from shared.runtime.config import ServingConfig
from tests.support.poll import until

SLOW_STOP_S = 0.3
MAX_BYTES = 2000  # max_send_buffer_mb of these outboxes: past twice this the client is not reading


async def slow_cleanup() -> None:
    """SLOW_STOP_S of cleanup that a second cancel does not cut short."""
    loop = asyncio.get_running_loop()
    end = loop.time() + SLOW_STOP_S
    while (left := end - loop.time()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            pass


class StandInSocket:
    """What the endpoint uses of a Starlette WebSocket. No `send_now` extension: the outbox
    queues and has a writer task, as under an ASGI server other than the frontend's own.
    `receive` never returns and, like `send_text` once `stall_sends` is set, takes a while
    to stop when cancelled."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"type": "websocket", "extensions": {}}
        self.sent: list[str] = []
        self.closed: list[tuple[int, str]] = []
        self.stall_sends = False
        self.receiving = False  # a receive is under way (the handler is running)
        self.stalled = 0  # sends stuck so far

    async def receive(self) -> dict[str, Any]:
        self.receiving = True
        try:
            await asyncio.Event().wait()
        finally:
            await slow_cleanup()
        raise AssertionError("unreachable")

    async def send_text(self, text: str) -> None:
        if self.stall_sends:
            self.stalled += 1
            try:
                await asyncio.Event().wait()
            finally:
                await slow_cleanup()
        self.sent.append(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed.append((code, reason))


def as_ws(sock: StandInSocket) -> WebSocket:
    return cast(WebSocket, sock)


def live_session(hub: RealtimeHub) -> LiveSession:
    return hub._session("echo", hub.svc.model("echo"))


@pytest.fixture
def hub() -> RealtimeHub:
    return RealtimeHub(FrontendService(ServingConfig(model="echo")))


async def cancelled_while_waiting(handler: asyncio.Task[None]) -> BaseException | None:
    await asyncio.sleep(SLOW_STOP_S / 3)  # the handler is waiting for a task of its own to stop
    assert not handler.done()
    handler.cancel()
    result = (await asyncio.gather(handler, return_exceptions=True))[0]
    return result if isinstance(result, BaseException) else None


@pytest.mark.parametrize("flush_s", [0.0, 2.0], ids=["while-stopping", "while-flushing"])
async def test_cancelling_a_handler_while_its_outbox_writer_stops_is_not_swallowed(
    flush_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler closes the outbox, whose writer is stuck sending: it waits up to
    CLOSE_FLUSH_S for it, then stops it (which takes a while). Cancelled in either wait, the
    cancellation goes on up, and the writer does not outlive it."""
    monkeypatch.setattr(endpoint, "CLOSE_FLUSH_S", flush_s)
    sock = StandInSocket()
    sock.stall_sends = True
    outbox = EventSender(as_ws(sock), MAX_BYTES)
    outbox.send(b'{"type": "x"}')
    await until(lambda: sock.stalled, 5, "the writer stuck sending")
    after: list[str] = []

    async def handler() -> None:
        await outbox.close(1000, "bye")
        after.append("went on")  # ran when the handler's own cancellation was swallowed

    got = await cancelled_while_waiting(asyncio.create_task(handler()))
    assert isinstance(got, asyncio.CancelledError) and after == []
    assert outbox.writer is not None
    await asyncio.wait({outbox.writer}, timeout=5)
    assert outbox.writer.cancelled()


async def test_cancelling_a_handler_while_its_receive_stops_is_not_swallowed(hub: RealtimeHub) -> None:
    """The session ends (a Close from the core) while a receive is pending; the handler is
    cancelled as it waits for that receive to stop: the cancellation goes on up, and the
    session was closed and its socket closed all the same."""
    sock = StandInSocket()
    outbox = EventSender(as_ws(sock), MAX_BYTES)
    session = live_session(hub)
    session.attach(outbox)
    after: list[str] = []

    async def handler() -> None:
        await hub._run(as_ws(sock), outbox, session)
        after.append("went on")

    task = asyncio.create_task(handler())
    await until(lambda: sock.receiving, 5, "the handler receiving")
    session.close_code = (1000, "session closed")
    session.closed.set()
    got = await cancelled_while_waiting(task)
    assert isinstance(got, asyncio.CancelledError) and after == []
    assert sock.closed == [(1000, "session closed")]


async def test_a_client_not_reading_is_told_by_a_close_and_counted_not_dropped_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sock = StandInSocket()
    sock.stall_sends = True  # the client reads nothing: the writer's first send never ends
    overflows: list[int] = []
    outbox = EventSender(as_ws(sock), MAX_BYTES, on_overflow=lambda: overflows.append(1))
    event = b'{"type": "response.output_audio.delta", "delta": "' + b"A" * 100 + b'"}'
    with caplog.at_level(logging.WARNING, logger="services.frontend.realtime.endpoint"):
        for _ in range(40):  # past twice MAX_BYTES
            outbox.send(event)
            await asyncio.sleep(0)
    assert overflows == [1] and outbox.gone.is_set()
    assert any("client not reading" in r.getMessage() for r in caplog.records)
    await outbox.close(1000, "bye")
    assert sock.closed == [(1008, "client not reading")] and sock.sent == []
    assert outbox.writer is not None and outbox.writer.done()


async def test_a_session_whose_client_is_not_reading_waits_for_a_resume(hub: RealtimeHub) -> None:
    """The socket is closed (1008) and the session detached, as after any drop: its events
    are in the stream, and a resume reads what the client missed from there."""
    sock = StandInSocket()
    sock.stall_sends = True
    outbox = EventSender(as_ws(sock), MAX_BYTES, hub._overflowed)
    session = live_session(hub)
    session.attach(outbox)
    run = asyncio.create_task(hub._run(as_ws(sock), outbox, session))
    await until(lambda: sock.receiving, 5, "the handler receiving")
    for i in range(40):
        session.deliver(session.core.error("invalid_value", f"event {i} the client does not read"))
    await asyncio.wait_for(run, 10)
    try:
        assert hub.overflows == 1 and sock.closed == [(1008, "client not reading")]
        assert hub.detached == {session.core.resume_token: session} and session.outbox is None
    finally:
        await session.end("test over")
    assert not hub.detached


class LeftSocket(StandInSocket):
    """A socket whose client has left: a send or close raises as Starlette raises it then."""

    async def close(self, code: int = 1000, reason: str = "") -> None:
        raise WebSocketDisconnect(code=1006)


async def test_closing_a_socket_whose_client_left_raises_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Starlette turns the server's ClientDisconnected into WebSocketDisconnect: raised out of
    the handler, uvicorn logged "Exception in ASGI application" for nearly every session."""
    outbox = EventSender(as_ws(LeftSocket()), MAX_BYTES)
    with caplog.at_level(logging.INFO):
        await outbox.close(1001, "session detached")
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


class OneMessageSocket(StandInSocket):
    """Receives one event, then waits as StandInSocket does."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message: str | None = message

    async def receive(self) -> dict[str, Any]:
        if self.message is not None:
            text, self.message = self.message, None
            return {"type": "websocket.receive", "text": text}
        return await super().receive()


async def test_a_bug_in_the_handler_goes_up_to_the_server_and_is_logged_once_there(
    hub: RealtimeHub, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of our own is no client leaving: it is raised out of the handler (the ASGI
    server logs it, once) and the endpoint logs nothing of it itself."""

    async def broken(self: LiveSession, data: str | bytes) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(LiveSession, "handle", broken)
    sock = OneMessageSocket('{"type": "session.heartbeat"}')
    outbox = EventSender(as_ws(sock), MAX_BYTES)
    session = live_session(hub)
    session.attach(outbox)
    with caplog.at_level(logging.DEBUG, logger="services.frontend"), pytest.raises(RuntimeError, match="a bug"):
        await hub._run(as_ws(sock), outbox, session)
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await session.end("test over")


def test_the_beta_interface_is_asked_for_by_header_or_by_subprotocol() -> None:
    assert endpoint.asks_for_beta("realtime=v1", [])
    assert endpoint.asks_for_beta("assistants=v2, Realtime=v1", [])
    assert endpoint.asks_for_beta(None, ["realtime", "openai-beta.realtime-v1"])
    assert not endpoint.asks_for_beta(None, ["realtime", "openai-insecure-api-key.x"])
    assert not endpoint.asks_for_beta("assistants=v2", [])
