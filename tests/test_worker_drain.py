"""A worker stopped with SIGTERM keeps its calls until they end (up to `shutdown_drain_s`)
and takes no new ones; its calls are not placed again elsewhere while it still runs them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from models.echo import FRAME
from shared.bus import subjects, wire
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import bucket_keys, connected
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, running_stack


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "shutdown_drain_s": 20}, workers=[None, None]) as s:
        yield s


async def takes_no_calls(stack: Stack, name: str) -> bool:
    """The worker process `name` has stored a heartbeat with no capacity (worker ids are
    worker-{pid}-{random})."""
    prefix = f"worker-{stack.procs[name].p.pid}-"
    async with connected(stack.nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
        for key in await bucket_keys(kv):
            if key.startswith(prefix):
                entry = await kv.get(key)
                return entry.value is not None and wire.decode_as(entry.value, wire.WorkerHeartbeat).capacity == 0
    return False


async def test_stopping_worker_finishes_its_calls_and_takes_no_new_ones(stack: Stack, ws: WS) -> None:
    samples = (np.arange(30 * FRAME) % 20000).astype("<i2")
    await ws.send({"request_id": "stays"})
    await ws.send({"request_id": "stays", "append": [pcm_file(samples[: 10 * FRAME])]})
    await ws.until(lambda m: m.get("request_id") == "stays" and m.get("output", {}).get("frame") == 9, keep=True)
    before = await stack.workers_of_live_calls()
    victim = before["Encoder"]
    assert before == {"Encoder": victim, "Talker": victim}  # one worker runs both
    stack.procs[victim].p.terminate()  # SIGTERM: drain
    # It says so in its heartbeat (no capacity left); a conductor that has not read that yet
    # is refused by the worker and places the call elsewhere.
    await until(lambda: takes_no_calls(stack, victim), 10, f"{victim}'s heartbeat with no capacity")

    await ws.send({"request_id": "new", "files": [pcm_file(samples[:FRAME])], "end_input": True})
    assert "finish" in await ws.final("new")  # served, by the other worker
    for k in (10, 20):
        await ws.send({"request_id": "stays", "append": [pcm_file(samples[k * FRAME : (k + 10) * FRAME])]})
        last = k + 9  # echoed: the draining worker still runs the call
        await ws.until(lambda m, n=last: m.get("request_id") == "stays" and m.get("output", {}).get("frame") == n, keep=True)
        assert await stack.workers_of_live_calls() == before  # not placed again while it runs
    await ws.send({"request_id": "stays", "end_input": True})
    final = await ws.final("stays", timeout=20)
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs("stays")
    assert [o["frame"] for o in outs] == list(range(30))  # each frame once, in order
    assert echo_bytes(outs) == samples.tobytes()
    await asyncio.to_thread(stack.procs[victim].p.wait, 15)  # it leaves once its calls are done
