"""Liveness from heartbeat revisions and the conductor's own clock: the rules without a bus,
then a conductor and a worker on a real server with the conductor's clock an hour ahead."""

from __future__ import annotations

import asyncio
import contextlib
import time
import types
from collections.abc import AsyncIterator

import nats
import pytest

from services.conductor import liveness
from services.conductor import service as conductor_service
from services.conductor.liveness import ListeningClock, Liveness
from services.conductor.service import ConductorService
from services.worker.service import WorkerService
from shared.bus import subjects
from shared.bus.kv import Bucket
from shared.runtime.config import ServingConfig, parse_config
from shared.runtime.errors import BusTimeout, BusUnavailable
from tests.support.bus import own_nats_server

INF = float("inf")  # the rules of revisions, with no stall detection (these tests jump the clock)


def silent(live: Liveness, now: float) -> list[str]:
    """The keys lost at `now` where every process asked does not answer (ask_s 0): the
    rules of heartbeats alone."""
    live.overdue(now)
    return live.expired(now)


def test_a_process_is_alive_while_new_revisions_come_by_the_local_clock() -> None:
    """Nothing here reads the server's stored time: a worker on a machine whose clock is
    hours off, or a server whose clock is, is judged by when its heartbeats arrive."""
    live = Liveness(liveness_s=3.0, max_gap_s=INF, ask_s=0.0)
    assert live.saw("w1", revision=10, now=100.0)
    assert silent(live, 102.9) == []
    assert live.saw("w1", revision=17, now=102.9)
    assert silent(live, 105.0) == [] and "w1" in live
    assert silent(live, 106.0) == ["w1"] and "w1" not in live
    assert silent(live, 200.0) == []  # lost once


def test_a_replayed_heartbeat_revives_nothing() -> None:
    live = Liveness(liveness_s=3.0, max_gap_s=INF, ask_s=0.0)
    live.saw("w1", revision=5, now=0.0)
    assert not live.saw("w1", revision=5, now=1.0)  # a restarted watcher replays the last entry
    assert silent(live, 3.5) == ["w1"]  # the replay did not count as a sign of life
    assert not live.saw("w1", revision=5, now=4.0)  # nor does it bring a lost process back
    assert "w1" not in live
    assert live.saw("w1", revision=6, now=5.0)  # a new heartbeat does


def test_a_clean_exit_is_reported_once_and_the_key_may_come_back() -> None:
    live = Liveness(liveness_s=3.0, max_gap_s=INF, ask_s=0.0)
    live.saw("f1", revision=3, now=0.0)
    assert live.left("f1") and not live.left("f1")
    assert live.saw("f1", revision=9, now=1.0)


def test_forgotten_keys_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    live = Liveness(liveness_s=1.0, max_gap_s=INF, ask_s=0.0)
    for i in range(30):
        live.saw(f"w{i}", revision=i + 1, now=0.0)
    assert len(silent(live, 5.0)) == 30
    monkeypatch.setattr(liveness, "FORGOTTEN_MAX", 10)
    live.saw("x", revision=100, now=5.0)
    silent(live, 5.5)
    assert len(live._lost) == 10 and "x" in live  # ten lost keys remembered, and the live one
    assert not live.saw("w29", revision=30, now=6.0)  # the latest lost are the ones kept


def test_a_silent_process_that_answers_when_asked_is_alive() -> None:
    """Its heartbeats wait behind its connection and the server's disk; the direct ask does
    not. The answer counts as a sign of life: it is asked again only liveness_s later."""
    live = Liveness(liveness_s=3.0, max_gap_s=INF, ask_s=1.5)
    live.saw("f1", revision=1, now=0.0)
    assert live.overdue(now=2.9) == []
    assert live.overdue(now=3.1) == ["f1"] and live.asked("f1")
    assert live.overdue(now=3.2) == []  # asked once
    assert live.answered("f1", now=3.5) and not live.asked("f1")
    assert live.expired(now=4.9) == [] and "f1" in live  # 1.4 s after the ask: answered meanwhile
    assert live.overdue(now=6.4) == []  # 2.9 s after the answer
    assert live.overdue(now=6.6) == ["f1"]
    assert not live.answered("g1", now=6.6)  # never heard of: nothing to answer for


def test_a_process_asked_and_not_answering_is_lost_after_ask_s_of_listening() -> None:
    live = Liveness(liveness_s=3.0, max_gap_s=1.0, ask_s=1.5)
    live.saw("w1", revision=1, now=0.0)
    lost = []
    for i in range(1, 13):  # ticks every 0.5 s
        t = i * 0.5
        lost += [(t, k) for k in live.expired(t)]
        live.overdue(t)
    assert lost == [(5.0, "w1")]  # overdue at 3.5 (silent 3.5 > 3), no answer by 5.0
    assert not live.answered("w1", now=5.1)  # an answer after the verdict changes nothing
    assert not live.saw("w1", revision=1, now=5.2)  # nor does its old heartbeat replayed


