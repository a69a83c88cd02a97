"""Deliveries lost on their way to the conductor are sent again within seconds, not after
ack_wait (shared/bus/deliveries.py, the pure record; shared/bus/durable.py, the shell): by
hand-made consumer sequences, and against a real nats-server where another client's pull
takes a delivery and never acknowledges it, as a pull request of a dropped connection does."""

from __future__ import annotations

import time
from typing import Any

import pytest
from nats.js.errors import APIError
from nats.js.manager import JetStreamManager

from shared.bus import durable, subjects
from shared.bus.connection import BusConnection, conductor_consumer
from shared.bus.deliveries import Deliveries
from shared.bus.durable import Durable
from tests.support.bus import bus_client, connected, own_nats_server


def test_a_skipped_consumer_sequence_is_a_lost_delivery() -> None:
    d = Deliveries()
    for seq in (1, 2, 3):
        d.received(seq)
    assert not d.gap and not d.looked(3, unacked=2)
    d.received(5)
    assert d.gap and d.looked(5, unacked=1)
    d.reset()  # the server numbers from 1 again
    d.received(1)
    assert not d.gap and d.last == 1


def test_a_lower_sequence_is_a_new_start_not_a_gap() -> None:
    """A consumer leader that took over numbers from its own state."""
    d = Deliveries()
    d.received(7)
    d.received(3)
    d.received(4)
    assert not d.gap and d.last == 4


def test_a_loss_at_the_tail_is_seen_at_two_looks_in_a_row_with_nothing_received() -> None:
    d = Deliveries()
    d.received(1)
    assert not d.looked(2, unacked=1)  # maybe on its way
    assert d.looked(2, unacked=1)  # still not here, nothing came meanwhile: lost
    d.reset()
    d.received(1)
    assert not d.looked(2, unacked=1)
    d.received(2)  # it came: what was ahead was on its way
    assert not d.looked(3, unacked=1)
    assert d.looked(3, unacked=1)


def test_deliveries_owed_nothing_are_no_loss() -> None:
    """The server ahead with nothing unacknowledged (a restarted conductor whose predecessor
    acknowledged all): nothing to send again, no reset; and the server not ahead is no loss."""
    d = Deliveries()
    assert not d.looked(40, unacked=0) and not d.looked(40, unacked=0)
    d.received(41)
    assert not d.looked(41, unacked=3) and not d.looked(41, unacked=3)


async def _fetched(sub: Durable, bus: BusConnection, within: float) -> tuple[list[str], float]:
    """What the consumer delivers next (acknowledged), and after how many seconds."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        msgs = await sub.fetch(16, timeout=1.0)
        if msgs:
            for m in msgs:
                await bus.ack(m)
            return [subjects.parse(m.subject).cid for m in msgs], time.monotonic() - start
    return [], time.monotonic() - start


async def test_a_delivery_that_never_reached_the_conductor_comes_again_within_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the server sent it again after ack_wait (30 s): a call opened while the
    conductor's node was paused waited that long (tests/test_nats_pause.py's cluster case).
    Resets are at most one every RESET_EVERY_S (here 3 s): a second loss soon after waits."""
    monkeypatch.setattr(durable, "RESET_EVERY_S", 3.0)
    with own_nats_server("duplexbus-deliveries-") as server:
        async with bus_client(server.url, "conductor") as bus, connected(server.url) as nc:
            sub = await bus.durable(conductor_consumer)
            thief = await nc.jetstream().pull_subscribe_bind(durable=subjects.CONDUCTOR_DURABLE, stream=subjects.STREAM)
            # at the tail: nothing comes after it
            await bus.store(subjects.open_("lost"), b"{}")
            assert [m.subject for m in await thief.fetch(1, timeout=5)] == [subjects.open_("lost")]
            got, after = await _fetched(sub, bus, within=10.0)
            assert got == ["lost"] and after < 5.0 and sub.resets == 1, (got, after)
            # in the middle: the next delivery shows the gap, and the reset comes once 3 s have
            # passed since the last one
            await bus.store(subjects.open_("a"), b"{}")
            assert [m.subject for m in await thief.fetch(1, timeout=5)] == [subjects.open_("a")]
            await bus.store(subjects.open_("b"), b"{}")
            got, _ = await _fetched(sub, bus, within=5.0)
            assert got == ["b"] and sub.resets == 1  # too soon after the last reset
            got, after = await _fetched(sub, bus, within=8.0)
            # in stream order; b again too: a reset sends everything above the ack floor, which a holds down
            assert got == ["a", "b"] and sub.resets == 2 and after < 5.0, (got, after)
            # nothing lost: no reset however long it stays idle
            await bus.store(subjects.open_("c"), b"{}")
            assert (await _fetched(sub, bus, within=5.0))[0] == ["c"]
            assert (await _fetched(sub, bus, within=3.0))[0] == [] and sub.resets == 2


async def test_a_server_that_refuses_the_reset_is_not_asked_again_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server older than 2.14 has no consumer reset: the refusal is logged, fetching goes
    on (the lost delivery comes after ack_wait, as before), and the reset is not asked for
    again within RESET_REFUSED_PAUSE_S; a timeout is asked again after RESET_RETRY_S."""
    asked: list[str] = []

    async def refuse(self: JetStreamManager, stream: str, consumer: str, **kwargs: Any) -> None:
        asked.append(consumer)
        raise APIError(code=400, description="unknown API")

    monkeypatch.setattr(JetStreamManager, "reset_consumer", refuse)
    with own_nats_server("duplexbus-deliveries-") as server:
        async with bus_client(server.url, "conductor") as bus, connected(server.url) as nc:
            sub = await bus.durable(conductor_consumer)
            thief = await nc.jetstream().pull_subscribe_bind(durable=subjects.CONDUCTOR_DURABLE, stream=subjects.STREAM)
            await bus.store(subjects.open_("lost"), b"{}")
            assert len(await thief.fetch(1, timeout=5)) == 1
            got, _ = await _fetched(sub, bus, within=4.0)  # three idle looks: lost, refused, not asked again
            assert got == [] and asked == [subjects.CONDUCTOR_DURABLE] and sub.resets == 0
            await bus.store(subjects.open_("next"), b"{}")
            assert (await _fetched(sub, bus, within=3.0))[0] == ["next"]  # fetching goes on
