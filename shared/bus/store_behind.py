"""Messages a call has once, stored with an ack in order from one task (`StoreBehind`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.runtime.errors import BusError, BusUnavailable
from shared.runtime.retry import Backoff, Outage, retrying

log = logging.getLogger(__name__)


@dataclass
class _ToStore:
    subject: str
    body: bytes
    then: Callable[[], Awaitable[None]] | None
    failed: Callable[[Exception], Awaitable[None]] | None
    stored: bool = False


class StoreBehind:
    """Messages a call has once (edge end, done, abort) stored with an ack, in order, from
    one task of their own (`run`), so the caller does not wait a round trip per message: a
    worker's step that ends many calls goes on to its next step at once.

    Whatever is queued when the task wakes is written at once and the acks awaited
    together. A message the stream did not take for a reason that passes (the server
    restarting, a timeout: `BusError.recoverable`) is sent again, after a pause that doubles
    up to `max_pause_s`, until it is stored: the stream drops repeats by `Nats-Msg-Id`
    (`BusConnection.store_once`), and later messages wait for it. Only such a retry can put
    a message after one queued later. `then` runs once its message is stored.

    A message refused for good (a permission, a request the server refuses) or whose
    publish fails with anything but a BusError (a bug) is not sent again: sending it again
    would not store it and would hold every later message behind it for ever. It is logged,
    counted (`failures`), and its `failed` is told why. The queue holds at most a few
    messages per call its owner holds, so it needs no other bound.
    """

    def __init__(self, publish: Callable[[str, bytes], Awaitable[None]], max_pause_s: float = 2.0) -> None:
        self._publish = publish
        self._queue: deque[_ToStore] = deque()
        self._ready = asyncio.Event()
        self._in_flight = 0
        self.max_pause_s = max_pause_s
        self.retries = 0  # tries again of a batch with messages not stored
        self.failures = 0  # messages given up on
        self._outage = Outage("storing the ends of calls", log)

    def put(
        self,
        subject: str,
        body: bytes,
        then: Callable[[], Awaitable[None]] | None = None,
        failed: Callable[[Exception], Awaitable[None]] | None = None,
    ) -> None:
        self._queue.append(_ToStore(subject, body, then, failed))
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
                        if m.stored and m.then is not None:
                            await _after(m.subject, m.then())
                finally:
                    self._in_flight = 0

    async def _store(self, batch: list[_ToStore]) -> None:
        """Store `batch`, each message sent again while its failure is recoverable; those given
        up on are left `stored` False."""
        pending = batch

        async def attempt() -> None:
            nonlocal pending
            results = await asyncio.gather(*(self._publish(m.subject, m.body) for m in pending), return_exceptions=True)
            again: list[_ToStore] = []
            error: BusError | None = None
            for m, r in zip(pending, results, strict=True):
                if isinstance(r, asyncio.CancelledError):  # its publish alone (our own stop raises from gather)
                    r = BusUnavailable(f"storing {m.subject}", "the publish was cancelled")
                if r is None:
                    m.stored = True
                elif isinstance(r, BusError) and r.recoverable:
                    again.append(m)
                    error = error or r
                elif isinstance(r, Exception):
                    await self._give_up(m, r)
                else:
                    raise r
            pending = again
            if error is not None:
                self.retries += 1
                raise error  # retrying pauses, then sends `pending` again

        await retrying(attempt, self._outage, backoff=Backoff(0.05, self.max_pause_s))

    async def _give_up(self, m: _ToStore, error: Exception) -> None:
        self.failures += 1
        if isinstance(error, BusError):
            log.error("%s not stored, and sending it again would not store it: %s", m.subject, error)
        else:
            log.error("%s not stored: its publish failed", m.subject, exc_info=error)
        if m.failed is not None:
            await _after(m.subject, m.failed(error))


async def _after(subject: str, owner_told: Awaitable[None]) -> None:
    """What the owner asked for once a message is stored or given up on: its failure is
    logged, and the messages after it are stored all the same."""
    try:
        await owner_told
    except Exception:
        log.exception("after storing %s", subject)
