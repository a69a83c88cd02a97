"""Messages a call has once, stored with an ack in order from one task (`StoreBehind`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _ToStore:
    subject: str
    body: bytes
    then: Callable[[], Awaitable[None]] | None


class StoreBehind:
    """Messages a call has once (edge end, done, abort) stored with an ack, in order, from
    one task of their own (`run`), so the caller does not wait a round trip per message: a
    worker's step that ends many calls goes on to its next step at once.

    Whatever is queued when the task wakes is written at once and the acks awaited
    together. A message the stream did not take (the server restarting, a timeout) is sent
    again, after a pause that doubles up to `max_pause_s`, until it is stored: the stream
    drops repeats by `Nats-Msg-Id` (`BusConnection.store_once`). Only such a retry can put a
    message after one queued later. `then` runs once its message is stored. The queue
    holds at most a few messages per call its owner holds, so it needs no other bound.
    """

    def __init__(self, publish: Callable[[str, bytes], Awaitable[None]], max_pause_s: float = 2.0) -> None:
        self._publish = publish
        self._queue: deque[_ToStore] = deque()
        self._ready = asyncio.Event()
        self._in_flight = 0
        self.max_pause_s = max_pause_s
        self.retries = 0

    def put(self, subject: str, body: bytes, then: Callable[[], Awaitable[None]] | None = None) -> None:
        self._queue.append(_ToStore(subject, body, then))
        self._ready.set()

    def __len__(self) -> int:
        """Messages not yet stored (or stored, their `then` still running)."""
        return len(self._queue) + self._in_flight

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                batch = list(self._queue)
                self._queue.clear()
                self._in_flight = len(batch)
                try:
                    await self._store(batch)
                    for m in batch:
                        if m.then is not None:
                            try:
                                await m.then()
                            except Exception:
                                log.exception("after storing %s", m.subject)
                finally:
                    self._in_flight = 0

    async def _store(self, batch: list[_ToStore]) -> None:
        pause = 0.05
        while True:
            results = await asyncio.gather(*(self._publish(m.subject, m.body) for m in batch), return_exceptions=True)
            failed = [m for m, r in zip(batch, results, strict=True) if isinstance(r, Exception)]
            if not failed:
                return
            errors = sorted({type(r).__name__ for r in results if isinstance(r, Exception)})
            log.warning("%d message(s) not stored (%s), sending again in %.2fs", len(failed), ", ".join(errors), pause)
            self.retries += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.max_pause_s)
            batch = failed
