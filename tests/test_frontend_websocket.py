"""The frontend's WebSocket protocol against a recording transport (no network): outgoing
messages coalesce into one write per event-loop turn, reading pauses only past
MAX_INBOUND waiting messages, and a client over max_send_buffer is dropped."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.server import ServerState
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import CLIENT
from websockets.protocol import Protocol as WsProtocol

from services.frontend.limits import Guard, Limits
from services.frontend.websocket import (
    GUARD,
    MAX_INBOUND,
    OP_BINARY,
    OP_TEXT,
    OUTLET,
    SEND_NOW,
    FrontendWebSocketProtocol,
    frame_header,
)

HANDSHAKE = (
    b"GET /generate/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.buffered = 0  # what the client has not read (get_write_buffer_size)
        self.paused = 0
        self.resumed = 0
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)


async def _accepted(max_send_buffer: int = 1 << 20) -> tuple[FrontendWebSocketProtocol, RecordingTransport, dict[str, Any]]:
    """A protocol past the handshake, with an app that accepts and then only listens."""
    scopes: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scopes.append(scope)
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await asyncio.Event().wait()

    config = Config(app=app, ws_per_message_deflate=False, log_level="warning")
    config.load()
    proto = FrontendWebSocketProtocol.with_send_buffer(max_send_buffer)(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    proto.connection_made(transport)
    proto.data_received(HANDSHAKE)
    for _ in range(5):
        await asyncio.sleep(0)
    assert proto.handshake_complete and transport.writes[0].startswith(b"HTTP/1.1 101")
    transport.writes.clear()
    return proto, transport, scopes[0]


def _client_frames(n: int) -> bytes:
    client = WsProtocol(CLIENT)
    for i in range(n):
        client.send_text(f'{{"request_id": "r{i}"}}'.encode())
    return b"".join(client.data_to_send())


async def test_messages_sent_in_one_turn_leave_in_one_write() -> None:
    proto, transport, scope = await _accepted()
    send_now = scope["extensions"][SEND_NOW]
    for i in range(10):
        send_now(f'{{"n": {i}}}'.encode())
    assert transport.writes == []  # nothing written until the loop turns
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    reader = WsProtocol(CLIENT)
    reader.receive_data(transport.writes[0])
    frames = [e for e in reader.events_received() if isinstance(e, Frame) and e.opcode is Opcode.TEXT]
    assert [f.data for f in frames] == [f'{{"n": {i}}}'.encode() for i in range(10)]
    proto.connection_lost(None)


async def test_reading_pauses_only_past_max_inbound() -> None:
    proto, transport, _ = await _accepted()
    proto.data_received(_client_frames(MAX_INBOUND - 1))
    assert transport.paused == 0 and proto.queue.qsize() == MAX_INBOUND - 1
    proto.data_received(_client_frames(1))
    assert transport.paused == 1
    while not proto.queue.empty():
        await proto.receive()
    assert transport.resumed == 1
    proto.connection_lost(None)


async def test_client_over_the_send_buffer_is_dropped() -> None:
    proto, transport, scope = await _accepted(max_send_buffer=10_000)
    send_now = scope["extensions"][SEND_NOW]
    with pytest.raises(ClientDisconnected):
        for _ in range(100):
            send_now(b"x" * 500)
    assert transport.aborted
    proto.connection_lost(None)
    assert proto.queue.get_nowait() == {"type": "websocket.disconnect", "code": 1005}  # the app hears of it


# -- limits (limits.Guard) and flow control ----------------------------------------
async def _guarded(limits: Limits) -> tuple[FrontendWebSocketProtocol, RecordingTransport, dict[str, Any], Guard]:
    guard = Guard(limits)
    scopes: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scopes.append(scope)
        await receive()
        await send({"type": "websocket.accept"})
        await asyncio.Event().wait()

    config = Config(app=app, ws_per_message_deflate=False, log_level="warning")
    config.load()
    proto = FrontendWebSocketProtocol(config=config, server_state=ServerState(), app_state={GUARD: guard})
    transport = RecordingTransport()
    proto.connection_made(transport)
    proto.data_received(HANDSHAKE)
    for _ in range(5):
        await asyncio.sleep(0)
    transport.writes.clear()
    return proto, transport, scopes[0], guard


def _limits(**kw: Any) -> Limits:
    base: dict[str, Any] = dict(
        max_connections=10,
        memory_bytes=1 << 30,
        send_buffer_bytes=10_000,
        header_timeout_s=10,
        message_timeout_s=1.0,
        send_timeout_s=5.0,
        idle_timeout_s=60,
    )
    return Limits(**{**base, **kw})


def _fragment(data: bytes, first: bool) -> bytes:
    client = WsProtocol(CLIENT)
    if first:
        client.send_text(data, fin=False)
    else:  # a continuation: the client protocol must believe a message is under way
        client.send_text(b"", fin=False)
        client.data_to_send()
        client.send_continuation(data, fin=False)
    return b"".join(client.data_to_send())


def _close_frame(transport: RecordingTransport) -> tuple[int, str]:
    reader = WsProtocol(CLIENT)
    reader.receive_data(b"".join(transport.writes))
    for e in reader.events_received():
        if isinstance(e, Frame) and e.opcode is Opcode.CLOSE:
            c = Close.parse(e.data)
            return c.code, c.reason
    raise AssertionError("no close frame")


async def test_an_unfinished_message_is_accounted_and_ends_with_1008() -> None:
    proto, transport, _, guard = await _guarded(_limits())
    proto.data_received(_fragment(b"x" * 50_000, first=True))
    proto.data_received(_fragment(b"y" * 50_000, first=False))
    assert guard.total >= 100_000  # both fragments held, and reported
    load = proto.load(time.monotonic())
    assert load.input >= 100_000 and load.message_since is not None
    shed = guard.sweep(time.monotonic() + 1.5)
    assert [(c, w.key) for c, w in shed] == [(proto, "message_timeout_s")]
    proto.shed(shed[0][1])
    assert _close_frame(transport)[0] == 1008 and proto.frames == []
    assert proto.queue.get_nowait() == {"type": "websocket.disconnect", "code": 1008, "reason": shed[0][1].reason}
    assert not transport.aborted  # the closing handshake lingers: what the client still sends is read
    proto.data_received(_fragment(b"z" * 50_000, first=False))
    assert proto.frames == []  # and dropped
    proto.connection_lost(None)
    assert guard.total == 0 and len(guard) == 0


async def test_over_the_budget_the_newest_socket_gets_1013() -> None:
    old, t_old, _, guard = await _guarded(_limits(memory_bytes=150_000))
    new, t_new, _, _ = await _guarded(_limits())  # a guard of its own: adopt it into the first
    guard.adopt(new)
    new.guard = guard
    old.guard = guard
    old.data_received(_fragment(b"a" * 100_000, first=True))
    new.data_received(_fragment(b"b" * 100_000, first=True))  # 200 KB against 150 KB: the newest goes
    assert _close_frame(t_new)[0] == 1013 and not t_old.writes
    assert guard.total < 150_000


async def test_outputs_pause_past_the_send_buffer_and_resume_at_half() -> None:
    proto, transport, scope, _ = await _guarded(_limits(send_buffer_bytes=10_000))
    outlet = scope["extensions"][OUTLET]
    room: list[int] = []
    outlet.on_room = lambda: room.append(1)
    transport.buffered = 12_000  # the client has not read this much
    assert not outlet.has_room()
    proto.pause_writing()
    transport.buffered = 4_000
    proto.resume_writing()  # the transport drained below its low-water mark (half the bound)
    assert room == [1] and outlet.has_room()
    proto.connection_lost(None)


async def test_a_client_that_reads_nothing_is_found_stalled_and_a_ping_behind_output_waits() -> None:
    proto, transport, _, guard = await _guarded(_limits(send_timeout_s=5.0))
    t0 = time.monotonic()
    transport.buffered = 50_000
    assert proto.load(t0).stalled_since is not None
    proto.keepalive_timeout()  # no pong yet: it waits behind what the client has not read
    assert not transport.aborted and proto.pong_timer is not None
    proto.pong_timer.cancel()
    shed = guard.sweep(t0 + 6.0)
    assert [w.key for _, w in shed] == ["send_timeout_s"] and shed[0][1].drop
    proto.shed(shed[0][1])
    assert transport.aborted  # dropped: a close frame would wait behind the rest
    proto.connection_lost(None)


async def test_an_unfinished_message_is_not_timed_while_the_socket_is_not_read() -> None:
    """Reading paused because the app is behind (or holds input while the bus is backed up):
    the client cannot finish its message, so its time counts only once reading resumes.
    Before, twenty uploads held so for 30 s were closed with 1008 message_timeout_s."""
    proto, transport, _, guard = await _guarded(_limits(message_timeout_s=1.0))
    proto.data_received(_client_frames(MAX_INBOUND))  # the app reads nothing: reading pauses
    assert proto.read_paused and transport.paused == 1
    proto.data_received(_fragment(b"x" * 1000, first=True))  # already on its way: half a message
    assert proto.load(time.monotonic()).message_since is None
    assert guard.sweep(time.monotonic() + 5) == []  # held for 5 s: nothing to blame the client for
    while not proto.queue.empty():
        await proto.receive()
    assert not proto.read_paused
    since = proto.load(time.monotonic()).message_since
    assert since is not None and time.monotonic() - since < 0.5  # timed from the resume
    assert [w.key for _, w in guard.sweep(time.monotonic() + 1.5)] == ["message_timeout_s"]
    proto.connection_lost(None)


async def test_a_pong_behind_an_upload_this_side_has_not_read_is_waited_for() -> None:
    """A fast upload fills the socket's queue and reading pauses; the client's pong is behind
    what it sent before it. Before, twenty such uploads were closed with 1011 keepalive ping
    timeout while the frontend worked through them. Once reading has resumed for a
    ping_timeout (a client that is gone sends nothing more), the timeout ends it as before."""
    proto, transport, _ = await _accepted()
    proto.ping_timeout = 0.2
    proto.data_received(_client_frames(MAX_INBOUND))  # the app reads nothing: reading pauses
    assert proto.read_paused
    proto.keepalive_timeout()
    assert not transport.aborted and proto.pong_timer is not None  # waited for again
    proto.pong_timer.cancel()
    while not proto.queue.empty():
        await proto.receive()
    assert not proto.read_paused
    proto.keepalive_timeout()  # just resumed: what it sent before the pong is still coming
    assert not transport.aborted and proto.pong_timer is not None
    proto.pong_timer.cancel()
    await asyncio.sleep(0.25)
    proto.keepalive_timeout()  # read all along for a ping_timeout, and no pong: gone
    assert transport.aborted and proto.close_sent
    proto.connection_lost(None)


@pytest.mark.parametrize("n", [0, 1, 125, 126, 3502, 65535, 65536, 200_000])
def test_a_frame_header_written_here_is_the_one_websockets_writes(n: int) -> None:
    payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
    for binary, opcode in ((False, Opcode.TEXT), (True, Opcode.BINARY)):
        mine = frame_header(OP_BINARY if binary else OP_TEXT, n) + payload
        assert mine == Frame(opcode, payload).serialize(mask=False, extensions=[]), (n, binary)


async def test_outputs_are_framed_here_and_read_by_a_client_as_websockets_frames_them(monkeypatch: pytest.MonkeyPatch) -> None:
    proto, transport, scope = await _accepted()
    send_now = scope["extensions"][SEND_NOW]
    framed = []

    def counting(payload: bytes) -> None:  # websockets' own framing: not used for a plain frame
        framed.append(payload)

    monkeypatch.setattr(proto.conn, "send_text", counting)
    monkeypatch.setattr(proto.conn, "send_binary", counting)
    sent = [b"x" * n for n in (3, 200, 70_000)]
    for i, payload in enumerate(sent):
        send_now(payload, binary=bool(i % 2))
    await asyncio.sleep(0)
    assert framed == [] and len(transport.writes) == 1
    reader = WsProtocol(CLIENT)
    reader.receive_data(transport.writes[0])
    frames = [e for e in reader.events_received() if isinstance(e, Frame)]
    assert [(f.opcode, bytes(f.data)) for f in frames] == [
        (Opcode.TEXT, sent[0]),
        (Opcode.BINARY, sent[1]),
        (Opcode.TEXT, sent[2]),
    ]
    proto.connection_lost(None)


async def test_once_the_client_closes_an_output_is_refused_as_websockets_refuses_it() -> None:
    proto, _, scope = await _accepted()
    send_now = scope["extensions"][SEND_NOW]
    client = WsProtocol(CLIENT)
    client.send_close(1000)
    proto.data_received(b"".join(client.data_to_send()))  # the server answers the close: not OPEN
    with pytest.raises(ClientDisconnected):
        send_now(b"late")
    proto.connection_lost(None)
