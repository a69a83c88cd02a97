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
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.runtime.config import parse_config
from shared.sdk.chunking import FixedChunkPolicy, Item, StreamBuffer
from shared.sdk.model import CallInfo, Emission, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology


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


@contextlib.asynccontextmanager
async def lossy_worker(nats_url: str, drop: Callable[[str, bytes], bool]) -> AsyncIterator[tuple[WorkerService, Any]]:
    """An echo worker (both partitions) whose live subscriptions lose what `drop` picks, once
    each; with a client connection to drive it."""
    cfg = parse_config({"nats_url": nats_url, "model": "echo"})
    svc = WorkerService(cfg, "echo")
    real = svc._take

    def lossy(subject: str, data: bytes, live: bool) -> Any:
        if live and drop(subject, data):
            return [], ""
        return real(subject, data, live)

    svc._take = lossy  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    nc = await nats.connect(nats_url)
    try:
        for _ in range(100):
            if svc._bus is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
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
    for _ in range(100):  # its placement read is over: what is lost from here on is the repair's
        task = svc.calls[cid].catchup
        if task is not None and task.done():
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

    async with lossy_worker(nats_url, drop) as (svc, nc):
        frames, echoed, _ = await run_echo_call(svc, nc)
        await asyncio.wait_for(echoed.wait(), timeout=10)
        assert dropped == [5]
        assert frames == list(range(20))
        assert svc.repairs >= 1


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
        real = fe._on_out
        dropped: list[int] = []

        def lossy(m: Any) -> None:  # the live subscription loses output 3, once
            if not dropped and wire.decode_as(m.data, wire.OutputMsg).seq == 3:
                dropped.append(3)
                return
            real(m)

        fe._on_out = lossy  # type: ignore[method-assign]
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
