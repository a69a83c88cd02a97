"""An item lost in transit is read again from the stream; the call does not stall."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from duplexbus.services.worker.engine import Engine
from duplexbus.services.worker.service import WorkerService
from duplexbus.shared import bus, subjects, wire
from duplexbus.shared.chunking import FixedChunkPolicy, Item, StreamBuffer
from duplexbus.shared.config import parse_config
from duplexbus.shared.model import CallInfo, Emission, Partition, StepInput
from duplexbus.shared.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology


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


async def test_worker_reads_a_lost_item_from_the_stream(nats_url: str) -> None:
    cfg = parse_config({"nats_url": nats_url, "model": "echo"})
    svc = WorkerService(cfg, "echo")
    real = svc._take
    dropped: list[int] = []

    def lossy(subject: str, data: bytes, live: bool) -> Any:
        # the live subscription loses item 5 of the client stream, once
        if live and subject.endswith(".in.audio_in") and not dropped:
            if wire.decode_as(data, wire.InputItem).seq == 5:
                dropped.append(5)
                return [], ""
        return real(subject, data, live)

    svc._take = lossy  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    nc = await bus.connect(cfg, "test-repair")
    try:
        for _ in range(100):
            if svc.nc is not None and svc.js is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        cid = subjects.new_cid()
        frames: list[int] = []
        done = asyncio.Event()

        async def on_out(m: Any) -> None:
            frames.append(json.loads(wire.decode_as(m.data, wire.OutputMsg).json)["frame"])
            if len(frames) == 20:
                done.set()

        await nc.subscribe(subjects.out(cid), cb=on_out)
        reply = await nc.request(
            subjects.assign(svc.worker_id),
            wire.encode(wire.Assign(cid=cid, model="echo", partitions=["Encoder", "Talker"])),
            timeout=5,
        )
        assert wire.decode_as(reply.data, wire.AssignReply).ok
        for seq in range(20):
            item = wire.WireItem.from_item(Item(np.full(1280, seq, dtype="<i2")))
            await nc.publish(subjects.input_(cid, "audio_in"), wire.encode(wire.InputItem(seq=seq, item=item)))
        await nc.jetstream().publish(subjects.eoi(cid, "audio_in"), wire.encode(wire.EndOfInput(total=20)))
        await asyncio.wait_for(done.wait(), timeout=10)
        assert dropped == [5]
        assert frames == list(range(20))
        assert svc.repairs >= 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await nc.close()


async def test_frontend_reads_a_lost_output_from_the_stream(nats_url: str) -> None:
    from duplexbus.services.frontend.protocol import Append, EndInput, Opening
    from duplexbus.services.frontend.service import FrontendService
    from duplexbus.shared.model import ClientFile, ClientInput
    from tests.helpers import Stack

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

        def sink(msg: Any) -> None:
            got.append(msg)
            if isinstance(msg, dict) and ("finish" in msg or "error" in msg):
                finished.set()

        samples = np.arange(10 * 1280, dtype=np.int64).astype("<i2")
        call = await fe.open_call(Opening("lossy", "echo", ClientInput()), sink, object())
        await fe.append(call, Append("lossy", ClientInput(files=[ClientFile("a.pcm", samples.tobytes())])))
        await fe.end_input(call, EndInput("lossy", True))
        await asyncio.wait_for(finished.wait(), 15)
        outputs = [json.loads(m)["output"]["frame"] for m in got if isinstance(m, str)]
        assert dropped == [3]
        assert outputs == list(range(10))  # output 3 came back from the stream, in order
        assert "finish" in got[-1]
    finally:
        await fe.close()
        stack.stop()