def test_an_asked_process_that_was_not_listened_to_is_not_convicted() -> None:
    """The conductor was cut off (or frozen) while its ask waited: that time is nobody's."""
    live = Liveness(liveness_s=3.0, max_gap_s=1.0, ask_s=1.5)
    live.saw("w1", revision=1, now=0.0)
    assert _ticks(live, 0.0, 3.5) == [] and live.asked("w1")  # overdue at 3.5
    live.hear(False, now=3.6)
    assert _ticks(live, 3.6, 30.0) == []  # 26 s deaf
    live.hear(True, now=30.0)
    assert _ticks(live, 30.0, 31.5) == []  # 0.1 + 1 s of the 1.5 s listened (the tick that began deaf counts nothing)
    assert _ticks(live, 31.5, 32.0) == ["w1"]


def test_nobody_subscribed_is_lost_at_once_and_a_heartbeat_ends_an_ask() -> None:
    live = Liveness(liveness_s=3.0, max_gap_s=INF, ask_s=1.5)
    live.saw("w1", revision=1, now=0.0)
    live.saw("w2", revision=1, now=0.0)
    assert sorted(live.overdue(now=3.5)) == ["w1", "w2"]
    assert live.absent("w1") and "w1" not in live and not live.absent("w1")
    assert live.saw("w2", revision=2, now=3.6)  # a late heartbeat: heard again
    assert not live.asked("w2") and not live.absent("w2")  # the ask's failure no longer counts
    assert live.expired(now=6.0) == [] and "w2" in live


def _ticks(live: Liveness, start: float, stop: float, step: float = 0.5) -> list[str]:
    """The shell's ticks from `start` to `stop`: what expired on the way."""
    lost: list[str] = []
    t = start
    while t < stop:
        t = min(t + step, stop)
        lost += silent(live, t)
    return lost


def test_a_judge_that_was_frozen_counts_none_of_the_freeze() -> None:
    """The conductor stopped (SIGSTOP, a GC pause) for 7 s with liveness_s 5: on resume its
    next tick comes before the heartbeats queued meanwhile are read. Only max_gap_s of the
    freeze counts as silence, so nobody is lost; a process that stays silent once the
    judge is awake again is lost liveness_s later, as before."""
    live = Liveness(liveness_s=5.0, max_gap_s=1.0, ask_s=0.0)
    live.saw("w1", revision=1, now=0.0)
    live.saw("w2", revision=1, now=0.0)
    assert _ticks(live, 0.0, 2.0) == []
    assert silent(live, 9.0) == []  # resumed after 7 s without a tick: 1 s of it counts
    assert live.saw("w1", revision=2, now=9.01)  # its queued heartbeat, read after the tick
    assert _ticks(live, 9.01, 13.0) == ["w2"]  # silent for 2 + 1 + 2 s awake by 11.0 s: lost just after
    assert "w1" in live


def test_a_judge_that_cannot_hear_counts_no_silence() -> None:
    """Cut off from NATS (or with its watch being made again), the conductor cannot hear
    heartbeats: the time is not counted, however long it is."""
    live = Liveness(liveness_s=3.0, max_gap_s=1.0, ask_s=0.0)
    live.saw("f1", revision=1, now=0.0)
    assert _ticks(live, 0.0, 1.0) == []
    live.hear(False, now=1.0)
    assert _ticks(live, 1.0, 30.0) == []  # 29 s disconnected
    live.hear(True, now=30.0)
    assert _ticks(live, 30.0, 31.5) == []  # 1 + 1.5 s listened
    assert _ticks(live, 31.5, 33.0) == ["f1"]  # past 3 s of listening


def test_the_listening_clock_counts_a_stretch_only_when_it_listened_throughout() -> None:
    clock = ListeningClock(max_gap_s=1.0)
    assert clock.read(10.0) == 0.0
    assert clock.read(10.5) == 0.5
    assert clock.read(20.0) == 1.5  # a 9.5 s gap between reads: the process did not run
    clock.hear(False, 20.2)  # listened up to here
    assert clock.value == pytest.approx(1.7)
    clock.hear(True, 25.0)
    assert clock.read(25.4) == pytest.approx(1.7)  # the stretch that began deaf counts nothing
    assert clock.read(25.9) == pytest.approx(2.2)


