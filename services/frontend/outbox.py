"""Server -> client messages of one client connection, bounded: a socket's, or a one-shot's."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import msgspec


class Packed:
    """A server -> client message in msgpack, for a binary frame (a call opened in msgpack)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data  # held, not copied: outputs are spliced once and sent as they are


Reply = dict[str, Any] | bytes | Packed
"""A server -> client message: a dict, or one already serialized, to JSON text (bytes) or
to msgpack (`Packed`): relayed outputs, which go from the bus to the client never decoded."""

MESSAGE_COST = 64  # bytes a queued message costs beyond its text

_packer = msgspec.msgpack.Encoder()


def pack(msg: dict[str, Any]) -> Packed:
    """The message in msgpack: what a call opened in msgpack gets."""
    return Packed(_packer.encode(msg))


def to_json(msg: Reply) -> bytes:
    """The message as JSON text, UTF-8 (a packed one's bytes as base64, as JSON carries them)."""
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, Packed):
        return msgspec.json.encode(msgspec.msgpack.decode(msg.data))
    return msgspec.json.encode(msg)


class Outlet(Protocol):
    """A connection that takes messages without awaiting and bounds what waits for its
    client (`websocket.FrontendWebSocketProtocol`)."""

    on_room: Callable[[], None] | None  # set by the outbox: what waits drained (to half the bound)

    # A text frame (UTF-8), or a binary one; raises OSError where the connection is gone.
    def send_now(self, payload: bytes, binary: bool = False) -> None: ...
    def has_room(self) -> bool: ...


class _Function:
    """A plain function as an outlet that always has room (a test, a simple writer)."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self.on_room: Callable[[], None] | None = None

    def send_now(self, payload: bytes, binary: bool = False) -> None:
        self._write(payload)

    def has_room(self) -> bool:
        return True


class Outbox:
    """Where a connection's calls put their messages. `send` never blocks, and what waits
    for the client is bounded.

    Two ways out. *Direct* (an `outlet`): each message is handed at once to the
    connection, which holds what the client has not read yet; a connection already gone
    takes nothing. *Queued*: messages wait here for the connection's writer (`get`): a
    one-shot's NDJSON response, or a socket under another ASGI server.

    Past `pause_at` bytes waiting, `has_room()` is False: calls stop relaying their
    outputs, which wait in the stream, and each is told (`when_room`) once what waits has
    drained to half. Their other messages (replies, finishes, errors) are still taken, up
    to twice `pause_at` (queued; the outlet bounds its own): past that the client is not
    reading, `on_overflow` runs once, and the outbox takes nothing more.
    """

    def __init__(
        self,
        outlet: Outlet | Callable[[bytes], None] | None = None,
        pause_at: int = 16 * 1024 * 1024,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        self._outlet: Outlet | None = _Function(outlet) if callable(outlet) else outlet
        if self._outlet is not None:
            self._outlet.on_room = self._room
        self.pause_at = pause_at
        self.on_overflow = on_overflow
        self._queue: deque[Reply] = deque()
        self._queued_bytes = 0
        self._more = asyncio.Event()
        self._waiting: dict[str, Callable[[], None]] = {}
        self.overflowed = False
        self.closed = False

    @property
    def direct(self) -> bool:
        return self._outlet is not None

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def send(self, msg: Reply) -> None:
        if self.overflowed or self.closed:
            return
        if self._outlet is not None:
            try:
                if isinstance(msg, Packed):
                    self._outlet.send_now(msg.data, binary=True)
                else:
                    self._outlet.send_now(to_json(msg))
            except OSError:
                pass  # the connection is gone (or was just dropped): its calls are being aborted
            return
        size = _size(msg)
        if self._queued_bytes + size > 2 * self.pause_at:
            self.overflowed = True
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self._queue.append(msg)
        self._queued_bytes += size
        self._more.set()

    def has_room(self) -> bool:
        """Outputs may be relayed now; otherwise they wait in the stream (`when_room`)."""
        if self._outlet is not None:
            return self._outlet.has_room()
        return self._queued_bytes < self.pause_at

    def when_room(self, key: str, then: Callable[[], None]) -> None:
        """Call `then` (once, the last one given under `key`) when what waits has drained."""
        self._waiting[key] = then

    def _room(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for then in waiting.values():
            then()

    def last(self, msg: Reply) -> None:
        """One message past the bound (an overflow's own error line), then nothing more."""
        self._queue.append(msg)
        self._queued_bytes += _size(msg)
        self._more.set()
        self.closed = True

    def close(self) -> None:
        """Nothing more is taken; `get` gives what waits, then None."""
        self.closed = True
        self._waiting.clear()
        self._more.set()

    def __len__(self) -> int:
        return len(self._queue)

    async def get(self) -> Reply | None:
        """The next queued message; None once the outbox is closed (or overflowed) and empty."""
        while not self._queue:
            if self.closed or self.overflowed:
                return None
            self._more.clear()
            await self._more.wait()
        msg = self._queue.popleft()
        before = self._queued_bytes
        self._queued_bytes -= _size(msg)
        if before >= self.pause_at // 2 > self._queued_bytes and self._waiting:
            self._room()
        return msg


def _size(msg: Reply) -> int:
    """What a queued message costs: its text, or an estimate for a dict not encoded yet."""
    if isinstance(msg, bytes):
        return len(msg) + MESSAGE_COST
    if isinstance(msg, Packed):
        return len(msg.data) + MESSAGE_COST
    return len(msgspec.json.encode(msg)) + MESSAGE_COST
