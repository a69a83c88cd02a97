"""A worker stopped with SIGTERM keeps its calls until they end (up to `shutdown_drain_s`)
and takes no new ones; its calls are not placed again elsewhere while it still runs them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from models.echo import FRAME
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "shutdown_drain_s": 20}, workers=[None, None]) as s:
        yield s


async def test_stopping_worker_finishes_its_calls_and_takes_no_new_ones(stack: Stack, ws: WS) -> None:
    samples = (np.arange(30 * FRAME) % 20000).astype("<i2")
    await ws.send({"request_id": "stays"})
    await ws.send({"request_id": "stays", "append": [pcm_file(samples[: 10 * FRAME])]})
    await ws.until(lambda m: m.get("request_id") == "stays" and m.get("output", {}).get("frame") == 9, keep=True)
    before = await stack.workers_of_live_calls()
    victim = before["Encoder"]
    assert before == {"Encoder": victim, "Talker": victim}  # one worker runs both
    stack.procs[victim].p.terminate()  # SIGTERM: drain
    await asyncio.sleep(1.5)  # longer than a heartbeat and the conductor's reaction to one

    await ws.send({"request_id": "new", "files": [pcm_file(samples[:FRAME])], "end_input": True})
    assert "finish" in await ws.final("new")  # served, by the other worker
    for k in (10, 20):
        await ws.send({"request_id": "stays", "append": [pcm_file(samples[k * FRAME : (k + 10) * FRAME])]})
        await asyncio.sleep(0.3)
        assert await stack.workers_of_live_calls() == before  # not placed again while it runs
    await ws.send({"request_id": "stays", "end_input": True})
    final = await ws.final("stays", timeout=20)
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs("stays")
    assert [o["frame"] for o in outs] == list(range(30))  # each frame once, in order
    assert echo_bytes(outs) == samples.tobytes()
    await asyncio.to_thread(stack.procs[victim].p.wait, 15)  # it leaves once its calls are done
