"""The janitor's rules without a bus (services/conductor/retention.py): which finished calls
leave the stream and when, and the core refusing new calls while the stream is full."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.conductor import core, retention
from services.conductor.retention import BATCH, GRACE_S, Janitor, started_s
from services.conductor.service import ConductorService
from shared.bus import subjects
from shared.runtime.config import parse_config
from tests.support.bus import bus_client, own_nats_server
from tests.test_conductor_core import PARTS, ack_all, conductor, fins, hb, opened

NOW = 1_700_000_000.0  # wall clock, seconds
DAY = 86_400.0


def cid_at(t: float, n: int = 0) -> str:
    """A call id as subjects.new_cid makes them, for a call begun at `t`."""
    return f"{int(t * 1000):012x}{n:012x}"


def test_call_ids_tell_when_the_call_began() -> None:
    assert started_s(cid_at(NOW)) == NOW
    assert started_s("not-a-cid") == 0.0


def test_nothing_goes_within_the_grace_after_its_finish() -> None:
    j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=2000)
    j.ended(cid_at(NOW - 2 * DAY), now=100.0)  # past max_age_s, over max_bytes: due twice over
    assert j.plan(stream_bytes=5000, live_calls=0, now_wall=NOW, now=100.0 + GRACE_S - 0.1) == []
    assert j.plan(stream_bytes=5000, live_calls=0, now_wall=NOW, now=100.0 + GRACE_S) == [cid_at(NOW - 2 * DAY)]
    assert len(j) == 0


def test_calls_past_max_age_go_and_younger_ones_stay_while_under_max_bytes() -> None:
    j = Janitor(max_age_s=DAY, max_bytes=10**9, hard_max_bytes=2 * 10**9)
    old, young = cid_at(NOW - DAY - 1), cid_at(NOW - DAY + 60)
    j.found([young, old], now=0.0)
    assert j.plan(stream_bytes=1000, live_calls=5, now_wall=NOW, now=GRACE_S) == [old]
    assert j.plan(stream_bytes=1000, live_calls=5, now_wall=NOW + 59, now=GRACE_S) == []
    assert j.plan(stream_bytes=1000, live_calls=5, now_wall=NOW + 61, now=GRACE_S) == [young]


def test_over_max_bytes_the_oldest_finished_calls_go_first_and_enough_of_them() -> None:
    """10 finished and 10 live calls in 20 MB, max_bytes 15 MB: 5 MB over at about 1 MB a call,
    so the 5 oldest finished calls go (the live ones are not the janitor's to count)."""
    j = Janitor(max_age_s=DAY, max_bytes=15_000_000, hard_max_bytes=30_000_000)
    cids = [cid_at(NOW - 3600 + i) for i in range(10)]
    for c in reversed(cids):  # the order they finished in does not matter: the oldest go first
        j.ended(c, now=0.0)
    assert j.plan(stream_bytes=20_000_000, live_calls=10, now_wall=NOW, now=GRACE_S) == cids[:5]
    assert j.plan(stream_bytes=14_000_000, live_calls=10, now_wall=NOW, now=GRACE_S) == []
    assert len(j) == 5


def test_a_round_removes_at_most_a_batch_and_failed_removals_come_again() -> None:
    j = Janitor(max_age_s=1.0, max_bytes=10**9, hard_max_bytes=2 * 10**9)
    j.found([cid_at(NOW - 10, n) for n in range(BATCH + 3)], now=0.0)
    first = j.plan(stream_bytes=0, live_calls=0, now_wall=NOW, now=GRACE_S)
    assert len(first) == BATCH
    j.again(first[:2])
    assert j.plan(stream_bytes=0, live_calls=0, now_wall=NOW, now=GRACE_S) == sorted(
        first[:2] + [cid_at(NOW - 10, n) for n in range(BATCH, BATCH + 3)]
    )


def test_a_call_ended_twice_is_removed_once() -> None:
    j = Janitor(max_age_s=1.0, max_bytes=10**9, hard_max_bytes=2 * 10**9)
    j.ended(cid_at(NOW - 10), now=0.0)
    j.found([cid_at(NOW - 10)], now=0.0)
    assert j.plan(stream_bytes=0, live_calls=0, now_wall=NOW, now=GRACE_S) == [cid_at(NOW - 10)]


def test_full_at_hard_max_bytes() -> None:
    j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=2000)
    assert not j.full(1999) and j.full(2000)


def test_a_full_stream_refuses_new_calls_and_live_ones_go_on() -> None:
    c = conductor(retention={"max_bytes": 1000, "hard_max_bytes": 2000})
    c.handle(hb("w1", PARTS))
    ack_all(c, "live", c.handle(opened("live")))
    assert c.handle(core.StreamFull(True)) == []
    refused = fins(c.handle(opened("new")))
    assert [(f.status, f.reason) for f in refused] == [(503, "overloaded")]
    assert "retention.hard_max_bytes" in (refused[0].error or "")
    assert "live" in c.calls and "new" not in c.calls
    c.handle(core.StreamFull(False))
    assert fins(c.handle(opened("later"))) == [] and "later" in c.calls


async def test_a_new_conductor_removes_what_an_earlier_one_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished calls are known to the conductor that finished them; one started later finds
    those still in the stream by their fins, and removes them by the same rules."""
    monkeypatch.setattr(retention, "GRACE_S", 0.0)
    with own_nats_server("duplexbus-janitor-") as server:
        config = parse_config({"nats_url": server.url, "retention": {"max_age_s": 3600}})
        async with bus_client(server.url, "earlier") as bus:
            old, young = cid_at(time.time() - 7200), cid_at(time.time() - 60)
            for cid in (old, young):
                await bus.store(subjects.open_(cid), b"open")
                await bus.store(subjects.input_(cid, "audio_in"), b"x" * 100)
                await bus.store(subjects.fin(cid), b"fin")
            stop = asyncio.Event()
            conductor = ConductorService(config)
            task = asyncio.create_task(conductor.run(stop))
            try:
                deadline = time.monotonic() + 10
                while await bus.stored_subjects(subjects.call_all(old)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert await bus.stored_subjects(subjects.call_all(old)) == []
                assert len(await bus.stored_subjects(subjects.call_all(young))) == 3  # within max_age_s: kept
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)
