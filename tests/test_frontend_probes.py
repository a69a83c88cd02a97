"""The frontend's probes and input side without NATS: `probes.BusProbe` tells the input side to
hold client input as soon as a round trip is slow (before it comes back), and to take it again
once one is fast or fails; `inputs.InputPublisher` holds items while told to and counts each
hold once; `inputs.late_reply` says which streams had already ended."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np

from services.frontend.calls import Prepared
from services.frontend.inputs import InputPublisher, late_reply
from services.frontend.pressure import BusPressure
from services.frontend.probes import BusProbe, LoopLagProbe
from shared.bus.connection import BusConnection
from shared.runtime.errors import BusUnavailable
from shared.runtime.metrics import FrontendMetrics
from shared.runtime.process import cancel_and_wait
from shared.sdk.chunking import Item
from tests.support.poll import until


class FakeBus:
    """Round trips that wait for `release` (the first `slow` of them) or fail; publishes recorded."""

    def __init__(self, slow: int = 0, fail: bool = False) -> None:
        self.slow = slow
        self.fail = fail
        self.release = asyncio.Event()
        self.published: list[str] = []

    async def round_trip(self, timeout: float) -> None:
        if self.fail:
            raise BusUnavailable("a round trip to NATS", "not connected")
        if self.slow:
            self.slow -= 1
            await self.release.wait()

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.published.append(subject)


def as_bus(fake: FakeBus) -> BusConnection:
    return cast(BusConnection, fake)


async def test_a_slow_round_trip_holds_input_before_it_comes_back_and_a_fast_one_takes_it_again() -> None:
    bus = FakeBus(slow=1)
    told: list[bool] = []
    probe = BusProbe(lambda: as_bus(bus), told.append)
    probe.pressure = BusPressure(slow_s=0.05, fast_s=0.02)
    task = asyncio.create_task(probe.run())
    try:
        await until(lambda: told == [False], 5, "input held while the round trip is still out")
        bus.release.set()
        await until(lambda: told[-1:] == [True], 5, "input taken again once a round trip is fast")
        assert probe.pressure.holds == 1
    finally:
        await cancel_and_wait(task)


async def test_a_failed_round_trip_takes_input() -> None:
    told: list[bool] = []
    probe = BusProbe(lambda: as_bus(FakeBus(fail=True)), told.append)
    task = asyncio.create_task(probe.run())
    try:
        await until(lambda: told[:1] == [True], 5, "an outage holds nothing")
    finally:
        await cancel_and_wait(task)


async def test_the_loop_lag_probe_observes_each_timer() -> None:
    lags: list[float] = []
    task = asyncio.create_task(LoopLagProbe(lags.append).run())
    try:
        await until(lambda: len(lags) >= 2, 5, "two timers measured")
        assert all(lag >= 0.0 for lag in lags)
    finally:
        await cancel_and_wait(task)


def _items(n: int) -> Prepared:
    return Prepared(items=[("audio_in", seq, Item(np.zeros(4, dtype=np.int16))) for seq in range(n)])


async def test_held_input_waits_and_is_published_once_taken_again() -> None:
    bus = FakeBus()
    metrics = FrontendMetrics()
    inputs = InputPublisher(lambda: as_bus(bus), metrics)
    inputs.take(False)
    inputs.take(False)  # told again while held: still one hold
    publishing = asyncio.create_task(inputs.items("cid1", _items(3)))
    try:
        done, _ = await asyncio.wait({publishing}, timeout=0.2)
        assert not done and bus.published == []
        inputs.take(True)
        await asyncio.wait_for(publishing, 5)
    finally:
        await cancel_and_wait(publishing)
    assert len(bus.published) == 3 and inputs.taking
    assert metrics.registry.get_sample_value("duplexbus_frontend_input_holds_total") == 1.0
    assert metrics.registry.get_sample_value("duplexbus_frontend_appends_total") == 3.0


def test_late_input_and_a_repeated_end_are_one_409_reply_and_nothing_else_none() -> None:
    assert late_reply(Prepared()) is None
    reply: dict[str, Any] | None = late_reply(Prepared(late=["text_in"], already_ended=["aux_in"]))
    assert reply is not None
    assert reply["status"] == 409 and reply["append"] is True and reply["late"] == ["aux_in", "text_in"]
    assert "['text_in'] was neither charged nor sent" in reply["error"]
    assert "end_input named stream(s) ['aux_in'] again" in reply["error"]
