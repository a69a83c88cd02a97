"""Fault tests: real processes killed with SIGKILL mid-call; the call is not lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.helpers import WS, Stack, echo_bytes, pcm_file

FRAME = 1280


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    s = Stack(nats_url, {"model": "echo", "placement_timeout_s": 20})
    yield s
    s.stop()


async def stream_frames(ws: WS, rid: str, samples: np.ndarray, start: int, stop: int) -> None:
    for k in range(start, stop):
        await ws.send({"request_id": rid, "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("victim", ["Encoder", "Talker"])
async def test_worker_killed_mid_call_is_replaced_and_the_call_completes(stack: Stack, victim: str) -> None:
    # two workers per partition: the victim's partition moves to its twin, which replays the call from the stream
    await stack.start(workers=[["Encoder"], ["Talker"], ["Encoder"], ["Talker"]])
    await stack.wait_workers(4)
    ws = await WS.connect(stack.ws_url())
    samples = (np.arange(60 * FRAME) % 30000).astype("<i2")
    await ws.send({"request_id": "survivor"})
    await stream_frames(ws, "survivor", samples, 0, 30)
    await ws.until(lambda m: "output" in m and m["output"]["frame"] >= 20, timeout=20, keep=True)
    busy = await stack.workers_of_live_calls()
    stack.procs[busy[victim]].kill()
    await stream_frames(ws, "survivor", samples, 30, 60)
    await ws.send({"request_id": "survivor", "end_input": True})
    final = await ws.final("survivor", timeout=60)
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs("survivor")
    assert [o["frame"] for o in outs] == list(range(60))  # each frame once, in order
    assert echo_bytes(outs) == samples.tobytes()
    await ws.close()


async def test_conductor_killed_mid_call_restarts_and_the_call_completes(stack: Stack) -> None:
    await stack.start(workers=[None])
    await stack.wait_workers(1)
    ws = await WS.connect(stack.ws_url())
    samples = (np.arange(40 * FRAME) % 20000).astype("<i2")
    await ws.send({"request_id": "steady"})
    await stream_frames(ws, "steady", samples, 0, 20)
    stack.procs["conductor"].kill()
    await stream_frames(ws, "steady", samples, 20, 40)  # data does not pass through the conductor
    await ws.send({"request_id": "steady", "end_input": True})  # its end-of-input waits in the stream
    await asyncio.sleep(0.5)
    stack.start_conductor()  # restores the call from KV; the durable consumer redelivers the rest
    final = await ws.final("steady", timeout=60)
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs("steady")
    assert echo_bytes(outs) == samples.tobytes()
    await ws.close()
