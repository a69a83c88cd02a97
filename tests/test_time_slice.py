"""A socket whose messages are always ready gives the frontend's loop back every few ms.

Awaiting a queue that is not empty does not yield: before, twenty fast uploads (256 queued
appends each, about a millisecond apiece) held the loop for 2 to 3 s at a time, and the
frontend's heartbeats came so late that the conductor aborted its calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from services.frontend import app
from services.frontend.socket_session import SocketSession


class ReadyQueue:
    """A socket with `n` messages read ahead: `receive` returns without yielding."""

    def __init__(self, n: int) -> None:
        self.left = n

    async def receive(self) -> dict[str, Any]:
        if self.left == 0:
            return {"type": "websocket.disconnect"}
        self.left -= 1
        return {"type": "websocket.receive", "text": "{}"}


class BusySession:
    """Each message costs a millisecond of CPU, as a fast upload's append does on a small machine."""

    class outbox:
        overflowed = False

    async def handle(self, data: str | bytes) -> None:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass


async def test_a_socket_with_messages_always_ready_lets_the_loop_run_every_few_ms() -> None:
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    ws, session = ReadyQueue(256), BusySession()
    await app._read_all(cast(Any, ws), cast(SocketSession, session))
    took = time.perf_counter() - start
    tick.cancel()
    assert ws.left == 0 and took >= 0.25  # all 256 handled
    assert len(gaps) >= 20, f"the loop ran {len(gaps)} times in {took:.2f} s"
    assert max(gaps) < 0.1, f"the loop was held for {max(gaps):.3f} s"  # before: the whole 0.26 s
