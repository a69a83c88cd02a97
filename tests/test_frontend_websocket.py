"""The frontend's WebSocket protocol against a recording transport (no network): outgoing
messages coalesce into one write per event-loop turn, reading pauses only past
MAX_INBOUND waiting messages, and a client over max_send_buffer is dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.server import ServerState
from websockets.frames import Frame, Opcode
from websockets.protocol import CLIENT
from websockets.protocol import Protocol as WsProtocol

from services.frontend.websocket import MAX_INBOUND, SEND_NOW, FrontendWebSocketProtocol

HANDSHAKE = (
    b"GET /generate/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.paused = 0
        self.resumed = 0
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0

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
