"""Server -> client messages of one client connection, bounded: a socket's, or a one-shot's."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

Reply = dict[str, Any] | bytes
"""A server -> client message: a dict, or one already serialized to JSON text (relayed
outputs, which go from the bus to the client as bytes, never decoded)."""

SEND_QUEUE = 8192  # messages waiting in a queued outbox for a slow reader; past it, overflow


def to_json(msg: Reply) -> bytes:
    """The message as JSON text, UTF-8."""
    return msg if isinstance(msg, bytes) else msgspec.json.encode(msg)


class Outbox:
    """Where a connection's calls put their messages. `send` never blocks.

    Two ways out. *Direct* (`write` given): each message is handed at once to the
    connection's own writer (the frontend's WebSocket protocol, which bounds what waits
    for a client that does not read, and drops that client); a connection already gone
    takes nothing. *Queued*: messages wait here for the connection's writer (`get`): a
    one-shot's NDJSON response, or a socket under another ASGI server. Past `limit`
    messages waiting, the client is not reading: `on_overflow` runs once and the outbox
    takes nothing more (the connection ends, and with it its calls).
    """

    def __init__(
        self,
        write: Callable[[bytes], None] | None = None,
        limit: int = SEND_QUEUE,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        self._write = write
        self.limit = limit
        self.on_overflow = on_overflow
        self._queue: deque[Reply] = deque()
        self._more = asyncio.Event()
        self.overflowed = False
        self.closed = False

    @property
    def direct(self) -> bool:
        return self._write is not None

    def send(self, msg: Reply) -> None:
        if self.overflowed or self.closed:
            return
        if self._write is not None:
            try:
                self._write(to_json(msg))
            except OSError:
                pass  # the connection is gone (or was just dropped): its calls are being aborted
            return
        if len(self._queue) >= self.limit:
            self.overflowed = True
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self._queue.append(msg)
        self._more.set()

    def last(self, msg: Reply) -> None:
        """One message past the bound (an overflow's own error line), then nothing more."""
        self._queue.append(msg)
        self._more.set()
        self.closed = True

    def close(self) -> None:
        """Nothing more is taken; `get` gives what waits, then None."""
        self.closed = True
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
        return self._queue.popleft()
