"""The conductor's health beat: a NATS outage is logged once and the beat goes on after it; a
failure that trying again cannot mend ends the conductor with its error."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from services.conductor.service import health_beat
from shared.runtime.errors import BusDenied, BusError, BusUnavailable
from shared.runtime.healthfile import HEALTH_FILE_ENV
from shared.runtime.retry import Outage


class StandInBus:
    """Fails its first `failures` round trips with `error`, then answers."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures = error, failures
        self.tries = 0
        self.answered = asyncio.Event()

    async def round_trip(self, timeout: float) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise self.error
        self.answered.set()


@pytest.fixture
def health_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "health"
    monkeypatch.setenv(HEALTH_FILE_ENV, str(path))
    return path


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def infos(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_an_outage_is_logged_when_it_begins_each_minute_it_lasts_and_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage("the check", logging.getLogger("test"), remind_s=60.0)
    caplog.set_level(logging.INFO)
    outage.ok(0.0)  # nothing failed: nothing to say
    for t in range(0, 130):  # a try a second for 130 s
        outage.failed(BusUnavailable("a round trip", "no server"), float(t))
    outage.ok(130.0)
    said = warnings(caplog)
    assert len(said) == 3, said
    assert said[0] == "the check failed: a round trip: no server; trying again"
    assert "still fails after 60 s (61 tries)" in said[1] and "after 120 s (121 tries)" in said[2]
    assert infos(caplog) == ["the check works again after 130.0 s (130 failed tries)"]  # the end is news, not a warning
    outage.failed(BusUnavailable("a round trip", "no server"), 200.0)  # a new outage is news again
    assert len(warnings(caplog)) == 4


async def test_a_nats_outage_is_logged_once_and_the_beat_goes_on_after_it(
    health_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    bus = StandInBus(BusUnavailable("a round trip to NATS", "connection closed"), failures=20)
    beat = asyncio.create_task(health_beat(bus, 0.005))
    try:
        await asyncio.wait_for(bus.answered.wait(), 10)
        while not health_file.exists():
            await asyncio.sleep(0.005)
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    said = warnings(caplog)
    assert len(said) == 1, said  # not one line per failed try
    assert "failed: a round trip to NATS: connection closed; trying again" in said[0]
    ended = [m for m in infos(caplog) if "works again" in m]
    assert len(ended) == 1 and "(20 failed tries)" in ended[0], ended


@pytest.mark.parametrize(
    "error",
    [BusDenied("a round trip to NATS", "permissions violation"), RuntimeError("a bug")],
    ids=["not recoverable", "not the bus's"],
)
async def test_a_failure_that_trying_again_cannot_mend_ends_the_beat_with_it(
    health_file: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    bus = StandInBus(error, failures=1_000)
    with pytest.raises(type(error)) as raised:
        await asyncio.wait_for(health_beat(bus, 0.005), 5)  # (before: it tried for ever, without a word)
    assert raised.value is error and bus.tries == 1 and not health_file.exists()
    said = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "stopping" in said[0].getMessage()
    assert isinstance(error, BusError) == ("cannot mend" in said[0].getMessage())
