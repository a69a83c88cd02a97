"""The conductor waits out the bus through the one retry helper (shared.runtime.retry): an
outage of its consumer is one warning and one line when it ends, not a line per try; a
failure that will not mend ends the wait at once. Stand-ins, no NATS."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.conductor.service import ConductorService
from shared.runtime.config import parse_config
from shared.runtime.errors import BusDenied, BusError, BusUnavailable
from tests.support.poll import until


class StandInConsumer:
    """Fails its first `failures` fetches with `error`, then finds nothing, for ever."""

    def __init__(self, error: BusError, failures: int) -> None:
        self.error, self.failures = error, failures
        self.fetches = 0

    async def fetch(self, batch: int, timeout: float) -> list[object]:
        self.fetches += 1
        if self.fetches <= self.failures:
            raise self.error
        await asyncio.sleep(0.001)
        return []


async def test_an_outage_of_the_consumer_is_logged_once_and_fetching_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    conductor = ConductorService(parse_config({}))
    sub = StandInConsumer(BusUnavailable("fetching from the conductor's consumer", "connection closed"), failures=4)
    consume = asyncio.create_task(conductor._consume(sub))  # type: ignore[arg-type]
    try:
        await until(lambda: sub.fetches > 6, 10.0, "more than six fetches")
    finally:
        consume.cancel()
        await asyncio.gather(consume, return_exceptions=True)
    # The conductor's own lines: the suite shares a loop, where another module's client may log.
    mine = [r for r in caplog.records if r.name.startswith("services.conductor")]
    warned = [r.getMessage() for r in mine if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "connection closed" in warned[0], warned  # not one a try
    ended = [r.getMessage() for r in mine if "works again" in r.getMessage()]
    assert len(ended) == 1 and "(4 failed tries)" in ended[0], ended


async def test_a_consumer_refused_for_good_ends_the_wait_at_once() -> None:
    conductor = ConductorService(parse_config({}))
    sub = StandInConsumer(BusDenied("fetching from the conductor's consumer", "permissions violation"), failures=100)
    with pytest.raises(BusDenied):
        await asyncio.wait_for(conductor._consume(sub), 5)  # type: ignore[arg-type]
    assert sub.fetches == 1
