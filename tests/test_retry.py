"""The one way to try a bus operation again (shared.runtime.retry): a recoverable BusError is
tried again with a bounded backoff, anything else is raised at once, and an outage is
logged once when it begins and once when it ends, not a line per try."""

from __future__ import annotations

import logging
import time

import pytest

from shared.runtime.errors import BusDenied, BusError, BusRefused, BusTimeout, BusUnavailable
from shared.runtime.retry import Backoff, Outage, retrying


class Flaky:
    """Fails its first `failures` calls with `error`, then returns "done"."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures = error, failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_the_backoff_doubles_up_to_its_bound_and_starts_over_when_reset() -> None:
    b = Backoff(first_s=0.1, max_s=0.5)
    assert [b.pause() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.pause() == 0.1


async def test_a_recoverable_failure_is_tried_again_and_the_outage_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    op = Flaky(BusUnavailable("storing x", "no server"), failures=5)
    got = await retrying(op, Outage("storing x", logging.getLogger("test")), backoff=Backoff(0.001, 0.004))
    assert got == "done" and op.calls == 6
    assert lines(caplog, logging.WARNING) == ["storing x failed: storing x: no server; trying again"]
    ended = lines(caplog, logging.INFO)
    assert len(ended) == 1 and ended[0].startswith("storing x works again after ") and "(5 failed tries)" in ended[0]


async def test_a_success_at_once_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert await retrying(Flaky(BusTimeout("x", "late"), failures=0), Outage("x")) == "done"
    assert caplog.records == []


@pytest.mark.parametrize("error", [BusDenied("storing x", "permissions violation"), BusRefused("storing x", "storage full")])
async def test_a_failure_that_will_not_mend_is_raised_at_once(error: BusError) -> None:
    op = Flaky(error, failures=100)
    with pytest.raises(type(error)):
        await retrying(op, Outage("storing x"), backoff=Backoff(0.001, 0.001))
    assert op.calls == 1


async def test_a_bug_is_raised_at_once_not_retried() -> None:
    op = Flaky(RuntimeError("a bug"), failures=100)
    with pytest.raises(RuntimeError, match="a bug"):
        await retrying(op, Outage("storing x"), backoff=Backoff(0.001, 0.001))
    assert op.calls == 1


async def test_past_its_patience_the_last_failure_is_raised() -> None:
    # Patience fifty pauses long: with 0.2 s (ten pauses), one pause stretched past it by the
    # suite's busiest start left two tries (a fresh-clone run of a4fdd05).
    op = Flaky(BusTimeout("storing x", "no answer in time"), failures=10_000)
    start = time.monotonic()
    with pytest.raises(BusTimeout):
        await retrying(op, Outage("storing x"), backoff=Backoff(0.01, 0.02), give_up_s=1.0)
    assert 1.0 <= time.monotonic() - start < 5
    assert op.calls > 2


async def test_without_patience_one_failure_is_raised_and_nothing_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    op = Flaky(BusTimeout("storing x", "no answer in time"), failures=1)
    with pytest.raises(BusTimeout):
        await retrying(op, Outage("storing x"), give_up_s=0.0)
    assert op.calls == 1 and caplog.records == []  # the caller that gets the error says what it means
