"""A process's signs of life, on a NATS connection of their own.

The conductor takes a worker or frontend for alive while its heartbeats come, and asks it
directly when they stop (conductor/liveness.py). One connection keeps its messages in order,
so on the connection that carries the process's calls a heartbeat put and an answer wait
behind all the input or output published before them: twenty uploads sent as fast as they
could be had a frontend's heartbeat puts take over 3 s. A connection that carries nothing
else waits on nothing but the process's own event loop (and, for a heartbeat, the server's
disk, which the ask does not touch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from shared.bus import subjects
from shared.bus.connection import BusConnection, BusMsg
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError, BusUnavailable


class SignsOfLife:
    """`run()`, until cancelled: `payload()` under `key` in `bucket` every `period` (a
    heartbeat), and an answer to the conductor's ask on `subjects.alive(key)`, on a
    connection that nothing else uses (named after the process, `key`)."""

    def __init__(self, config: ServingConfig, bucket: str, key: str, payload: Callable[[], bytes], period: float) -> None:
        self.config, self.name, self.bucket, self.key = config, f"duplexbus-{key}-life", bucket, key
        self.payload, self.period = payload, period
        self.bus: BusConnection | None = None

    async def run(self) -> None:
        self.bus = await BusConnection.open(self.config, self.name, buckets=[self.bucket], stream=False)
        try:
            await self.bus.subscribe(subjects.alive(self.key), self._answer)
            await self.bus.kv[self.bucket].heartbeat(self.key, self.payload, self.period)
        finally:
            await self.bus.close()

    async def beat(self) -> None:
        """A heartbeat now, out of turn, stored when this returns (its number orders it among
        the periodic ones: the conductor keeps the latest)."""
        if self.bus is None:
            raise BusUnavailable(f"a heartbeat of {self.key}", "its connection is not open yet")
        await self.bus.kv[self.bucket].put(self.key, self.payload())

    async def _answer(self, msg: BusMsg) -> None:
        assert self.bus is not None  # subscribed on it
        with contextlib.suppress(BusError):  # not connected now: the conductor asks again
            await self.bus.answer(msg, b"")
