"""A worker that cannot take calls is not ready (services/worker/stuck.py), and is replaced.

The watch is pure (hand-made samples and times); the worker's wiring of it is tested on a
WorkerService that never connects: what it samples, /readyz's `serving`, its capacity, and
its stop when stuck past worker_replace_s."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.worker.service import WorkerService
from services.worker.stuck import Health, Sample, StuckWatch
from shared.bus import wire
from shared.runtime.config import parse_config
from shared.runtime.errors import ConfigError, Overloaded
from shared.runtime.health import HealthServer
from shared.runtime.metrics import WorkerMetrics
from shared.sdk.model import CallInfo

STUCK_S, REPLACE_S = 60.0, 120.0


def sample(moved: int = 0, steps: int = 0, refusals: int = 0, full: bool = False, step_since: float | None = None) -> Sample:
    return Sample(moved=moved, steps=steps, refusals=refusals, full=full, step_since=step_since)


def watch(replace_s: float = REPLACE_S) -> StuckWatch:
    w = StuckWatch(STUCK_S, replace_s)
    assert w.observe(0.0, sample()) is Health.SERVING
    return w


def test_refusing_calls_with_nothing_moving_is_stuck_after_the_bound() -> None:
    """Leaked state: a partition refuses calls the worker has room for; no call is held, no step runs."""
    w = watch()
    for t in range(1, 60):
        assert w.observe(float(t), sample(refusals=t)) is Health.SERVING  # refused since t=1
    assert w.observe(61.0, sample(refusals=61)) is Health.STUCK
    assert not w.ready and "refused for want of room" in w.why


def test_a_full_worker_that_steps_its_calls_stays_ready() -> None:
    w = watch()
    for t in range(1, 600):
        assert w.observe(float(t), sample(moved=8, steps=t, refusals=t, full=True)) is Health.SERVING


def test_a_full_worker_whose_calls_come_and_go_stays_ready_though_nothing_steps() -> None:
    w = watch()
    for t in range(1, 600):
        assert w.observe(float(t), sample(moved=t // 30, full=True)) is Health.SERVING


def test_a_full_worker_where_nothing_moves_is_stuck() -> None:
    """Calls that never end and are never stepped hold every slot (the conductor, seeing it full,
    offers it nothing: fullness alone counts as refusing)."""
    w = watch()
    assert w.observe(1.0, sample(moved=8, full=True)) is Health.SERVING
    assert w.observe(60.0, sample(moved=8, full=True)) is Health.SERVING
    assert w.observe(61.0, sample(moved=8, full=True)) is Health.STUCK


def test_a_quiet_worker_with_room_is_never_stuck() -> None:
    w = watch()
    assert w.observe(10_000.0, sample()) is Health.SERVING


def test_a_step_that_runs_past_the_bound_is_stuck_and_ready_again_when_it_ends() -> None:
    w = watch()
    assert w.observe(30.0, sample(step_since=5.0)) is Health.SERVING
    assert w.observe(65.0, sample(step_since=5.0)) is Health.STUCK
    assert "a step has run for 60 s" in w.why
    assert w.observe(66.0, sample(steps=1)) is Health.SERVING
    assert w.ready and w.why == ""


def test_a_stuck_worker_is_replaced_after_the_second_bound_and_stays_so() -> None:
    w = watch()
    assert w.observe(61.0, sample(refusals=1, full=True)) is Health.SERVING  # blocked from 61
    assert w.observe(121.0, sample(refusals=2, full=True)) is Health.STUCK
    assert w.observe(240.0, sample(refusals=3, full=True)) is Health.STUCK
    assert w.observe(241.0, sample(refusals=4, full=True)) is Health.REPLACING
    assert w.observe(242.0, sample(moved=1, steps=1)) is Health.REPLACING  # too late: it is stopping


def test_replace_s_zero_keeps_a_stuck_worker() -> None:
    w = watch(replace_s=0)
    w.observe(1.0, sample(full=True))
    assert w.observe(100_000.0, sample(full=True)) is Health.STUCK


def test_the_bounds_are_config_keys() -> None:
    cfg = parse_config({"worker_stuck_s": 5, "worker_replace_s": 0})
    assert (cfg.worker_stuck_s, cfg.worker_replace_s) == (5, 0)
    with pytest.raises(ConfigError) as e:
        parse_config({"worker_stuck_s": 0})
    assert e.value.key == "worker_stuck_s"
    with pytest.raises(ConfigError) as e:
        parse_config({"worker_replace_s": -1})
    assert e.value.key == "worker_replace_s"


# -- the worker's wiring --------------------------------------------------------------------
def _refusing_worker() -> WorkerService:
    """An echo worker whose Talker refuses every call (as a partition whose slots all leaked)."""
    w = WorkerService(parse_config({"worker_stuck_s": 10, "worker_replace_s": 20}), "echo", ["Talker"])

    def full(call: CallInfo) -> None:
        raise Overloaded("all 4 slots in use")

    w.runners["Talker"].engine.partition.open_call = full  # type: ignore[method-assign]
    return w


async def _offer(w: WorkerService, cid: str) -> wire.AssignReply:
    return await w.assignment.answer(wire.encode(wire.Assign(cid=cid, model="echo", partitions=["Talker"])))


async def test_a_worker_whose_partition_refuses_every_call_is_not_ready_then_replaced() -> None:
    w = _refusing_worker()
    stop = asyncio.Event()
    w.observe(0.0, stop)
    assert not (await _offer(w, "c1")).ok
    assert w.sample().refusals == 1 and w.sample().moved == 0 and not w.sample().full
    w.observe(1.0, stop)
    w.observe(10.5, stop)
    assert w.checks()["serving"] and w.capacity > 0
    w.observe(11.0, stop)  # refusing since 1.0, nothing moved
    assert not w.checks()["serving"]
    assert w.capacity == 0  # its heartbeat offers no slot
    server = HealthServer(WorkerMetrics(), w.checks)
    status, _, body = server.answer("/readyz")
    assert status == 503 and json.loads(body)["checks"]["serving"] is False
    assert not stop.is_set() and not w.replaced
    w.observe(31.0, stop)
    assert stop.is_set() and w.replaced  # it stops, and the process exits with status 1


async def test_a_worker_taking_calls_is_ready() -> None:
    """The same refusals, but calls come and go between them: not stuck."""
    w = WorkerService(parse_config({"worker_stuck_s": 10}), "echo", ["Talker"])
    stop = asyncio.Event()
    w.observe(0.0, stop)
    for t in range(1, 40):
        w.assignment.refusals += 1
        w.runners["Talker"].engine.add_call(f"c{t}")  # a call taken...
        w.runners["Talker"].engine.drop_call(f"c{t}")  # ...and let go
        w.observe(float(t), stop)
    assert w.checks()["serving"] and w.capacity > 0 and not stop.is_set()
