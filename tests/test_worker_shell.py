"""The worker shell's own rules that need no bus."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

from models.echo import FRAME
from services.worker import engine as eng
from services.worker.assignment import TAKE_FAILED
from services.worker.calls import AssignedCall
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg
from shared.runtime.config import parse_config
from shared.runtime.errors import BusDenied, BusError, BusTimeout, BusUnavailable, ConfigError
from shared.sdk.chunking import Item
from shared.sdk.model import CallInfo, Emission, StepInput


def test_worker_capacity_is_the_smallest_partition_bound() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    assert w.capacity == 100
    w.runners["Talker"].engine.partition.capacity = lambda: 3  # type: ignore[method-assign]
    assert w.capacity == 3


def test_unknown_partition_is_refused_at_start() -> None:
    with pytest.raises(ConfigError) as e:
        WorkerService(parse_config({}), "echo", ["Nope"])
    assert e.value.key == "partition" and "'Nope'" in e.value.message and "Encoder, Talker" in e.value.message


def test_a_stopping_worker_has_no_free_slots() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    w._accepting = False  # what run() sets on SIGTERM, before its drain
    assert w.capacity == 0


def test_the_worker_tells_its_repair_policy_which_edges_it_produces_itself() -> None:
    """Both echo partitions here: the Talker's frames come from the Encoder in this process
    (repair.InputReads.may_lose has the rule; tests/test_repair.py tests it)."""
    w = WorkerService(parse_config({}), "echo")
    for p in ("Encoder", "Talker"):
        w.intake.reads.subscribed("c", p, w.runners[p].engine.input_edges(), now=0.0)
    assert w.intake.reads.may_lose("c", "Encoder") and not w.intake.reads.may_lose("c", "Talker")


SECRET = "secret internal detail at 0x7f3a"


async def test_a_model_that_fails_to_open_a_call_sends_no_internal_text(caplog: pytest.LogCaptureFixture) -> None:
    """The conductor passes a refusal's reason on to the client: a model's exception is for
    the worker's log (with its traceback), and the worker goes on."""
    w = WorkerService(parse_config({}), "echo", ["Talker"])

    def fail(call: CallInfo) -> None:
        raise RuntimeError(SECRET)

    w.runners["Talker"].engine.partition.open_call = fail  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="services.worker.assignment"):
        reply = await w.assignment.answer(wire.encode(wire.Assign(cid="c", model="echo", partitions=["Talker"])))
    assert not reply.ok and reply.error == TAKE_FAILED
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == [SECRET]
    assert "c" not in w.calls and "c" not in w.runners["Talker"].engine


async def test_a_bus_failure_while_assigning_sends_no_internal_text(caplog: pytest.LogCaptureFixture) -> None:
    w = WorkerService(parse_config({}), "echo", ["Talker"])

    async def no_open(cid: str) -> dict[str, Any]:
        raise BusTimeout(f"reading the last call.{cid}.open", SECRET)

    w.assignment._kwargs_from_open = no_open  # type: ignore[method-assign]
    assign = wire.Assign(cid="c", model="echo", partitions=["Talker"], kwargs_in_open=True)
    with caplog.at_level(logging.ERROR, logger="services.worker.assignment"):
        reply = await w.assignment.answer(wire.encode(assign))
    assert not reply.ok and reply.error == TAKE_FAILED
    assert any(r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records)


async def test_a_refusal_of_our_own_is_worded_for_the_client() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo", ["Talker"])
    w._accepting = False
    reply = await w.assignment.answer(wire.encode(wire.Assign(cid="c", model="echo", partitions=["Talker"])))
    assert not reply.ok and reply.error == "worker is shutting down"


async def test_a_model_whose_step_raises_fails_its_calls_without_its_text(caplog: pytest.LogCaptureFixture) -> None:
    """The abort reaches the client: it names the partition, the exception stays in the log."""
    w = WorkerService(parse_config({}), "echo", ["Encoder"])
    r = w.runners["Encoder"]
    r.engine.add_call("c")
    for seq in range(8):
        r.engine.push("c", "audio_in", seq, Item(np.zeros(FRAME, dtype="<i2")))
    batch = r.engine.next_batch(0.0)
    assert batch

    def fail(batch: list[StepInput]) -> list[Emission]:
        raise RuntimeError(SECRET)

    r.engine.partition.step = fail  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="services.worker.stepper"):
        actions = await w.stepper._run_step("Encoder", r, batch)
    assert [(type(a), a.error.message) for a in actions if isinstance(a, eng.FailCall)] == [
        (eng.FailCall, "partition Encoder failed")
    ]
    assert [str(rec.exc_info[1]) for rec in caplog.records if rec.exc_info] == [SECRET]


