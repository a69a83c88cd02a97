"""The janitor's rules without a bus (services/conductor/retention.py): which finished calls
leave the stream and when, and the core refusing new calls while the stream is full."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import pytest

from services.conductor import core, retention
from services.conductor.retention import BATCH, GRACE_S, Janitor, started_s
from services.conductor.service import ConductorService
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from shared.runtime.errors import BusError
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


def _marked(j: Janitor, until: float, every: float = 1.0, per_s: int = 100) -> None:
    """Marks once a round (`every` s) from 0 to `until`, the stream growing `per_s` a second."""
    t = 0.0
    while t <= until:
        j.mark(t, int(t * per_s))
        t += every


def test_the_head_is_cut_as_far_as_the_plans_calls_need_and_the_kept_calls_allow() -> None:
    """A purge of one call's subjects cost the server 19 ms on a 2 GB stream of interleaved
    calls (the janitor could not keep up with 300 calls and held the stream up for seconds);
    a cut of its head, 100,000 messages in 73 ms. The cut goes up to the plan's calls' fins,
    never past the floor of a call kept (held by the conductor, ending, or in its grace) nor
    into the last HEAD_LAG_S. The removable calls it reaches go with it, those of the plan and
    others begun beside them, whole or their heads (the rest goes with a later cut); a call of
    the plan it does not reach is purged by subject."""
    now = retention.HEAD_LAG_S + 30.0

    def janitor(stream_bytes: int) -> tuple[Janitor, list[str]]:
        j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=10**9)
        _marked(j, now)  # the stream's last sequence was 100 a second: 3000 at HEAD_LAG_S ago
        cids = [cid_at(NOW - 50, 1), cid_at(NOW - 40, 2), cid_at(NOW - 30, 3)]
        for cid, (floor, last) in zip(cids, [(100, 900), (500, 1500), (1000, 2600)], strict=True):
            j.ended(cid, 0.0, floor=floor, last=last)
        j.ended(cid_at(NOW - 1, 4), now, floor=2400, last=2900)  # in its grace: kept
        j.plan(stream_bytes=stream_bytes, live_calls=0, now_wall=NOW, now=now)
        return j, cids

    j, (_, old, straddles) = janitor(10**6)  # far over max_bytes: the three go
    assert j.head(live_floor=5000, read_to=10**6, now=now) == (2401, [], [])  # held by the call in its grace
    j, _ = janitor(1500)  # a little over: the plan takes the two oldest, and the third goes beside them
    assert j.head(live_floor=5000, read_to=10**6, now=now) == (1501, [], [straddles])
    assert len(j) == 1  # only the call in its grace is left
    j, _ = janitor(1500)
    assert j.head(live_floor=400, read_to=10**6, now=now) == (401, [old], [])  # a held call's floor: old by subject
    # nothing stored in the last HEAD_LAG_S goes, whatever the fins
    j2 = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=10**9)
    _marked(j2, now)
    j2.ended(cid_at(NOW - 60), 0.0, floor=10, last=4000)
    j2.plan(stream_bytes=10**6, live_calls=0, now_wall=NOW, now=now)
    assert j2.head(live_floor=None, read_to=10**6, now=now) == (3001, [], [])


def test_no_cut_while_a_call_below_it_may_be_unknown_or_its_floor_is() -> None:
    """No cut: before the marks reach HEAD_LAG_S back; while the conductor has not read its
    consumer up to what was stored OPEN_WITHIN_S after that (an open on its way); while a call
    held or ending has no floor (0: a frontend before wire 1.5). A call of the plan whose
    floor is not known (found in the stream at start) is purged by subject."""

    def janitor(until: float) -> Janitor:
        j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=10**9)
        _marked(j, until)
        j.ended(cid_at(NOW - 60), 0.0, floor=10, last=20)
        assert j.plan(stream_bytes=10**6, live_calls=0, now_wall=NOW, now=until) == [cid_at(NOW - 60)]
        return j

    young = retention.HEAD_LAG_S - 1.0
    j0 = janitor(young)
    assert j0.head(live_floor=None, read_to=10**6, now=young) == (0, [cid_at(NOW - 60)], [])
    assert "not known from" in j0.held_by  # said in the conductor's report
    now = retention.HEAD_LAG_S + 30.0
    opened = int((now - retention.HEAD_LAG_S + retention.OPEN_WITHIN_S) * 100)  # the mark the conductor must have read to
    j1 = janitor(now)
    assert j1.head(live_floor=None, read_to=opened - 1, now=now)[0] == 0 and "read its consumer" in j1.held_by
    assert janitor(now).head(live_floor=None, read_to=opened, now=now) == (21, [], [])
    assert janitor(now).head(live_floor=0, read_to=10**6, now=now)[0] == 0  # a held call's floor not known
    j = janitor(now)
    j.ending(cid_at(NOW), 0)
    assert j.head(live_floor=None, read_to=10**6, now=now)[0] == 0
    j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=10**9)
    _marked(j, now)
    j.found([cid_at(NOW - 70)], 0.0)
    j.ended(cid_at(NOW - 60), 0.0, floor=10, last=20)
    assert j.plan(stream_bytes=10**6, live_calls=0, now_wall=NOW, now=now) == [cid_at(NOW - 70), cid_at(NOW - 60)]
    assert j.head(live_floor=None, read_to=10**6, now=now) == (21, [cid_at(NOW - 70)], [])


def test_a_removal_that_failed_keeps_its_calls_floor() -> None:
    """Under load, removals fail and are tried again: such a call's floor is still known, so a
    later cut takes it (before, it was taken as not known, which held every later cut at none,
    and the subject purges left stalled the server)."""
    now = retention.HEAD_LAG_S + 30.0
    j = Janitor(max_age_s=DAY, max_bytes=1000, hard_max_bytes=10**9)
    _marked(j, now)
    failed, later = cid_at(NOW - 60), cid_at(NOW - 50)
    j.ended(failed, 0.0, floor=100, last=200)
    assert j.plan(stream_bytes=10**6, live_calls=0, now_wall=NOW, now=now) == [failed]
    assert j.head(live_floor=None, read_to=10**6, now=now) == (201, [], [])
    j.again([failed])  # the cut failed: it waits for a later round
    j.ended(later, 0.0, floor=2000, last=2100)
    assert j.plan(stream_bytes=10**6, live_calls=0, now_wall=NOW, now=now) == [failed, later]
    assert j.head(live_floor=None, read_to=10**6, now=now) == (2101, [], [])


async def test_finished_calls_go_with_a_cut_of_the_streams_head_and_a_held_call_keeps_every_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against a real server: calls opened as a frontend opens them (wire.Open.read_after, the
    last sequence it saw stored) and ended (an abort: they never found a worker) go with a cut
    of the stream's head once their messages are HEAD_LAG_S old (here 2 s), not by a purge of
    each; a call the conductor still holds, opened among them, keeps every message, and so
    does everything stored after the cut's bound."""
    monkeypatch.setattr(retention, "GRACE_S", 3.0)  # removable once their messages are HEAD_LAG_S old
    monkeypatch.setattr(retention, "HEAD_LAG_S", 2.0)
    monkeypatch.setattr(retention, "OPEN_WITHIN_S", 1.0)
    purged: list[str] = []
    real_purge = BusConnection.purge

    async def purge(self: BusConnection, subject: str) -> None:
        purged.append(subject)
        await real_purge(self, subject)

    monkeypatch.setattr(BusConnection, "purge", purge)
    with own_nats_server("duplexbus-janitor-") as server:
        config = parse_config({"nats_url": server.url, "retention": {"max_bytes": 1000, "hard_max_bytes": 10**9}})
        stop = asyncio.Event()
        conductor = ConductorService(config)
        task = asyncio.create_task(conductor.run(stop))
        try:
            async with bus_client(server.url, "frontend") as bus:
                await _until(lambda: _has_consumer(bus))
                await bus.store(subjects.input_("orphan", "audio_in"), b"x")  # the floor is known from here on

                async def call(cid: str) -> None:
                    read_after = bus.stored_to()
                    for _ in range(5):
                        await bus.store(subjects.input_(cid, "audio_in"), b"x" * 1000)
                    opened = wire.Open(cid=cid, request_id="", model="echo", frontend_id="f", read_after=read_after, live=True)
                    await bus.store(subjects.open_(cid), wire.encode(opened))

                async def end(cids: list[str]) -> None:
                    for cid in cids:
                        await bus.store(subjects.abort(cid), wire.encode(wire.Abort(reason="gone")))
                    await _until(lambda: _all_have_fins(bus, cids))

                ended, held = [cid_at(time.time(), i) for i in range(4)], cid_at(time.time(), 9)
                for cid in ended[:2]:
                    await call(cid)
                await end(ended[:2])  # over before the held call began
                await bus.store(subjects.input_("orphan", "audio_in"), b"x")  # this "frontend" sees a store after their fins
                await call(held)
                for cid in ended[2:]:
                    await call(cid)
                await end(ended[2:])  # over after it began
                held_subjects = await bus.stored_subjects(subjects.call_all(held))
                await _until(lambda: _all_gone(bus, ended), timeout=20)
                assert await bus.stored_subjects(subjects.call_all(held)) == held_subjects  # all six of its messages
                assert len(await _messages(bus, held)) == 6
                first = (await bus.stream_state()).first_seq
                held_first = min([seq async for _, _, seq in bus.read_stored([subjects.call_all(held)])])
                assert 1 < first <= held_first  # the head was cut, below the held call's first message
                # those ended after the held call began have messages above the cut: one by one.
                # (The two before it went with the cut; where a slow round had not read the
                # conductor's consumer up to their fins in time, by subject: tested pure above.)
                assert {subjects.call_all(c) for c in ended[2:]} <= set(purged), purged
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.2)


async def _has_consumer(bus: BusConnection) -> bool:
    with contextlib.suppress(BusError):
        return await bus.acked_to(subjects.CONDUCTOR_DURABLE, 0) >= 0
    return False


async def _all_have_fins(bus: BusConnection, cids: list[str]) -> bool:
    return len(await bus.stored_subjects(subjects.fin("*"))) >= len(cids) and all(
        [bool(await bus.stored_subjects(subjects.fin(c))) for c in cids]
    )


async def _all_gone(bus: BusConnection, cids: list[str]) -> bool:
    for c in cids:
        if await bus.stored_subjects(subjects.call_all(c)):
            return False
    return True


async def _messages(bus: BusConnection, cid: str) -> list[bytes]:
    return [body async for _, body, _ in bus.read_stored([subjects.call_all(cid)])]
