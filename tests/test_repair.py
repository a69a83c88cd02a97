"""An item lost in transit is read again from the stream; the call does not stall."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import numpy as np

from services.worker.engine import Engine
from services.worker.repair import DEEP_AFTER, InputReads, StartRead, Why
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.runtime.config import parse_config
from shared.sdk.chunking import FixedChunkPolicy, Item, StreamBuffer
from shared.sdk.model import CallInfo, Emission, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology
from tests.support.bus import consumer_requests
from tests.support.poll import until


def test_buffer_reports_the_first_missing_item() -> None:
    b = StreamBuffer(FixedChunkPolicy(1))
    b.push(0, Item())
    assert b.missing is None
    b.push(2, Item())  # 1 is known to exist
    assert b.missing == 1
    b.push(1, Item())
    assert b.missing is None
    b.end(5)  # 3 and 4 exist but none came
    assert b.missing == 3


class Nop(Partition):
    def open_call(self, call: CallInfo) -> None: ...
    def step(self, batch: list[StepInput]) -> list[Emission]:
        return []

    def close_call(self, cid: str) -> dict[str, Any]:
        return {}


def test_engine_lists_calls_waiting_on_a_lost_item() -> None:
    topo = PartitionTopology(["P"], [Connection(CLIENT, "P", "in", lambda: FixedChunkPolicy(1), ClientStreamLimits())])
    e = Engine("P", topo, Nop())
    e.add_call("a")
    e.add_call("b")
    e.push("a", "in", 1, Item())
    e.push("b", "in", 0, Item())
    assert e.missing() == {"a": (("in", 0),)}


# -- the repair policy (services/worker/repair.py), pure -------------------------------------
# Its unit is one partition of one call on the worker: ("c", "P") below.
def started(r: StartRead | None) -> tuple[str, tuple[str, ...], bool, int, Why]:
    assert r is not None
    return r.partition, r.edges, r.from_start, r.after, r.why


def test_a_placed_partition_is_read_from_the_start_and_a_running_read_covers_repeats() -> None:
    reads = InputReads()
    first = reads.subscribed("c", "P", ["in"], now=0.0)
    assert started(first) == ("P", ("in",), True, 0, Why.PLACED)
    assert reads.subscribed("c", "P", ["in"], now=0.1) is None  # a repeated assignment
    assert reads.reconnected() == []  # the read under way covers a reconnect
    assert reads.tick(10.0, {("c", "P"): (("in", 3),)}, [("c", "P")]) == []  # and gaps and stalls
    assert reads.tick(20.0, {("c", "P"): (("in", 3),)}, [("c", "P")]) == []


def test_each_partition_of_a_call_is_read_on_its_own() -> None:
    reads = InputReads()
    p = reads.subscribed("c", "P", ["in"], now=0.0)
    assert p is not None
    reads.read_progress("c", "P", p.read_id, 40)
    q = reads.subscribed("c", "Q", ["mid"], now=0.1)  # placed here while P's read runs
    assert started(q) == ("Q", ("mid",), True, 0, Why.PLACED)  # from the start, behind a barrier, beside P's
    assert q is not None and q.read_id != p.read_id and reads.reading("c", "P")
    reads.read_progress("c", "Q", p.read_id, 90)  # another read's progress counts for nothing
    reads.read_progress("c", "Q", q.read_id, 120)
    reads.read_ended("c", "P", p.read_id)
    assert not reads.reading("c", "P") and reads.reading("c", "Q")
    reads.read_ended("c", "Q", q.read_id)
    again = sorted((started(r) for r in reads.reconnected()), key=lambda r: r[0])
    assert again == [("P", ("in",), False, 40, Why.RECONNECT), ("Q", ("mid",), False, 120, Why.RECONNECT)]  # on from there


def test_a_gap_is_read_when_the_same_items_are_missing_for_a_whole_period() -> None:
    reads = InputReads()
    r = reads.subscribed("c", "P", ["in"], now=0.0)
    assert r is not None
    reads.read_progress("c", "P", r.read_id, 7)
    reads.read_ended("c", "P", r.read_id)
    unit = ("c", "P")
    assert reads.tick(0.5, {unit: (("in", 5),)}, [unit]) == []  # seen once: may still be on its way
    assert reads.tick(1.0, {unit: (("in", 6),)}, [unit]) == []  # another gap: the first one was filled
    (gap,) = reads.tick(1.5, {unit: (("in", 6),)}, [unit])
    assert started(gap) == ("P", ("in",), False, 7, Why.GAP) and "('in', 6)" in gap.detail
    assert reads.tick(2.0, {unit: (("in", 6),)}, [unit]) == []  # that read is still under way
    reads.read_ended("c", "P", gap.read_id)
    assert [r.why for r in reads.tick(2.5, {unit: (("in", 6),)}, [unit])] == [Why.GAP]
    other = ("x", "P")  # not a call here
    assert reads.tick(3.0, {other: (("in", 0),)}, []) == [] and reads.tick(3.5, {other: (("in", 0),)}, []) == []


def test_a_placed_partition_is_read_from_its_calls_open_and_from_the_streams_start_once_gaps_stay() -> None:
    """The first read starts at the call's open (a direct get from sequence 1 cost the server
    5.5 ms a page on a stream of 640,000 messages, from near the call's messages 0.8 ms: an
    open storm makes hundreds). An item stored before the open all the same (its store sent
    again after the call's first appends) is found: once DEEP_AFTER gap reads from there ended
    with the same gaps, the next reads from the stream's start, once."""
    reads = InputReads()
    first = reads.subscribed("c", "P", ["in"], now=0.0, floor=4999)
    assert started(first) == ("P", ("in",), True, 4999, Why.PLACED)
    assert first is not None
    reads.read_progress("c", "P", first.read_id, 5100)
    reads.read_ended("c", "P", first.read_id)
    unit, gaps = ("c", "P"), (("in", 0),)
    assert reads.tick(0.5, {unit: gaps}, [unit]) == []
    afters = []
    for i in range(DEEP_AFTER + 2):
        (gap,) = reads.tick(1.0 + i, {unit: gaps}, [unit])
        afters.append(gap.after)
        if gap.after == 0:
            reads.read_progress("c", "P", gap.read_id, 5100)  # the read from the start went to the end
        reads.read_ended("c", "P", gap.read_id)
    assert afters == [5100] * DEEP_AFTER + [0, 5100]  # from the start once, then on from where it reached
    other = InputReads()
    r = other.subscribed("c", "P", ["in"], now=0.0)  # no open known (a conductor before 1.5): from the start
    assert started(r) == ("P", ("in",), True, 0, Why.PLACED)


def test_a_gap_that_moves_is_no_reason_to_read_from_the_streams_start() -> None:
    """Items late, not lost (a loaded machine): each gap read finds its gap filled and the
    next one is another; the reads stay on from where they reached."""
    reads = InputReads()
    first = reads.subscribed("c", "P", ["in"], now=0.0, floor=99)
    assert first is not None
    reads.read_ended("c", "P", first.read_id)
    unit = ("c", "P")
    afters = []
    for i in range(2 * DEEP_AFTER + 2):
        for gap in reads.tick(0.5 * i, {unit: (("in", i // 2),)}, [unit]):  # each gap seen twice, then the next
            if gap.why is Why.GAP:
                afters.append(gap.after)
            reads.read_ended("c", "P", gap.read_id)
    assert afters == [99] * (DEEP_AFTER + 1)


def test_a_stalled_partition_is_read_waiting_twice_as_long_each_time_until_input_comes() -> None:
    reads = InputReads(stall_s=2.0, stall_max_s=8.0)
    r = reads.subscribed("c", "P", ["in"], now=0.0)
    assert r is not None
    unit = ("c", "P")
    assert reads.tick(3.0, {}, [unit]) == []  # a read is under way
    reads.read_ended("c", "P", r.read_id)
    times = []
    for t in range(3, 40):
        for s in reads.tick(float(t), {}, [unit]):
            assert s.why is Why.STALL
            times.append(t)
            reads.read_ended("c", "P", s.read_id)
    assert times == [3, 7, 15, 23, 31, 39]  # waits of 2, 4, 8, then 8 at most
    reads.live_input("c", "P", 40.0)  # input again: back to the shortest wait
    assert reads.tick(41.9, {}, [unit]) == []
    assert len(reads.tick(42.0, {}, [unit])) == 1
    assert reads.tick(50.0, {}, []) == []  # input complete: nothing is awaited


def test_only_input_that_can_be_lost_on_its_way_is_read_again_when_it_stalls() -> None:
    """P reads the client's input, Q reads P's output ("mid"). With both here, Q's input is
    handed over in the process and cannot be lost: a Q waiting on a P that is behind is not
    read again, unless Q is paused (then its read is all it gets). Alone, Q's input comes
    over the bus from another worker."""
    topology = {"in": CLIENT, "mid": "P"}
    reads = InputReads(stall_s=2.0, produced_by=topology)
    p, q = ("c", "P"), ("c", "Q")
    for unit, edges in ((p, ["in"]), (q, ["mid"])):
        r = reads.subscribed(*unit, edges, now=0.0)
        assert r is not None
        reads.read_ended(*unit, r.read_id)
    assert reads.may_lose(*p) and not reads.may_lose(*q)
    assert [(s.partition, s.why) for s in reads.tick(3.0, {}, [p, q])] == [("P", Why.STALL)]
    assert reads.tick(100.0, {}, [q]) == []  # however long it waits
    newly, paused = reads.pause(*q)
    assert newly and paused is not None and reads.may_lose(*q)
    reads.read_ended(*q, paused.read_id)  # (its read failed, say)
    assert [(s.partition, s.why) for s in reads.tick(200.0, {}, [q])] == [("Q", Why.STALL)]
    alone = InputReads(produced_by=topology)
    assert alone.subscribed("c", "Q", ["mid"], now=0.0) is not None
    assert alone.may_lose("c", "Q") and not alone.may_lose("x", "Q")  # (a call not here has nothing to lose)


def test_a_forgotten_call_is_never_read() -> None:
    reads = InputReads()
    r = reads.subscribed("c", "P", ["in"], now=0.0)
    assert r is not None and reads.subscribed("c", "Q", ["mid"], now=0.0) is not None
    reads.forget("c")
    reads.read_ended("c", "P", r.read_id)
    unit = ("c", "P")
    assert reads.tick(0.5, {unit: (("in", 1),)}, [unit]) == [] and reads.tick(100.0, {unit: (("in", 1),)}, [unit]) == []
    assert reads.reconnected() == [] and "c" not in reads


@contextlib.asynccontextmanager
async def lossy_worker(nats_url: str, drop: Callable[[str, bytes], bool]) -> AsyncIterator[tuple[WorkerService, Any]]:
    """An echo worker (both partitions) whose live subscriptions lose what `drop` picks, once
    each; with a client connection to drive it."""
    cfg = parse_config({"nats_url": nats_url, "model": "echo"})
    svc = WorkerService(cfg, "echo")
    real = svc.intake._take

    def lossy(subject: str, data: bytes, live: bool) -> Any:
        if live and drop(subject, data):
            return [], ""
        return real(subject, data, live)

    svc.intake._take = lossy  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    nc = await nats.connect(nats_url)
    try:

        async def serving() -> bool:
            """Its heartbeat is stored: it beats once subscribed to its assignments."""
            try:
                return await (await nc.jetstream().key_value(subjects.KV_WORKERS)).get(svc.worker_id) is not None
            except nats.errors.Error:  # no bucket or no key yet
                return False

        await until(serving, 10, "the worker serving")
        yield svc, nc
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await nc.close()


async def run_echo_call(svc: WorkerService, nc: Any, n: int = 20) -> tuple[list[int], asyncio.Event, asyncio.Event]:
    """Assign a call to the worker and publish its n items and end: (frames echoed, all
    echoed, both partitions done)."""
    cid = subjects.new_cid()
    frames: list[int] = []
    echoed, done = asyncio.Event(), asyncio.Event()
    dones: list[str] = []

    async def on_out(m: Any) -> None:
        frames.append(json.loads(wire.decode_as(m.data, wire.OutputMsg).json)["frame"])
        if len(frames) == n:
            echoed.set()

    async def on_done(m: Any) -> None:
        dones.append(m.subject)
        if len(dones) == 2:
            done.set()

    await nc.subscribe(subjects.out(cid), cb=on_out)
    await nc.subscribe(subjects.done(cid, "*"), cb=on_done)
    reply = await nc.request(
        subjects.assign(svc.worker_id),
        wire.encode(wire.Assign(cid=cid, model="echo", partitions=["Encoder", "Talker"])),
        timeout=5,
    )
    assert wire.decode_as(reply.data, wire.AssignReply).ok
    for _ in range(100):  # its placement reads are over: what is lost from here on is the repair's
        tasks = svc.calls[cid].catchups.values()
        if len(tasks) == 2 and all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.02)
    for seq in range(n):
        item = wire.WireItem.from_item(Item(np.full(1280, seq, dtype="<i2")))
        await nc.publish(subjects.input_(cid, "audio_in"), wire.encode(wire.InputItem(seq=seq, item=item)))
    await nc.jetstream().publish(subjects.eoi(cid, "audio_in"), wire.encode(wire.EndOfInput(total=n)))
    return frames, echoed, done


async def test_worker_reads_a_lost_item_from_the_stream(nats_url: str) -> None:
    dropped: list[int] = []

    def drop(subject: str, data: bytes) -> bool:  # item 5 of the client stream, once
        if subject.endswith(".in.audio_in") and not dropped and wire.decode_as(data, wire.InputItem).seq == 5:
            dropped.append(5)
            return True
        return False

    async with lossy_worker(nats_url, drop) as (svc, nc), consumer_requests(nats_url, about="call.") as consumers:
        frames, echoed, _ = await run_echo_call(svc, nc)
        await asyncio.wait_for(echoed.wait(), timeout=10)
        assert dropped == [5]
        assert frames == list(range(20))
        assert svc.intake.repairs >= 1
    # The gap read went up to a barrier of its own, by direct gets: no consumer on the call.
    assert consumers == [], consumers


async def test_worker_reads_a_lost_end_and_last_item_from_the_stream(nats_url: str) -> None:
    """Losing the last item and the end of the stream leaves no gap in what came: the worker
    notices that its input stalled and reads the stream."""
    lost: list[str] = []

    def drop(subject: str, data: bytes) -> bool:
        msg = wire.decode(data)
        if isinstance(msg, wire.EndOfInput) or (isinstance(msg, wire.InputItem) and msg.seq == 19):
            lost.append(type(msg).__name__)
            return True
        return False

    async with lossy_worker(nats_url, drop) as (svc, nc):
        frames, _, done = await run_echo_call(svc, nc)
        await asyncio.wait_for(done.wait(), timeout=15)  # both partitions finished
        assert sorted(lost) == ["EndOfInput", "InputItem"]
        assert frames == list(range(20))
        for _ in range(40):  # the worker forgets it once its own publish of the done returns
            if not svc.calls:
                break
            await asyncio.sleep(0.05)
        assert not svc.calls


async def test_frontend_reads_a_lost_output_from_the_stream(nats_url: str) -> None:
    from services.frontend.protocol import Append, EndInput, Opening
    from services.frontend.service import FrontendService
    from shared.sdk.model import ClientFile, ClientInput
    from tests.support.stack import Stack

    stack = Stack(nats_url, {"model": "echo"})
    fe = FrontendService(parse_config({"nats_url": nats_url, "model": "echo"}))
    try:
        await stack.start(workers=[None], frontends=0)
        await stack.wait_workers(1)
        await fe.start()
        await asyncio.wait_for(fe.ready.wait(), 20)
        real = fe.outputs.on_out
        dropped: list[int] = []

        def lossy(m: Any) -> None:  # the live subscription loses output 3, once
            if not dropped and wire.decode_as(m.data, wire.OutputMsg).seq == 3:
                dropped.append(3)
                return
            real(m)

        fe.outputs.on_out = lossy  # type: ignore[method-assign]
        got: list[Any] = []
        finished = asyncio.Event()

        class Sink:
            def send(self, msg: Any) -> None:
                got.append(msg)
                if isinstance(msg, dict) and ("finish" in msg or "error" in msg):
                    finished.set()

            def has_room(self) -> bool:
                return True

            def when_room(self, key: str, then: Any) -> None:
                pass

        samples = np.arange(10 * 1280, dtype=np.int64).astype("<i2")
        call = await fe.open_call(Opening("lossy", "echo", ClientInput()), Sink())
        await fe.append(call, Append("lossy", ClientInput(files=[ClientFile("a.pcm", samples.tobytes())])))
        await fe.end_input(call, EndInput("lossy", True))
        await asyncio.wait_for(finished.wait(), 15)
        outputs = [json.loads(m)["output"]["frame"] for m in got if isinstance(m, bytes)]  # relayed as JSON bytes
        assert dropped == [3]
        assert outputs == list(range(10))  # output 3 came back from the stream, in order
        assert "finish" in got[-1]
    finally:
        await fe.close()
        stack.stop()
