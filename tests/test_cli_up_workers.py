"""`duplexbus up` waiting for its workers, without NATS: a bus failure that may pass is
looked past and logged once, one that will not (a refusal) ends the wait at once, and `up`
says so in one line at the terminal instead of waiting out its timeout."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duplexbus import supervisor
from duplexbus.supervisor import UpOptions, run_up, wait_workers
from shared.bus.connection import BusConnection
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusDenied, BusError, BusNotFound, BusTimeout

CFG = ServingConfig(nats_url="nats://127.0.0.1:1")
DENIED = BusDenied("opening bucket workers", "permissions violation for subscription to $JS.API.STREAM.INFO.KV_workers")


class Workers:
    def __init__(self, n: int) -> None:
        self.n = n

    async def keys(self) -> list[str]:
        return [f"w{i}" for i in range(self.n)]


class StandInBus:
    """The bucket lookups answer from `answers` in turn (an exception is raised); the last repeats."""

    def __init__(self, *answers: int | BusError) -> None:
        self.answers = list(answers)
        self.asked = 0

    async def bucket(self, name: str, create: bool = True) -> Workers:
        self.asked += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BusError):
            raise answer
        return Workers(answer)

    async def close(self) -> None:
        pass


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[StandInBus]]:
    """`BusConnection.open` hands out the stand-in the test puts here."""
    given: list[StandInBus] = []

    async def open_(cfg: Any, name: str, **kw: Any) -> StandInBus:
        return given[0]

    monkeypatch.setattr(BusConnection, "open", open_)
    yield given


def test_a_refusal_ends_the_wait_at_once(bus: list[StandInBus]) -> None:
    bus.append(StandInBus(DENIED))
    start = time.monotonic()
    with pytest.raises(BusDenied):
        wait_workers(CFG, 1, 5.0, [])
    assert time.monotonic() - start < 2.0 and bus[0].asked == 1  # not polled until the timeout


def test_a_passing_failure_is_looked_past_and_logged_once(bus: list[StandInBus], caplog: pytest.LogCaptureFixture) -> None:
    """No bucket yet (no worker has started: no fault), three timeouts (NATS busy), then two workers."""
    timeout = BusTimeout("opening bucket workers", "nats: timeout")
    bus.append(StandInBus(BusNotFound("opening bucket workers", "bucket not found"), timeout, timeout, timeout, 1, 2))
    with caplog.at_level(logging.INFO, logger="duplexbus.supervisor"):
        assert wait_workers(CFG, 2, 20.0, [])
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "duplexbus.supervisor"]
    assert [m for level, m in said if level >= logging.WARNING] == [
        "counting the workers' heartbeats failed: opening bucket workers: nats: timeout; trying again"
    ]
    assert any(m.startswith("counting the workers' heartbeats works again after") for _, m in said)


def test_up_says_a_refusal_in_one_line_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_kept: None
) -> None:
    def refused(*args: Any, **kw: Any) -> bool:
        raise DENIED

    monkeypatch.setattr(supervisor, "wait_http", lambda *a, **kw: True)
    monkeypatch.setattr(supervisor, "wait_workers", refused)
    # Children that exit at once: the stand-in waits are all this test is about.
    monkeypatch.setattr(supervisor, "plan", lambda *a, **kw: [supervisor.Child("quick", [sys.executable, "-c", "pass"], 0)])
    opts = UpOptions(
        config=None, model="echo", frontends=1, workers=1, port=0, host="127.0.0.1",
        run_dir=tmp_path / "run", stop_timeout=5.0,
    )  # fmt: skip
    assert run_up(opts, ["Encoder", "Talker"], ServingConfig(model="echo", nats_url="nats://127.0.0.1:1")) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: duplexbus cannot see its workers start: {DENIED}"]
