"""Bodies over the server's max_payload go through the JetStream Object Store."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator

import numpy as np
import pytest

from shared.bus.connection import BusMsg
from shared.runtime.config import parse_config
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import bus_client
from tests.support.client import WS
from tests.support.stack import Stack, running_stack


async def test_large_body_round_trip_through_the_object_store(nats_url: str) -> None:
    async with bus_client(nats_url, "test-payloads") as conn:
        big = os.urandom(conn.payloads.limit + 12345)
        small = b"small"
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def cb(m: BusMsg) -> None:
            await got.put(await conn.body(m))

        await conn.subscribe("call.payloadtest.out", cb)
        await conn.publish("call.payloadtest.out", big)
        await conn.publish("call.payloadtest.out", small)
        assert await asyncio.wait_for(got.get(), 10) == big
        assert await asyncio.wait_for(got.get(), 10) == small
        # the stream keeps the small reference, so a replay finds the body too
        assert await conn.last_stored("call.payloadtest.out") == small


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo"}) as s:
        yield s


async def test_opening_larger_than_max_payload_still_runs(stack: Stack, ws: WS) -> None:
    blob = base64.b64encode(os.urandom(1_500_000)).decode()  # the Open message is ~2 MB
    samples = (np.arange(5 * 1280) % 1000).astype("<i2")
    await ws.send({"request_id": "big", "model_kwargs": {"blob": blob}, "files": [pcm_file(samples)], "end_input": True})
    final = await ws.final("big", timeout=30)
    assert "finish" in final, final
    assert echo_bytes(ws.outputs("big")) == samples.tobytes()


def test_large_kwargs_stay_in_the_open_message() -> None:
    """Kwargs too large for a call record or an assignment: workers read them from the open."""
    from services.conductor import core
    from shared.bus import wire

    c = core.Conductor(parse_config({}))
    hb = wire.WorkerHeartbeat(worker_id="w", model="echo", partitions=["E"], model_partitions=["E"], capacity=4, load=0, ts=0)
    c.handle(core.WorkerSeen(hb))
    big = {"blob": "k" * (core.KWARGS_INLINE_MAX + 1)}
    acts = c.handle(core.Opened(wire.Open(cid="c1", request_id="r", model="echo", frontend_id="f", model_kwargs=big), 0.0))
    assign = next(a.msg for a in acts if isinstance(a, core.SendAssign))
    record = next(a.record for a in acts if isinstance(a, core.SaveRecord))
    assert assign.kwargs_in_open and assign.model_kwargs == {}
    assert record.kwargs_in_open and record.model_kwargs == {}
    small = c.handle(core.Opened(wire.Open(cid="c2", request_id="r2", model="echo", frontend_id="f", model_kwargs={"a": 1}), 0.0))
    assert next(a.msg for a in small if isinstance(a, core.SendAssign)).model_kwargs == {"a": 1}
