"""Open storms with an ordinary client: calls already live, then many opened at once.

A frontend restart or a network blip makes clients reconnect together: hundreds of calls
opened within a tenth of a second, while others stream. The client is an ordinary one (the
`websockets` library, many calls per socket, JSON appends carrying a base64 WAV frame every
80 ms, as docs/clients.md shows them), not the tuned client of bench/live_load.py.

    .venv/bin/python -m bench.open_storm --live 50 --storm 200 --rounds 3
    .venv/bin/python -m bench.open_storm --baseline HEAD~3 --rounds 3   # before/after, interleaved

Each round starts a stack (`duplexbus up`, echo), opens `--live` calls over 2 s, then opens
`--storm` calls, in one of two ways on the same stack: a storm (all within `--window`, 0.1 s)
and a ramp (over 2 s, the reference). Every call then streams for `--seconds`. Reported, per
way: the lag p99 over all frames from the storm's first opening on (sending frame k to
receiving echo's output k), the live calls' own p99 over the storm's first two seconds (are
they stalled?), the storm calls' first output (open to output 0), and each call's end: admitted
(its finish), refused per the rules (503 past `max_concurrent_requests`, with `--cap`), or
anything else (a failure of the benchmark). With `--baseline REV` (a git revision, checked
out in a temporary worktree as bench/ordinary_load.py does), each round runs that code and
this tree's, in alternating order, so a change shows as a ratio under the same load; the
load average is printed with every figure, as the machine is shared. (bench/ordinary_load.py
opens every call in its storm; this one opens a storm on top of calls already streaming, and
checks how each call ended.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from bench.machine import machine
from bench.ordinary_load import describe, known_keys, worktree
from models.echo import FRAME, SAMPLE_RATE
from shared.runtime.stats import percentile
from shared.sdk.audio import encode_wav
from tests.support.stack import UpStack

PERIOD = 0.08
RAMP_S = 2.0  # the live calls' arrival, and the reference way of opening the storm's calls
SETTLE_S = 2.0  # after the live calls' ramp, before the storm: they are all streaming
STALL_S = 2.0  # the live calls' lag over this long from the storm's start: the stall, if any
ALLOWED_REFUSALS = {503}  # max_concurrent_requests: a live call past it is refused at once


@dataclass
class Call:
    rid: str
    start: float  # when its opening is due (loop time)
    live: bool  # opened before the storm
    sent: list[float] = field(default_factory=list)  # time.monotonic() of each append sent
    lags: list[tuple[float, float]] = field(default_factory=list)  # (sent at, lag s) of each output
    end: dict[str, Any] | None = None  # its finish or its error
    refused: asyncio.Event = field(default_factory=asyncio.Event)


def wav_frame() -> str:
    """One 80 ms frame as a client sends it: a WAV file, base64 (a quiet tone, not silence)."""
    t = np.arange(FRAME) / SAMPLE_RATE
    samples = (3000 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    return base64.b64encode(encode_wav(samples, SAMPLE_RATE)).decode()


async def run_socket(url: str, calls: list[Call], seconds: float, data: str) -> None:
    """One client socket carrying `calls`, each opened at its start and appending every 80 ms
    for `seconds`, then ending its input; replies are read as they come. The socket connects
    just before its first call opens: a client reconnecting in a storm connects anew."""
    if not calls:
        return
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, min(c.start for c in calls) - loop.time()))
    by_rid = {c.rid: c for c in calls}
    finals = asyncio.Event()
    left = len(calls)
    async with websockets.connect(url, max_size=None, max_queue=None, ping_interval=None) as ws:

        async def reader() -> None:
            nonlocal left
            async for raw in ws:
                now = time.monotonic()
                m = json.loads(raw)
                c = by_rid.get(m.get("request_id") or "")
                if c is None:
                    continue
                if "output" in m:
                    k = m["output"].get("frame", -1)
                    if 0 <= k < len(c.sent):
                        c.lags.append((c.sent[k], now - c.sent[k]))
                elif ("finish" in m or "error" in m) and not m.get("append") and c.end is None:
                    c.end = m
                    if "error" in m:
                        c.refused.set()
                    left -= 1
                    if not left:
                        finals.set()

        async def call(c: Call) -> None:
            await asyncio.sleep(max(0.0, c.start - loop.time()))
            t0 = loop.time()
            await ws.send(json.dumps({"request_id": c.rid}))
            k = 0
            while loop.time() - t0 < seconds and not c.refused.is_set():
                c.sent.append(time.monotonic())
                await ws.send(json.dumps({"request_id": c.rid, "append": [{"name": "f.wav", "data": data}]}))
                k += 1
                await asyncio.sleep(max(0.0, t0 + k * PERIOD - loop.time()))
            if not c.refused.is_set():
                await ws.send(json.dumps({"request_id": c.rid, "end_input": True}))

        read = asyncio.create_task(reader())
        try:
            await asyncio.gather(*(call(c) for c in calls))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finals.wait(), 30)
        finally:
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await read


def p(xs: list[float], q: float) -> float | None:
    return percentile([x * 1000 for x in xs], q)


async def measure(stack: UpStack, way: str, live: int, storm: int, window: float, seconds: float, sockets: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    tag = f"{way}{int(time.monotonic() * 1000) % 1_000_000}"
    now = loop.time()
    live_calls = [Call(f"{tag}-l{i}", now + random.random() * RAMP_S, True) for i in range(live)]
    storm_at = now + RAMP_S + SETTLE_S
    spread = window if way == "storm" else RAMP_S
    storm_calls = [Call(f"{tag}-s{i}", storm_at + spread * i / max(1, storm - 1), False) for i in range(storm)]
    # The live calls stream until the storm's calls are done, so every frame is under load.
    live_s = RAMP_S + SETTLE_S + spread + seconds
    per_socket: list[list[Call]] = [[] for _ in range(sockets)]
    for i, c in enumerate(live_calls + storm_calls):
        per_socket[i % sockets].append(c)
    load0 = os.getloadavg()[0]
    cpu0, t0 = stack.cpu_seconds(), time.monotonic()
    data = wav_frame()
    url = stack.ws_url()
    await asyncio.gather(
        *(run_socket(url, [c for c in cs if c.live], live_s, data) for cs in per_socket),
        *(run_socket(url, [c for c in cs if not c.live], seconds, data) for cs in per_socket),
    )
    cpu1, wall = stack.cpu_seconds(), time.monotonic() - t0
    storm_mono = time.monotonic() - (loop.time() - storm_at)  # the storm's start on the monotonic clock
    everything = [lag for c in live_calls + storm_calls for sent, lag in c.lags if sent >= storm_mono]
    stalled = [lag for c in live_calls for sent, lag in c.lags if storm_mono <= sent < storm_mono + STALL_S]
    first = [c.lags[0][1] for c in storm_calls if c.lags and c.lags[0][0] == c.sent[0]]
    ends: dict[str, int] = {}
    for c in live_calls + storm_calls:
        if c.end is None:
            key = "no end"
        elif "finish" in c.end:
            key = "admitted"
        elif c.end.get("status") in ALLOWED_REFUSALS:
            key = f"refused {c.end['status']}"
        else:
            key = f"error {c.end.get('status')}: {c.end.get('error')}"
        ends[key] = ends.get(key, 0) + 1
    return {
        "way": way,
        "load_avg": round(max(load0, os.getloadavg()[0]), 2),
        "frames": len(everything),
        "lag_p50_ms": p(everything, 50),
        "lag_p99_ms": p(everything, 99),
        "live_p99_during_ms": p(stalled, 99),
        "first_output_p50_ms": p(first, 50),
        "first_output_p99_ms": p(first, 99),
        "ends": ends,
        "cpu_percent": {k: round(100 * (v - cpu0.get(k, 0.0)) / wall) for k, v in cpu1.items()},
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def start_stack(code: Path | None, cfg: dict[str, Any]) -> UpStack:
    """`duplexbus up` running the code in `code` (None: this checkout's)."""
    return UpStack("echo", config=known_keys(cfg, code), source=code)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=50, help="calls streaming before the storm")
    ap.add_argument("--storm", type=int, default=200, help="calls opened in the storm")
    ap.add_argument("--window", type=float, default=0.1, help="seconds within which the storm's calls open")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each storm call streams")
    ap.add_argument("--sockets", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ways", default="storm,ramp", help="storm, ramp or both")
    ap.add_argument("--cap", type=int, help="max_concurrent_requests (default: room for every call)")
    ap.add_argument("--baseline", help="a git revision, run beside this tree round by round")
    ap.add_argument("--nice", type=int, default=0, help="the client's niceness once a stack is up (0: same priority)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    total = args.live + args.storm
    cap = args.cap or total + 10
    cfg = {
        "max_concurrent_requests": cap,
        "worker_slots": total + 10,
        "max_calls_per_socket": total,
        "max_calls_per_token": total,
    }
    with contextlib.ExitStack() as trees:
        versions: list[tuple[str, Path | None]] = [("this", None)]
        if args.baseline is not None:
            versions.insert(0, ("baseline", trees.enter_context(worktree(args.baseline))))
            print(f"baseline: {describe(args.baseline)}")
        results = await run_rounds(args, cfg, versions)
    report(args, results)


async def run_rounds(
    args: argparse.Namespace, cfg: dict[str, Any], versions: list[tuple[str, Path | None]]
) -> list[dict[str, Any]]:
    print(f"machine: {machine()}")
    print(
        f"{args.live} live calls, {args.storm} opened in a storm ({args.window:g} s) or a ramp ({RAMP_S:g} s), "
        f"{args.sockets} sockets, each call {args.seconds:g} s"
    )
    print(
        "| round | code | way | load avg | frames | lag p50 ms | lag p99 ms | live calls' p99 in the storm ms "
        "| first output p50 / p99 ms | ends |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    niced = False
    results = []
    for r in range(args.rounds):
        order = versions if r % 2 == 0 else versions[::-1]
        for name, code in order:
            stack = await asyncio.to_thread(start_stack, code, cfg)
            try:
                if not niced:
                    os.nice(args.nice)  # after the first stack: the services keep the normal priority
                    niced = True
                for way in args.ways.split(","):
                    res = await measure(stack, way, args.live, args.storm, args.window, args.seconds, args.sockets)
                    res.update(round=r, code=name)
                    results.append(res)
                    ends = ", ".join(f"{k} {v}" for k, v in sorted(res["ends"].items()))
                    print(
                        f"| {r} | {name} | {way} | {res['load_avg']} | {res['frames']} | {fmt(res['lag_p50_ms'])} "
                        f"| {fmt(res['lag_p99_ms'])} | {fmt(res['live_p99_during_ms'])} "
                        f"| {fmt(res['first_output_p50_ms'])} / {fmt(res['first_output_p99_ms'])} | {ends} |",
                        flush=True,
                    )
            finally:
                await asyncio.to_thread(stack.close)
    return results


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    if args.baseline is not None:
        for way in args.ways.split(","):
            for key in ("lag_p99_ms", "live_p99_during_ms", "first_output_p99_ms"):
                ratios = []
                for r in range(args.rounds):
                    b = next(x for x in results if x["round"] == r and x["code"] == "baseline" and x["way"] == way)
                    t = next(x for x in results if x["round"] == r and x["code"] == "this" and x["way"] == way)
                    if b[key] and t[key]:
                        ratios.append(t[key] / b[key])
                print(f"{way}: {key} this/baseline by round: " + ", ".join(f"{x:.2f}" for x in ratios))
    print("CPU, % of one core, over each measurement:")
    for res in results:
        cpu = res["cpu_percent"]
        print(f"  round {res['round']} {res['code']} {res['way']}: " + ", ".join(f"{k} {v}%" for k, v in sorted(cpu.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
