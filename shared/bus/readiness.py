"""Is a process ready to serve: connected to NATS, the stream there, a conductor alive. And
is it live: its connection not lost for good (`live`, for /livez).

Checked in the background (`run`), so a probe (`/readyz`) reads the last answers and never
waits on the bus itself.
"""

from __future__ import annotations

import asyncio
import logging

from shared.bus import subjects
from shared.bus.connection import BusConnection
from shared.runtime.errors import BusError

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 1.0


class Readiness:
    def __init__(self, period: float, is_conductor: bool = False) -> None:
        self.period = period
        self.is_conductor = is_conductor  # the conductor itself: alive by being here
        self.conn: BusConnection | None = None
        self.checks: dict[str, bool] = {"nats": False, "stream": False, "conductor": False}

    def __call__(self) -> dict[str, bool]:
        return dict(self.checks)

    def live(self) -> dict[str, bool]:
        """/livez's checks: the bus connection is not lost for good (link.py). Before there is
        one, the connect itself is what is under way, and it retries."""
        return {"bus": self.conn is None or not self.conn.lost}

    @property
    def ready(self) -> bool:
        return all(self.checks.values())

    async def run(self) -> None:
        """Until cancelled, every `period`; `conn` is set once the process has connected."""
        while True:
            if self.conn is not None:
                await self._check(self.conn)
            # Until connected, look often: the first answer comes as soon as there is a connection.
            await asyncio.sleep(self.period if self.conn is not None else 0.05)

    async def _check(self, conn: BusConnection) -> None:
        self.checks["nats"] = conn.is_connected
        try:
            self.checks["stream"] = self.checks["nats"] and await conn.has_stream()
        except BusError as e:  # slow or refused: not ready, and say why once in a while
            log.debug("readiness: %s", e)
            self.checks["stream"] = False
        self.checks["conductor"] = self.is_conductor or (
            self.checks["nats"] and await conn.service_alive(subjects.SERVICE_CONDUCTOR, PING_TIMEOUT_S)
        )
