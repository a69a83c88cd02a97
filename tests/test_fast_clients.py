"""Clients that send faster than the model steps (issue: flow control from the stream).

A one-shot file, a `duplexbus call --fast`, an upload: the worker takes the call's input
at its own pace and reads the rest from the stream, so the call completes with every
output, and the worker's memory stays bounded however fast the clients send.
Each partition of echo runs in its own worker, so the frames edge crosses the bus too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from clients.call import stream_call
from models.echo import FRAME
from shared.sdk.audio import b64_pcm16
from tests.helpers import Stack, echo_bytes, padded, running_stack

RATE = 16_000


def recording(seconds: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-32768, 32767, int(seconds * RATE), dtype=np.int64).astype("<i2")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRSS:
    """The largest resident set of some processes, sampled every 50 ms while in use."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0.0)
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for pid in self.pids:
                self.peak[pid] = max(self.peak[pid], rss_mb(pid))
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> PeakRSS:
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "step_window_ms": 40, "liveness_s": 15}, workers=[["Encoder"], ["Talker"]]) as s:
        yield s


def worker_pids(stack: Stack) -> list[int]:
    return [p.p.pid for name, p in stack.procs.items() if name.startswith("worker")]


async def test_one_shot_post_of_six_minutes_completes_byte_exact(stack: Stack) -> None:
    x = recording(6 * 60, seed=1)
    body = json.dumps({"files": [{"name": "a.pcm", "data": b64_pcm16(x)}]})
    t0 = time.monotonic()
    lines = []
    async with PeakRSS(worker_pids(stack)) as rss, httpx.AsyncClient(base_url=stack.http_url(), timeout=300) as client:
        async with client.stream("POST", "/generate", content=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    lines.append(json.loads(line))
    print(f"6 min one-shot: {time.monotonic() - t0:.1f}s, peak worker RSS {rss.peak}")
    assert "finish" in lines[-1], lines[-1]
    assert lines[-1]["finish"]["usage"]["frames"] == len(lines) - 1 == len(x) // FRAME
    assert echo_bytes([m["output"] for m in lines[:-1]]) == padded(x)


async def test_fast_live_call_of_ten_minutes_completes_byte_exact(stack: Stack) -> None:
    x = recording(10 * 60, seed=2)
    t0 = time.monotonic()
    async with PeakRSS(worker_pids(stack)) as rss:
        result = await stream_call(stack.ws_url(), x, RATE, fast=True)
    print(f"10 min --fast: {time.monotonic() - t0:.1f}s, peak worker RSS {rss.peak}")
    assert result["final"] is not None and "finish" in result["final"], result["final"]
    assert not result["append_errors"]
    assert echo_bytes(result["outputs"]) == padded(x)


async def test_twenty_fast_calls_at_once_complete_and_the_workers_stay_bounded(stack: Stack) -> None:
    xs = [recording(600, seed=10 + i) for i in range(20)]
    t0 = time.monotonic()
    async with PeakRSS(worker_pids(stack)) as rss:
        results = await asyncio.gather(*(stream_call(stack.ws_url(), x, RATE, fast=True) for x in xs))
    print(f"20 x 1 min --fast: {time.monotonic() - t0:.1f}s, peak worker RSS {rss.peak}")
    for x, result in zip(xs, results, strict=True):
        assert result["final"] is not None and "finish" in result["final"], result["final"]
        assert echo_bytes(result["outputs"]) == padded(x)
