"""The worker shell's own rules that need no bus."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import numpy as np
import pytest

from models.echo import FRAME
from services.worker import engine as eng
from services.worker.assignment import TAKE_FAILED
from services.worker.calls import AssignedCall
from services.worker.service import WorkerService
from shared.bus import wire
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from shared.runtime.errors import BusTimeout, BusUnavailable, ConfigError
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