class _StoreFails:
    """A stand-in bus whose store raises what it is given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def store(self, subject: str, body: bytes) -> None:
        raise self.error


async def test_a_barrier_the_bus_could_not_store_is_only_warned_of_and_a_bug_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The placement barrier's read goes on without it where the bus failed (the gap and stall
    reads cover what it misses); a bug there is not passed off as the bus's failure."""
    w = WorkerService(parse_config({}), "echo", ["Talker"])
    call = AssignedCall("c", ["Talker"])
    bus = _StoreFails(BusUnavailable("storing call.c.placed", "no server"))
    w.intake.ctx = dataclasses.replace(w.intake.ctx, bus_of=lambda: cast(BusConnection, bus))
    with caplog.at_level(logging.WARNING, logger="services.worker.intake"):
        await w.intake._barrier(call)
    assert [r.getMessage() for r in caplog.records] == [
        "call c: the barrier before its catch-up read was not stored (storing call.c.placed: no server)"
    ]
    bus.error = TypeError("a bug")
    with pytest.raises(TypeError):
        await w.intake._barrier(call)


@dataclasses.dataclass
class _Request:
    """A request as a handler gets it (BusMsg): no respond() of its own to call."""

    subject: str
    data: bytes
    reply: str = "_INBOX.x"
    headers: dict[str, str] | None = None


