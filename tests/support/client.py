"""A client socket for protocol tests, what ends a call, and a raw client for hostile ones."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

import httpx
import msgspec
import numpy as np
import pytest
import websockets

from tests.support.audio import pcm

Message = dict[str, Any]


class PackedMessage(dict[str, Any]):
    """A message that came in a binary frame (msgpack)."""


class Predicate(Protocol):
    """A test on one message. A Protocol rather than a Callable type so that a lambda that
    binds a loop variable (`lambda m, rid=rid: ...`) still type-checks."""

    def __call__(self, m: Message, /) -> object: ...


def is_final(m: Message) -> bool:
    """Whether a reply ends its call: the finish, or an error that is not an append's (those leave the call running)."""
    return "finish" in m or ("error" in m and not m.get("append"))


class WS:
    """A client socket with a receive buffer, for protocol tests."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.inbox: list[Message] = []

    @classmethod
    async def connect(cls, url: str) -> WS:
        # max_queue=None: the connection reads whatever comes, however long the test leaves
        # it in the buffer. With websockets' default (16 frames) it stops reading the socket
        # once a test that only sends (a live call that reads its outputs at the end) has 16
        # unread: its keepalive pongs then wait behind them, and 20 s after its next ping it
        # closes its own call (1011 "keepalive ping timeout"). A real client reads as it goes.
        # ping_interval=None: no keepalive pings of its own. Every wait of a test has its own
        # timeout, and each ping's payload is drawn from the global `random` module: drawn in
        # a thread of live calls while Hypothesis draws an example in the test's thread, it
        # is taken for a strategy that uses `random`, a warning, so an error (a flaky fuzz run).
        return cls(await websockets.connect(url, max_size=None, max_queue=None, ping_interval=None))

    async def send(self, msg: Message | str) -> None:
        await self.ws.send(msg if isinstance(msg, str) else json.dumps(msg))

    async def send_packed(self, msg: Message) -> None:
        """The message in msgpack, as a binary frame (files' data as bytes)."""
        await self.ws.send(msgspec.msgpack.encode(msg))

    async def recv(self, timeout: float = 10.0) -> Message:
        """The next message; one in a binary frame is msgpack, and a `PackedMessage`."""
        data = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(data, bytes) and data[:1] != b"{":
            return PackedMessage(msgspec.msgpack.decode(data))
        m: Message = json.loads(data)
        return m

    async def until(self, pred: Predicate, timeout: float = 20.0, keep: bool = False) -> Message:
        """The first message (kept or new) matching pred; others stay in the inbox (it too, with keep)."""
        for i, m in enumerate(self.inbox):
            if pred(m):
                return m if keep else self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message; inbox: {[_short(m) for m in self.inbox[-5:]]}")
            m = await self.recv(left)
            if pred(m):
                if keep:
                    self.inbox.append(m)
                return m
            self.inbox.append(m)

    async def final(self, rid: str | None, timeout: float = 20.0) -> Message:
        """The finish or error that ends call `rid` (None: a one-shot without a request_id)."""
        return await self.until(lambda m: m.get("request_id") == rid and is_final(m), timeout)

    def outputs(self, rid: str | None) -> list[Message]:
        """The outputs of call `rid` received so far, taken out of the inbox."""
        out = [m["output"] for m in self.inbox if m.get("request_id") == rid and "output" in m]
        self.inbox = [m for m in self.inbox if not (m.get("request_id") == rid and "output" in m)]
        return out

    async def close(self) -> None:
        await self.ws.close()


async def nothing_for(ws: WS, pred: Predicate, seconds: float) -> None:
    """No message matching pred comes on `ws` for `seconds` (the others received meanwhile stay in its inbox)."""
    with pytest.raises(TimeoutError):
        await ws.until(pred, timeout=seconds)


def _short(m: Message) -> Message:
    if "output" in m and isinstance(m["output"], dict) and "audio" in m["output"]:
        return {**m, "output": {**m["output"], "audio": "..."}}
    return m


class RawWS:
    """A WebSocket client that sends whatever frames a test asks for (fragments never
    finished, a frame cut short, any opcode), for hostile-client tests; websockets'
    sans-I/O client protocol over a plain TCP stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any) -> None:
        self.reader, self.writer, self.proto = reader, writer, proto
        self.texts: list[str] = []

    @classmethod
    async def connect(cls, url: str, timeout: float = 10.0) -> RawWS:
        from websockets.client import ClientProtocol
        from websockets.protocol import State
        from websockets.uri import parse_uri

        uri = parse_uri(url)
        proto = ClientProtocol(uri, max_size=None)
        reader, writer = await asyncio.open_connection(uri.host, uri.port)
        proto.send_request(proto.connect())
        writer.write(b"".join(proto.data_to_send()))
        deadline = time.monotonic() + timeout
        while proto.state is State.CONNECTING:
            data = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not data:
                raise ConnectionError("closed during the handshake")
            proto.receive_data(data)
        if proto.handshake_exc is not None:
            raise proto.handshake_exc
        ws = cls(reader, writer, proto)
        ws._take_events()
        return ws

    def _take_events(self) -> None:
        from websockets.frames import Frame, Opcode

        for e in self.proto.events_received():
            if isinstance(e, Frame) and e.opcode is Opcode.TEXT:
                self.texts.append(bytes(e.data).decode())

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def text(self, data: bytes, fin: bool = True) -> None:
        self.proto.send_text(data, fin=fin)
        await self.write(b"".join(self.proto.data_to_send()))

    async def continuation(self, data: bytes, fin: bool) -> None:
        self.proto.send_continuation(data, fin=fin)
        await self.write(b"".join(self.proto.data_to_send()))

    def frame_bytes(self, data: bytes) -> bytes:
        """One whole text frame as it goes on the wire (a test may send only part of it)."""
        self.proto.send_text(data)
        return b"".join(self.proto.data_to_send())

    async def recv_json(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.texts:
            data = await asyncio.wait_for(self.reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not data:
                raise ConnectionError("closed")
            self.proto.receive_data(data)
            self._take_events()
        return dict(json.loads(self.texts.pop(0)))

    async def closed(self, timeout: float = 10.0) -> tuple[int | None, str]:
        """Read until the server closes the connection: (its close code, reason), or (None, "")
        where it dropped the connection without a close frame."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                data = await asyncio.wait_for(self.reader.read(65536), max(0.01, deadline - time.monotonic()))
                if not data:
                    break
                self.proto.receive_data(data)
                self._take_events()
                self.writer.write(b"".join(self.proto.data_to_send()))  # our half of the closing handshake
        except (ConnectionResetError, BrokenPipeError):
            pass
        rcvd = self.proto.close_rcvd
        return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")

    def close(self) -> None:
        self.writer.close()


async def post_one_shot(http_url: str, samples: np.ndarray, timeout: float = 300.0) -> list[Message]:
    """`POST /generate` of `samples` as one raw PCM file: the NDJSON lines of the answer."""
    body = json.dumps({"files": [{"name": "a.pcm", "data": pcm(samples)}]})
    lines = []
    async with httpx.AsyncClient(base_url=http_url, timeout=timeout) as client:
        async with client.stream("POST", "/generate", content=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    lines.append(json.loads(line))
    return lines
