"""Fault tests: real processes killed with SIGKILL mid-call; the call is not lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from nats.errors import Error as NatsError

from models.echo import FRAME
from shared.bus import subjects
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import call_records, connected
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    s = Stack(nats_url, {"model": "echo", "placement_timeout_s": 20})
    yield s
    s.stop()


async def end_of_input_stored(nats_url: str, rid: str) -> bool:
    """The call's end of input is in the stream (read from its record: the conductor may be down)."""
    cids = [cid for cid, r in (await call_records(nats_url)).items() if r.request_id == rid]
    if not cids:
        return False
    async with connected(nats_url) as nc:
        try:
            await nc.jetstream().get_last_msg(subjects.STREAM, subjects.eoi(cids[0], "audio_in"))
        except NatsError:  # not stored (yet)
            return False
    return True


async def stream_frames(ws: WS, rid: str, samples: np.ndarray, start: int, stop: int) -> None:
    for k in range(start, stop):
        await ws.send({"request_id": rid, "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
        await asyncio.sleep(0.01)


async def call_under_way(stack: Stack, rid: str, samples: np.ndarray, sent: int, echoed: int) -> WS:
    """A live call that has sent `sent` frames and had frame `echoed` back."""
    ws = await WS.connect(stack.ws_url())
    await ws.send({"request_id": rid})
    await stream_frames(ws, rid, samples, 0, sent)
    await ws.until(lambda m: "output" in m and m["output"]["frame"] >= echoed, timeout=20, keep=True)
    return ws


async def end_and_check_every_frame(ws: WS, stack: Stack, rid: str, samples: np.ndarray) -> None:
    """End the call's input; it finishes with every frame echoed once, in order."""
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid, timeout=60)
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs(rid)
    assert [o["frame"] for o in outs] == list(range(len(samples) // FRAME))  # each frame once, in order
    assert echo_bytes(outs) == samples.tobytes()
    await ws.close()


@pytest.mark.parametrize("victim", ["Encoder", "Talker"])
async def test_worker_killed_mid_call_is_replaced_and_the_call_completes(stack: Stack, victim: str) -> None:
    # two workers per partition: the victim's partition moves to its twin, which replays the call from the stream
    await stack.start(workers=[["Encoder"], ["Talker"], ["Encoder"], ["Talker"]])
    await stack.wait_workers(4)
    samples = (np.arange(60 * FRAME) % 30000).astype("<i2")
    ws = await call_under_way(stack, "survivor", samples, sent=30, echoed=20)
    busy = await stack.workers_of_live_calls()
    stack.procs[busy[victim]].kill()
    await stream_frames(ws, "survivor", samples, 30, 60)
    await end_and_check_every_frame(ws, stack, "survivor", samples)


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
    await until(lambda: end_of_input_stored(stack.nats_url, "steady"), 10, "the end of input in the stream")
    stack.start_conductor()  # restores the call from KV; the durable consumer redelivers the rest
    try:
        final = await ws.final("steady", timeout=60)
    except TimeoutError:
        pytest.fail(f"no finish within 60 s of the conductor's restart:\n{stack.logs()}")
    assert "finish" in final, (final, stack.logs())
    outs = ws.outputs("steady")
    assert echo_bytes(outs) == samples.tobytes()
    await ws.close()


async def test_partitions_moving_one_at_a_time_onto_one_worker(stack: Stack) -> None:
    """A call's partitions can come to one worker one at a time: the Encoder's worker dies and
    it moves to a worker that runs both partitions; then the Talker's worker dies and the
    Talker joins it there (an assignment for a call the worker already has). From then on
    the frames edge is delivered inside that process, and is still stored in the stream."""
    await stack.start(workers=[["Encoder"], ["Talker"]])
    await stack.wait_workers(2)
    samples = (np.arange(60 * FRAME) % 25000).astype("<i2")
    ws = await call_under_way(stack, "mover", samples, sent=20, echoed=15)
    stack.start_worker("worker-both")  # every partition
    await stack.wait_workers(3)
    stack.procs["worker-0"].kill()  # the Encoder's
    await stream_frames(ws, "mover", samples, 20, 40)
    await ws.until(lambda m: "output" in m and m["output"]["frame"] >= 35, timeout=30, keep=True)
    assert (await stack.workers_of_live_calls())["Encoder"] == "worker-both"
    assert (await stack.workers_of_live_calls())["Talker"] == "worker-1"
    stack.procs["worker-1"].kill()  # the Talker's
    for _ in range(100):  # until the conductor has moved it (liveness_s)
        if (await stack.workers_of_live_calls())["Talker"] == "worker-both":
            break
        await asyncio.sleep(0.1)
    await stream_frames(ws, "mover", samples, 40, 60)
    await end_and_check_every_frame(ws, stack, "mover", samples)


async def test_frontend_killed_mid_call_frees_its_call_and_request_id(nats_url: str) -> None:
    """The client of a dead frontend reconnects to another one with the same request_id:
    refused (409) while the lost call still holds it; once the conductor has seen the frontend
    stop heartbeating (liveness_s), the call is aborted, its worker slot and its request_id
    are freed, and the same request_id opens a call that runs to its end."""
    s = Stack(nats_url, {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0})
    try:
        await s.start(workers=[None], frontends=2)
        await s.wait_workers(1)
        samples = (np.arange(20 * FRAME) % 20000).astype("<i2")
        lost = await call_under_way(s, "kept", samples, sent=5, echoed=2)
        s.procs["frontend-0"].kill()
        ws = await WS.connect(s.ws_url(1))
        await ws.send({"request_id": "kept"})
        first = await ws.until(lambda m: m.get("request_id") == "kept")
        assert first.get("status") == 409, first
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            await asyncio.sleep(0.5)
            await ws.send({"request_id": "kept"})
            reply = await nothing_or_reply(ws, "kept")
            if reply is None:  # no refusal: the call is open
                break
            assert reply.get("status") == 409, reply
            assert asyncio.get_running_loop().time() < deadline, s.logs()
        assert len(await call_records(nats_url)) == 1  # the lost call's record is gone: only the new one
        await stream_frames(ws, "kept", samples, 0, 20)
        await end_and_check_every_frame(ws, s, "kept", samples)
        with contextlib.suppress(Exception):
            await lost.close()
    finally:
        s.stop()


async def nothing_or_reply(ws: WS, rid: str, seconds: float = 1.0) -> dict[str, Any] | None:
    """The reply refusing an opening, or None where none came (the call opened)."""
    try:
        return await ws.until(lambda m: m.get("request_id") == rid and "status" in m, timeout=seconds)
    except TimeoutError:
        return None