async def test_a_conductor_whose_clock_is_an_hour_ahead_keeps_its_live_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real server and worker; the conductor's wall clock runs an hour ahead of theirs
    (another machine, unsynchronised). Before, liveness compared the server's stored time
    with that clock, and every live worker looked an hour dead."""
    skewed = types.SimpleNamespace(time=lambda: time.time() + 3600, monotonic=time.monotonic)
    monkeypatch.setattr(conductor_service, "time", skewed)
    async with conductor_and_worker("duplexbus-skew-") as (config, conductor, worker):
        await asyncio.sleep(3 * config.liveness_s)  # several liveness periods of heartbeats
        assert worker.worker_id in conductor.core.workers, "a live worker was taken for lost"


async def test_heartbeats_that_cannot_be_stored_convict_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cluster whose node leading the heartbeat bucket died, no heartbeat can be stored
    until another leader is elected (seconds): the conductor's probe (Bucket.writable) says
    so and it counts none of that silence. Once the bucket takes writes again, a worker that
    stays silent is lost as before. Here the bucket's refusal is played by the worker's puts
    failing and the probe answering False; the watch itself works all along."""
    async with conductor_and_worker("duplexbus-unstorable-") as (config, conductor, worker):

        async def no_response(*args: object) -> int:
            raise BusUnavailable("put", "no response from stream")

        async def not_writable(timeout: float) -> bool:
            return False

        monkeypatch.setattr(heartbeats(worker), "put", no_response)
        monkeypatch.setattr(conductor.kv[subjects.KV_WORKERS], "writable", not_writable)
        await asyncio.sleep(4 * config.liveness_s)
        assert worker.worker_id in conductor.core.workers, "a worker was convicted for heartbeats nobody could store"
        monkeypatch.delattr(conductor.kv[subjects.KV_WORKERS], "writable")  # the bucket takes writes again
        await stop_answering(worker)  # and the worker is as good as gone
        await until_lost(conductor, worker, 3 * config.liveness_s)
        assert asks(conductor, "absent") == 1
        monkeypatch.delattr(heartbeats(worker), "put")  # its stop writes a last heartbeat


async def test_a_worker_whose_heartbeats_come_late_is_asked_and_kept_and_lost_once_it_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its heartbeats are not stored for 4 x liveness_s (a server whose disk is busy, a
    connection backed up behind twenty uploads), while the bucket takes the conductor's
    writes. Before, it was lost after liveness_s and its calls aborted; now the conductor asks
    it directly and it answers. Once a subscriber that never answers stands in for it (a
    frozen process: connected, silent), it is lost within liveness_s + ask_s."""
    async with conductor_and_worker("duplexbus-late-beats-") as (config, conductor, worker):

        async def late(*args: object) -> int:
            raise BusTimeout("put", "no answer in time")

        monkeypatch.setattr(heartbeats(worker), "put", late)
        await asyncio.sleep(4 * config.liveness_s)
        assert worker.worker_id in conductor.core.workers, "a worker that answers was taken for lost"
        assert asks(conductor, "answered") >= 2  # asked again each liveness_s it stays silent
        assert config.nats_url
        mute = await nats.connect(config.nats_url)
        try:

            async def ignore(msg: object) -> None:
                pass

            await mute.subscribe(subjects.alive(worker.worker_id), cb=ignore)
            await mute.flush()  # subscribed before the worker leaves: an ask never finds no one
            await stop_answering(worker)
            await until_lost(conductor, worker, config.liveness_s + config.liveness_s / 2 + 1.0)
            assert asks(conductor, "expired") == 1 and asks(conductor, "absent") == 0
        finally:
            await mute.close()
        monkeypatch.delattr(heartbeats(worker), "put")


def heartbeats(worker: WorkerService) -> Bucket:
    """The bucket as the worker's heartbeats reach it (on their connection: shared/bus/life.py)."""
    assert worker.life.bus is not None
    return worker.life.bus.kv[subjects.KV_WORKERS]


async def stop_answering(worker: WorkerService) -> None:
    """Unsubscribe the worker from the conductor's direct ask (nats-py keeps its subscriptions
    in a private map; this is a test's reach into it)."""
    assert worker.life.bus is not None
    for sub in list(worker.life.bus._nc._subs.values()):
        if sub.subject == subjects.alive(worker.worker_id):
            await sub.unsubscribe()


async def until_lost(conductor: ConductorService, worker: WorkerService, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while worker.worker_id in conductor.core.workers and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert worker.worker_id not in conductor.core.workers, f"a worker that does not answer was not lost in {within_s} s"


def asks(conductor: ConductorService, outcome: str) -> float:
    return conductor.metrics.registry.get_sample_value("duplexbus_conductor_liveness_asks_total", {"outcome": outcome}) or 0.0


@contextlib.asynccontextmanager
async def conductor_and_worker(prefix: str) -> AsyncIterator[tuple[ServingConfig, ConductorService, WorkerService]]:
    """A conductor and an echo worker in this process on a nats-server of the test's own
    (heartbeats every 0.2 s, liveness_s 1), once the conductor has seen the worker."""
    with own_nats_server(prefix) as server:
        config = parse_config({"nats_url": server.url, "heartbeat_s": 0.2, "liveness_s": 1.0})
        stop = asyncio.Event()
        conductor = conductor_service.ConductorService(config)
        worker = WorkerService(config, "echo")
        tasks = [asyncio.create_task(conductor.run(stop)), asyncio.create_task(worker.run(stop))]
        try:
            for _ in range(100):
                if worker.worker_id in conductor.core.workers:
                    break
                await asyncio.sleep(0.05)
            assert worker.worker_id in conductor.core.workers
            yield config, conductor, worker
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
