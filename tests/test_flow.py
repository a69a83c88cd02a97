"""Flow control from the stream, pure: the bounds (services/worker/flow.py), when a paused
partition of a call is read and resumed (services/worker/repair.py), and what the engine holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from services.worker.engine import Engine
from services.worker.flow import Bounds
from services.worker.repair import InputReads, Next, Why
from shared.sdk.chunking import FixedChunkPolicy, Item, item_bytes
from shared.sdk.model import CallInfo, Emission, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology


# -- the bounds -------------------------------------------------------------------------
def test_live_input_is_taken_under_the_call_and_the_worker_bounds() -> None:
    b = Bounds(call_bytes=100, worker_bytes=1000)
    assert b.take(99, 999)
    assert not b.take(100, 0)  # the call holds its share
    assert not b.take(0, 1000)  # the worker holds its share


def test_a_read_may_always_bring_what_the_calls_next_step_needs() -> None:
    b = Bounds(call_bytes=100, worker_bytes=1000)
    assert not b.read_take(100, 0, call_has_chunk=True)
    assert not b.read_take(0, 1000, call_has_chunk=True)
    assert b.read_take(500, 5000, call_has_chunk=False)  # nothing to step: it is never starved


def test_room_comes_back_at_half_the_call_bound_or_when_nothing_is_left_to_step() -> None:
    b = Bounds(call_bytes=100, worker_bytes=1000)
    assert not b.has_room(50, 0, call_has_chunk=True)  # not for every step's worth: half the bound
    assert b.has_room(49, 0, call_has_chunk=True)
    assert not b.has_room(10, 1000, call_has_chunk=True)
    assert b.has_room(100, 1000, call_has_chunk=False)
    with pytest.raises(ValueError):
        Bounds(call_bytes=0)


# -- pause and resume (one partition of one call: the unit of repair.InputReads) --------------
def test_a_paused_partition_is_read_on_from_where_reads_reached_and_resumes_at_the_end() -> None:
    reads = InputReads()
    placed = reads.subscribed("c", "P", ["in"], now=0.0)
    assert placed is not None and reads.subscribed("c", "Q", ["mid"], now=0.0) is not None
    reads.read_progress("c", "P", placed.read_id, 10)
    assert reads.at_end("c", "P", placed.read_id) is Next.DONE  # live all along: live input covers the rest
    reads.read_ended("c", "P", placed.read_id)
    newly, read = reads.pause("c", "P")
    assert newly and reads.paused("c", "P") and not reads.paused("c", "Q")  # the call's other partition goes on
    assert read is not None and (read.why, read.from_start, read.after) == (Why.PAUSED, False, 10)
    assert reads.pause("c", "P") == (False, None)  # already paused
    reads.read_progress("c", "P", read.read_id, 50)
    assert reads.at_end("c", "P", read.read_id) is Next.RESUME  # still paused: take live input again, behind a barrier
    reads.resumed("c", "P", now=1.0)
    assert not reads.paused("c", "P")
    assert reads.at_end("c", "P", read.read_id) is Next.DONE  # the read behind the barrier found it live
    reads.read_ended("c", "P", read.read_id)
    assert not reads.reading("c", "P") and reads.read_to("c", "P") == 50


def test_a_partition_paused_while_a_read_runs_is_read_on_by_that_read() -> None:
    reads = InputReads()
    placed = reads.subscribed("c", "P", ["in"], now=0.0)
    assert placed is not None
    assert reads.pause("c", "P") == (True, None)  # the running read reads on past what is dropped from now
    assert reads.at_end("c", "P", placed.read_id) is Next.RESUME
    unit = ("c", "P")
    assert reads.tick(100.0, {unit: (("in", 3),)}, [unit]) == []  # nor do gaps or stalls start another
    assert reads.tick(200.0, {unit: (("in", 3),)}, [unit]) == []


def test_a_paused_partition_whose_read_failed_is_read_again_when_it_stalls() -> None:
    reads = InputReads(stall_s=2.0)
    placed = reads.subscribed("c", "P", ["in"], now=0.0)
    assert placed is not None
    reads.pause("c", "P")
    reads.read_ended("c", "P", placed.read_id)  # failed (the bus): it gets no live input while paused
    (stall,) = reads.tick(2.0, {}, [("c", "P")])
    assert stall.why is Why.STALL and reads.at_end("c", "P", stall.read_id) is Next.RESUME


# -- what the engine holds ------------------------------------------------------------------
class Nop(Partition):
    blocking = False

    def open_call(self, call: CallInfo) -> None: ...
    def step(self, batch: list[StepInput]) -> list[Emission]:
        return []

    def close_call(self, cid: str) -> dict[str, Any]:
        return {}


def audio(seq: int) -> Item:
    return Item(np.full(1280, seq, dtype="<i2"))


def test_the_engine_counts_the_bytes_its_calls_hold() -> None:
    topo = PartitionTopology(["P"], [Connection(CLIENT, "P", "in", lambda: FixedChunkPolicy(2), ClientStreamLimits())])
    e = Engine("P", topo, Nop())
    one = item_bytes(audio(0))
    for cid in ("a", "b", "c"):
        e.add_call(cid)
    for seq in range(5):
        e.push("a", "in", seq, audio(seq))
    e.push("a", "in", 3, audio(3))  # a repeat holds nothing more
    e.push("b", "in", 1, audio(1))  # ahead of a gap: held all the same
    assert (e.held("a"), e.held("b"), e.held_bytes) == (5 * one, one, 6 * one)
    assert e.wants_item("a", "in", 5) and not e.wants_item("a", "in", 4) and not e.wants_item("x", "in", 0)
    assert e.has_chunk("a") and not e.has_chunk("b")
    e.next_batch()  # one chunk of 2 from a
    assert e.held("a") == 3 * one and e.held_bytes == 4 * one
    e.drop_call("b")
    assert e.held_bytes == 3 * one
    e.push("a", "in", 99, audio(0))
    e.end("a", "in", 6)  # 99 was past the end: the call failed, and its buffers went with it
    assert e.held("a") == 0 and e.held_bytes == 0