class _Answers:
    """A stand-in bus that takes answers, or fails them with `error`."""

    def __init__(self) -> None:
        self.answered: list[tuple[BusMsg, bytes]] = []
        self.error: BusError | None = None

    async def answer(self, msg: BusMsg, body: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.answered.append((msg, body))


async def test_an_assignment_is_answered_through_the_connection_and_a_lost_answer_is_only_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """BusConnection.answer maps nats-py's errors to BusErrors; the conductor takes an answer
    that never comes for a refusal, so the handler warns and goes on."""
    w = WorkerService(parse_config({}), "echo", ["Talker"])
    w._accepting = False  # refused at once: no call to set up on a bus
    bus = _Answers()
    w.assignment.ctx = dataclasses.replace(w.assignment.ctx, bus_of=lambda: cast(BusConnection, bus))
    msg = _Request("ctl.worker.w.assign", wire.encode(wire.Assign(cid="c", model="echo", partitions=["Talker"])))
    await w.assignment.on_assign(msg)
    [(to, body)] = bus.answered
    assert to is msg and wire.decode_as(body, wire.AssignReply).error == "worker is shutting down"
    bus.error = BusUnavailable("answering ctl.worker.w.assign", "connection closed")
    with caplog.at_level(logging.WARNING, logger="services.worker.assignment"):
        await w.assignment.on_assign(msg)
    assert [r.getMessage() for r in caplog.records] == [
        "the answer to an assignment was not sent: answering ctl.worker.w.assign: connection closed"
    ]


class _Refuses:
    """A stand-in bus whose store_once refuses for good the subjects `refused` says."""

    def __init__(self, refused: Callable[[str], bool]) -> None:
        self.refused = refused
        self.tried: list[str] = []
        self.bodies: dict[str, bytes] = {}

    async def store_once(self, subject: str, body: bytes) -> None:
        self.tried.append(subject)
        self.bodies[subject] = body
        if self.refused(subject):
            raise BusDenied(f"storing {subject}", "permissions violation")


async def _ends_stored(w: WorkerService, bus: _Refuses, *actions: tuple[eng.Action, str]) -> None:
    """Carry out `actions` (action, partition), the stepper's ends stored against `bus`
    until none is left."""
    w.stepper.ctx = dataclasses.replace(w.stepper.ctx, bus_of=lambda: cast(BusConnection, bus))
    for action, partition in actions:
        await w.stepper.carry_out([action], partition)
    ends = asyncio.create_task(w.stepper.ends.run())
    try:
        deadline = time.monotonic() + 5
        while len(w.stepper.ends) or len(w.intake.tasks):
            assert time.monotonic() < deadline, "the ends were not stored"
            await asyncio.sleep(0.005)
    finally:
        ends.cancel()
        await asyncio.gather(ends, return_exceptions=True)


def _running(partitions: list[str]) -> WorkerService:
    """A worker with call "c" assigned to `partitions`, running in each."""
    w = WorkerService(parse_config({}), "echo", partitions)
    w.intake.calls["c"] = AssignedCall("c", list(partitions))
    for p in partitions:
        w.runners[p].engine.add_call("c")
    return w


REFUSED_ABORT = "partition Encoder could not store its results"


async def test_a_call_whose_done_is_refused_for_good_is_failed_and_dropped() -> None:
    """Without its done the conductor would wait on the call for ever: it is failed (its abort
    names the partition, not the bus's text) and let go here, its other partition's state
    with it."""
    w = _running(["Encoder", "Talker"])
    w.runners["Encoder"].engine.drop_call("c")  # as the engine does when it emits the done
    bus = _Refuses(lambda s: s == subjects.done("c", "Encoder"))
    await _ends_stored(w, bus, (eng.PublishDone("c", 0, {}), "Encoder"))
    assert bus.tried == [subjects.done("c", "Encoder"), subjects.abort("c")]
    abort = wire.decode_as(bus.bodies[subjects.abort("c")], wire.Abort)
    assert (abort.reason, abort.status) == (REFUSED_ABORT, 500)
    assert "c" not in w.calls and "c" not in w.runners["Talker"].engine
    assert w.stepper.ends.failures == 1


async def test_a_call_whose_edge_end_is_refused_for_good_is_failed_and_dropped() -> None:
    """The edge's consumer on another worker would wait on the end for ever."""
    w = _running(["Encoder"])
    bus = _Refuses(lambda s: s == subjects.edge_end("c", "frames"))
    await _ends_stored(w, bus, (eng.PublishEdgeEnd("c", "frames", 3), "Encoder"))
    assert bus.tried == [subjects.edge_end("c", "frames"), subjects.abort("c")]
    assert "c" not in w.calls and "c" not in w.runners["Encoder"].engine


async def test_a_call_with_every_end_refused_is_failed_once() -> None:
    """Both dones refused in one batch fail the call once, and its abort refused too is only
    logged: it is not sent again, and nothing else fails the call again."""
    w = _running(["Encoder", "Talker"])
    for r in w.runners.values():
        r.engine.drop_call("c")
    bus = _Refuses(lambda s: True)
    await _ends_stored(w, bus, (eng.PublishDone("c", 0, {}), "Encoder"), (eng.PublishDone("c", 0, {}), "Talker"))
    assert bus.tried == [subjects.done("c", "Encoder"), subjects.done("c", "Talker"), subjects.abort("c")]
    assert "c" not in w.calls and w.stepper.ends.failures == 3


@pytest.mark.parametrize("error", [BusUnavailable("reading call.c.in.>", "no server"), TypeError("a bug")])
async def test_a_catch_up_read_warns_of_a_bus_failure_and_leaves_a_bug_to_its_task_set(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """The gap and stall reads try again after the bus's failure (one line); a bug is not
    passed off as one: it ends the task, whose TaskSet logs it with its traceback."""
    w = _running(["Talker"])

    async def no_barrier(call: AssignedCall) -> int | None:
        return None

    async def read_on(call: AssignedCall, r: Any, upto: int | None = None) -> bool | None:
        raise error

    w.intake._barrier = no_barrier  # type: ignore[method-assign]
    w.intake._read_on = read_on  # type: ignore[method-assign]
    read = w.intake.reads.subscribed("c", "Talker", w.runners["Talker"].engine.input_edges(), now=0.0)
    with caplog.at_level(logging.WARNING):
        w.intake._start_read(read)
        task = w.calls["c"].catchups["Talker"]
        await asyncio.wait([task], timeout=5)
    assert not w.intake.reads.reading("c", "Talker")  # ended: the next gap or stall read may start
    lines = [(r.name, r.levelno, r.exc_info is not None) for r in caplog.records]
    if isinstance(error, BusError):
        assert task.exception() is None
        assert lines == [("services.worker.intake", logging.WARNING, False)]
    else:
        assert task.exception() is error
        assert lines == [("shared.runtime.process", logging.ERROR, True)]


async def test_a_read_at_placement_reads_up_to_its_barrier_and_on_to_the_end_once_paused() -> None:
    """The read from the start is bounded by the barrier's stream sequence (what came after it
    came live, and the bounded read needs no consumer: BusConnection.read_stored); once the
    partition is paused for want of room its live input waits in the stream, so the reads
    after that go on to the stream's end."""
    w = _running(["Talker"])
    bounds: list[int | None] = []

    async def barrier(call: AssignedCall) -> int | None:
        return 41

    async def read_on(call: AssignedCall, r: Any, upto: int | None = None) -> bool | None:
        bounds.append(upto)
        return len(bounds) > 1  # the first stops for want of room, the second reads to the end

    w.intake._barrier = barrier  # type: ignore[method-assign]
    w.intake._read_on = read_on  # type: ignore[method-assign]
    w.intake._pause = lambda cid, partition: None  # type: ignore[method-assign]
    read = w.intake.reads.subscribed("c", "Talker", w.runners["Talker"].engine.input_edges(), now=0.0)
    assert read is not None and read.from_start
    w.intake._start_read(read)
    await asyncio.wait_for(w.calls["c"].catchups["Talker"], 5)
    assert bounds == [41, None]


class _Bounded:
    """A stand-in bus whose reads up to a stored sequence do (or do not) need a consumer."""

    def __init__(self, reads_direct: bool) -> None:
        self.reads_direct = reads_direct


@pytest.mark.parametrize("reads_direct", [True, False])
async def test_a_gap_read_is_bounded_by_a_barrier_of_its_own_where_that_needs_no_consumer(reads_direct: bool) -> None:
    """A gap read looks for items published before it began: stored before a barrier stored
    then, so it reads up to that barrier (direct gets where one server holds the stream, no
    consumer per late item); where a bounded read would need a consumer anyway, no barrier is
    stored and the read goes on to the stream's end, as before."""
    w = _running(["Talker"])
    w.intake.ctx = dataclasses.replace(w.intake.ctx, bus_of=lambda: cast(BusConnection, _Bounded(reads_direct)))
    bounds: list[int | None] = []
    barriers = iter([41, 57])

    async def barrier(call: AssignedCall) -> int | None:
        return next(barriers)

    async def read_on(call: AssignedCall, r: Any, upto: int | None = None) -> bool | None:
        bounds.append(upto)
        return True

    w.intake._barrier = barrier  # type: ignore[method-assign]
    w.intake._read_on = read_on  # type: ignore[method-assign]
    reads = w.intake.reads
    placed = reads.subscribed("c", "Talker", w.runners["Talker"].engine.input_edges(), now=0.0)
    assert placed is not None and placed.from_start
    w.intake._start_read(placed)
    await asyncio.wait_for(w.calls["c"].catchups["Talker"], 5)
    gaps = {("c", "Talker"): (("frames", 3),)}
    assert reads.tick(0.5, gaps, []) == []  # first seen: it may still come live
    [gap] = reads.tick(1.0, gaps, [])
    assert gap.why.value == "gap" and not gap.from_start
    w.intake._start_read(gap)
    await asyncio.wait_for(w.calls["c"].catchups["Talker"], 5)
    assert bounds == ([41, 57] if reads_direct else [41, None])


class _Reads:
    """A stand-in bus that records the filters of each read of the stream and holds nothing."""

    def __init__(self) -> None:
        self.filters: list[list[str]] = []

    async def read_stored(self, filters: list[str], after: int = 0, batch: int = 512, upto: int | None = None) -> Any:
        self.filters.append(filters)
        return
        yield


@pytest.mark.parametrize(("partition", "kinds"), [("Encoder", ("in", "eoi")), ("Talker", ("edge", "edge_end"))])
async def test_a_read_names_each_subject_it_reads(partition: str, kinds: tuple[str, str]) -> None:
    """A client stream's items and end, or an edge's from another partition, and the call's
    abort and fin, each by name: a direct get on a wildcard filter costs the server about
    1 ms, on a subject it names 30 to 60 µs (bench/admission_cost.py)."""
    w = WorkerService(parse_config({}), "echo", [partition])
    w.intake.calls["c"] = AssignedCall("c", [partition])
    bus = _Reads()
    w.intake.ctx = dataclasses.replace(w.intake.ctx, bus_of=lambda: cast(BusConnection, bus))
    read = w.intake.reads.subscribed("c", partition, w.runners[partition].engine.input_edges(), now=0.0)
    assert read is not None
    assert await w.intake._read_on(w.calls["c"], read, upto=7) is True
    edge = read.edges[0]
    assert bus.filters == [[f"call.c.{kinds[0]}.{edge}", f"call.c.{kinds[1]}.{edge}", "call.c.abort", "call.c.fin"]]
