"""The realtime adapter's cost: live `echo` sessions over `WS /v1/realtime` at 24 kHz, in real
time, beside the same count of live calls over `WS /generate/ws` at echo's 16 kHz.

    .venv/bin/python -m bench.realtime_load --sessions 20 --seconds 10

Both on one `duplexbus up --model echo`, one after the other. Each session sends one 80 ms
piece of audio every 80 ms:
- `/generate/ws`: an append of 1280 samples; lag = the append to echo's output frame k.
- `/v1/realtime`: `input_audio_buffer.append` of 1920 samples at 24 kHz then `commit`
  (manual turns: every 80 ms piece is one response, the adapter's worst case: resampled
  both ways, about 12 events per piece, each also stored in the stream for resume);
  lag = the commit to that response's `response.done`.
The adapter's cost is the frontend's CPU per session-second over `/v1/realtime` divided by
the same over `/generate/ws`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import websockets

from bench.machine import machine
from shared.runtime.stats import percentile
from shared.sdk.audio import b64_pcm16
from tests.support.stack import UpStack

PERIOD = 0.08
WARMUP = 12  # the first second of each session (opening, placement) is left out


class _Event(msgspec.Struct):
    type: str | None = None
    request_id: str | None = None
    output: dict[str, Any] | None = None


_decode = msgspec.json.Decoder(_Event).decode


def _tone(n: int, rate: int) -> np.ndarray:
    return (8000 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.int16)


async def paced(ws: Any, seconds: float, messages: list[str], answer: Callable[[_Event], int | None], lags: list[float]) -> None:
    """Send `messages` every 80 ms in real time; `answer` says which piece (k) a server
    message answers (None: none), and the lag of each piece past the warm-up is kept."""
    n = round(seconds / PERIOD)
    sent: list[float] = []

    async def reader() -> None:
        got = 0
        while got < n:
            k = answer(_decode(await ws.recv()))
            if k is not None:
                if k >= WARMUP:
                    lags.append(time.monotonic() - sent[k])
                got += 1

    task = asyncio.create_task(reader())
    t0 = time.monotonic()
    for k in range(n):
        await asyncio.sleep(max(0.0, t0 + k * PERIOD - time.monotonic()))
        sent.append(time.monotonic())
        for m in messages:
            await ws.send(m)
    await asyncio.wait_for(task, 30)


async def generate_session(url: str, i: int, seconds: float, lags: list[float]) -> None:
    rid = f"g{i}"
    frame = json.dumps({"request_id": rid, "append": [{"name": "a.pcm", "data": b64_pcm16(_tone(1280, 16000))}]})
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"request_id": rid, "model": "echo"}))
        await paced(ws, seconds, [frame], lambda m: None if m.output is None else int(m.output["frame"]), lags)
        await ws.send(json.dumps({"request_id": rid, "end_input": True}))


async def realtime_session(url: str, seconds: float, lags: list[float]) -> None:
    append = json.dumps({"type": "input_audio_buffer.append", "audio": b64_pcm16(_tone(1920, 24000))})
    commit = json.dumps({"type": "input_audio_buffer.commit"})
    fmt = {"type": "audio/pcm", "rate": 24000}
    update = {
        "type": "session.update",
        "session": {"type": "realtime", "audio": {"input": {"format": fmt, "turn_detection": None}}},
    }
    done = 0

    def answer(m: _Event) -> int | None:
        nonlocal done
        if m.type != "response.done":
            return None
        done += 1
        return done - 1

    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps(update))
        await paced(ws, seconds, [append, commit], answer, lags)
        await ws.send(json.dumps({"type": "session.close"}))


async def level(stack: UpStack, path: str, sessions: int, seconds: float) -> dict[str, Any]:
    lags: list[float] = []
    port = stack.port
    cpu0, t0 = stack.cpu_seconds(), time.monotonic()
    if path == "generate":
        url = f"ws://127.0.0.1:{port}/generate/ws"
        jobs = [generate_session(url, i, seconds, lags) for i in range(sessions)]
    else:
        url = f"ws://127.0.0.1:{port}/v1/realtime?model=echo"
        jobs = [realtime_session(url, seconds, lags) for _ in range(sessions)]
    await asyncio.gather(*jobs)
    cpu1, wall = stack.cpu_seconds(), time.monotonic() - t0
    cpu = {k: 100 * (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / wall for k in cpu1}
    expected = sessions * (round(seconds / PERIOD) - WARMUP)
    return {
        "path": path,
        "sessions": sessions,
        "pieces": len(lags),
        "expected": expected,
        "lag_p50_ms": 1000 * (percentile(lags, 50) or 0.0),
        "lag_p99_ms": 1000 * (percentile(lags, 99) or 0.0),
        "frontend_cpu_pct": cpu.get("frontend", 0.0),
        "workers_cpu_pct": sum(v for k, v in cpu.items() if k.startswith("worker")),
        "nats_cpu_pct": cpu.get("nats-server", 0.0),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    print(machine())
    with UpStack("echo") as stack:
        rows = [asyncio.run(level(stack, p, args.sessions, args.seconds)) for p in ("generate", "realtime")]
    print("| path | sessions | pieces | lag p50 ms | lag p99 ms | frontend CPU % | workers CPU % | nats-server CPU % |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['sessions']} | {r['pieces']}/{r['expected']} | {r['lag_p50_ms']:.1f} | {r['lag_p99_ms']:.1f}"
            f" | {r['frontend_cpu_pct']:.0f} | {r['workers_cpu_pct']:.0f} | {r['nats_cpu_pct']:.0f} |"
        )
    g, r = rows
    print(f"adapter cost (frontend CPU, realtime / generate): {r['frontend_cpu_pct'] / max(g['frontend_cpu_pct'], 1e-9):.2f}x")
    print(f"lag p50 ratio (realtime / generate): {r['lag_p50_ms'] / max(g['lag_p50_ms'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
