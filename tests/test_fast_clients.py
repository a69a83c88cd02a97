"""Clients that send faster than the model steps (issue: flow control from the stream).

A one-shot file, a `duplexbus call --fast`, an upload: the worker takes the call's input
at its own pace and reads the rest from the stream, so the call completes with every
output, and the worker's memory stays bounded however fast the clients send.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from clients.call import stream_call
from models.echo import FRAME
from tests.support.audio import echo_bytes, padded
from tests.support.bus import worker_stats
from tests.support.client import post_one_shot
from tests.support.stack import PeakRSS, Stack, running_stack

RATE = 16_000


def recording(seconds: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-32768, 32767, int(seconds * RATE), dtype=np.int64).astype("<i2")


# The workers step at most every 40 ms here (64 frames of a call per step), so they fall behind
# a client sending as fast as it can, as a real model does; and they may hold little input.
# liveness_s is the test stacks' 3 s: twenty uploads at once must not make the frontend miss it.
CONFIG = {"model": "echo", "step_window_ms": 40, "worker_call_buffer_mb": 1, "worker_buffer_mb": 4}


@pytest.fixture(scope="module", params=["two-workers", "one-worker"])
async def stack(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """Each partition in a worker of its own (the frames edge crosses the bus), or both in one
    (frames are handed over in the process, except while the call is paused)."""
    workers: list[list[str] | None] = [["Encoder"], ["Talker"]] if request.param == "two-workers" else [None]
    async with running_stack(nats_url, CONFIG, workers=workers) as s:
        yield s


def worker_pids(stack: Stack) -> list[int]:
    return [p.p.pid for name, p in stack.procs.items() if name.startswith("worker")]


async def pauses(stack: Stack) -> int:
    """Partitions of calls the workers paused so far (their live input left in the stream for want of room)."""
    return sum(w["pauses"] for w in await worker_stats(stack.nats_url))


async def test_one_shot_post_of_six_minutes_completes_byte_exact(stack: Stack) -> None:
    """Before, 400 stream_buffer: the worker held the call's input until it overflowed."""
    x = recording(6 * 60, seed=1)
    before = await pauses(stack)
    lines = await post_one_shot(stack.http_url(), x)
    assert "finish" in lines[-1], lines[-1]
    assert lines[-1]["finish"]["usage"]["frames"] == len(lines) - 1 == len(x) // FRAME
    assert echo_bytes([m["output"] for m in lines[:-1]]) == padded(x)
    assert await pauses(stack) > before  # the input waited in the stream


async def test_fast_live_call_of_ten_minutes_completes_byte_exact(stack: Stack) -> None:
    """`duplexbus call --fast` with a 10-minute recording."""
    x = recording(10 * 60, seed=2)
    before = await pauses(stack)
    result = await stream_call(stack.ws_url(), x, RATE, fast=True)
    assert result["final"] is not None and "finish" in result["final"], result["final"]
    assert not result["append_errors"]
    assert echo_bytes(result["outputs"]) == padded(x)
    assert await pauses(stack) > before


# Each worker may hold 4 MiB of input, one partition of a call 1 MiB (CONFIG); beside it a
# worker reads at most 64 messages at once per call (READ_BATCH), and Python's own heap
# grows some under load.
RSS_GROWTH_MB = 45


async def test_twenty_fast_calls_at_once_complete_and_the_workers_stay_bounded(stack: Stack) -> None:
    """20 calls sent as fast as possible at once, against 4 MiB a worker may hold: of 10 minutes
    each (384 MB of input) where the partitions are in workers of their own; of 3 minutes
    (115 MB) where one worker has both, to keep the suite's time (the same bounds hold).
    Before, 20 x 10 minutes ended in 499 "frontend lost": the frontend handled each socket's
    256 queued appends in one go and held its loop for 2 to 3 s at a time, so its heartbeats
    came too late (now: TimeSlice); its bus connection was backed up (now: pressure.py); and
    the conductor judged it by heartbeats alone (now it asks: conductor/liveness.py). Or they
    ended in 1011 "keepalive ping timeout": a ping waited behind the upload itself (now the
    frontend and `call --fast` judge by progress). All finish in about 50 s on this machine."""
    minutes = 10 if len(worker_pids(stack)) == 2 else 3
    xs = [recording(minutes * 60, seed=10 + i) for i in range(20)]
    async with PeakRSS(worker_pids(stack)) as rss:
        results = await asyncio.gather(*(stream_call(stack.ws_url(), x, RATE, fast=True) for x in xs))
    for x, result in zip(xs, results, strict=True):
        assert result["final"] is not None and "finish" in result["final"], result["final"]
        assert echo_bytes(result["outputs"]) == padded(x)
    growth = rss.growth()
    print(f"worker RSS: idle {rss.idle} MiB, grew by at most {growth} MiB")
    assert max(growth.values()) < RSS_GROWTH_MB, growth
