"""Live echo calls under load: per-frame lag and the frontend -> worker data path.

Each call appends one 80 ms frame (1280 samples) every 80 ms, in real time, and
measures the lag from sending frame k to receiving echo output k. Workers report
the data-path time (an append leaving the frontend -> the worker having it).

    .venv/bin/python -m bench.live_load --calls 1,50,200 --seconds 10
    .venv/bin/python -m bench.live_load --calls 100,200,300,400,500 --seconds 10   # capacity

Calls open at random over --ramp seconds (2 by default), as arrivals rather than one
burst; each call's first second (its opening and placement) is reported apart.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import time
from typing import Any

import numpy as np
import websockets

from bench.stack import UpStack, machine
from duplexbus.shared.stats import percentile

FRAME = 1280
PERIOD = 0.08
WARMUP_FRAMES = 12  # the first second of each call (its opening and placement) is reported apart


async def socket_calls(
    url: str, n: int, seconds: float, lags: list[float], warm: list[float], stats: dict[str, int], tag: str, ramp_s: float
) -> None:
    """n live calls on one socket, each paced at one frame per 80 ms."""
    frame = np.zeros(FRAME, dtype="<i2")
    payload = base64.b64encode(frame.tobytes()).decode()
    sent: dict[str, list[float]] = {}
    done = asyncio.Event()
    finished = 0
    finals: set[str] = set()
    async with websockets.connect(url, max_size=None, ping_interval=None, compression=None) as ws:

        async def reader() -> None:
            nonlocal finished
            async for raw in ws:
                m = json.loads(raw)
                rid = m.get("request_id")
                if "output" in m:
                    k = m["output"]["frame"]
                    t = sent[rid][k] if k < len(sent[rid]) else None
                    if t is not None:
                        (lags if k >= WARMUP_FRAMES else warm).append(time.monotonic() - t)
                elif "finish" in m or "error" in m:
                    if m.get("append"):
                        stats["append_errors"] = stats.get("append_errors", 0) + 1
                        stats.setdefault("last_error", m["error"])  # type: ignore[arg-type]
                        continue
                    finals.add(rid)
                    stats["finished" if "finish" in m else "errors"] += 1
                    if "error" in m:
                        stats.setdefault("last_error", m["error"])  # type: ignore[arg-type]
                    finished += 1
                    if finished == n:
                        done.set()

        async def one(i: int) -> None:
            rid = f"{tag}-{i}"
            sent[rid] = []
            await asyncio.sleep(random.random() * max(PERIOD, ramp_s))  # calls arrive over the ramp
            await ws.send(json.dumps({"request_id": rid}))
            t0 = time.monotonic()
            k = 0
            while time.monotonic() - t0 < seconds:
                sent[rid].append(time.monotonic())
                await ws.send(json.dumps({"request_id": rid, "append": [{"name": "f.pcm", "data": payload}]}))
                k += 1
                await asyncio.sleep(max(0.0, t0 + k * PERIOD - time.monotonic()))
            await ws.send(json.dumps({"request_id": rid, "end_input": True}))

        rd = asyncio.create_task(reader())
        await asyncio.gather(*(one(i) for i in range(n)))
        try:
            await asyncio.wait_for(done.wait(), timeout=60)
        except TimeoutError:
            stats["unfinished"] = stats.get("unfinished", 0) + n - finished
            stats.setdefault("last_error", f"no finish for {sorted(set(sent) - finals)[:5]}")  # type: ignore[arg-type]
        finally:
            rd.cancel()


async def level(stack: UpStack, calls: int, seconds: float, per_socket: int, ramp_s: float) -> dict[str, Any]:
    await stack.worker_stats(reset=True)
    lags: list[float] = []
    warm: list[float] = []
    stats = {"finished": 0, "errors": 0}
    sockets = max(1, -(-calls // per_socket))
    sizes = [calls // sockets + (1 if i < calls % sockets else 0) for i in range(sockets)]
    await asyncio.gather(
        *(socket_calls(stack.ws_url(i), n, seconds, lags, warm, stats, f"s{i}", ramp_s) for i, n in enumerate(sizes) if n)
    )
    workers = await stack.worker_stats()
    dp = [w["data_path_ms"] for w in workers if w["data_path_ms"]["n"]]
    # The data path is measured at the consuming worker of the client stream (the Encoder).
    enc = next((w for w in workers if "Encoder" in w["partitions"]), workers[0])
    lag_ms = [x * 1000 for x in lags]
    return {
        "calls": calls,
        "frames": len(lags),
        "finished": stats["finished"],
        "errors": stats["errors"] + stats.get("unfinished", 0),
        "last_error": stats.get("last_error"),
        "lag_p50_ms": percentile(lag_ms, 50),
        "lag_p99_ms": percentile(lag_ms, 99),
        "first_second_lag_p99_ms": percentile([x * 1000 for x in warm], 99),
        "data_path_p50_ms": enc["data_path_ms"]["p50"] if dp else None,
        "data_path_p99_ms": enc["data_path_ms"]["p99"] if dp else None,
        "mean_batch_talker": next(
            (w["partitions"]["Talker"]["mean_batch"] for w in workers if "Talker" in w["partitions"]), None
        ),
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="1,50,200")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--per-socket", type=int, default=25, help="calls sharing one client socket")
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds over which the calls open (arrivals, not a burst)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    levels = [int(x) for x in args.calls.split(",")]
    print(f"machine: {machine()}")
    cfg = {"max_concurrent_requests": max(levels) + 10, "worker_slots": max(levels) + 10}
    results = []
    with UpStack("echo", frontends=args.frontends, config=cfg) as stack:
        print("| live calls | frames | lag p50 ms | lag p99 ms | data path p50 ms | data path p99 ms | errors | real time |")
        print("|---|---|---|---|---|---|---|---|")
        for n in levels:
            r = await level(stack, n, args.seconds, args.per_socket, args.ramp)
            r["real_time"] = r["lag_p99_ms"] is not None and r["lag_p99_ms"] < 100 and r["errors"] == 0
            results.append(r)
            print(
                f"| {n} | {r['frames']} | {fmt(r['lag_p50_ms'])} | {fmt(r['lag_p99_ms'])} | {fmt(r['data_path_p50_ms'])} "
                f"| {fmt(r['data_path_p99_ms'])} | {r['errors']} | {'yes' if r['real_time'] else 'no'} |",
                flush=True,
            )
    for r in results:
        if r.get("last_error"):
            print(f"{r['calls']} calls: last error: {r['last_error']}")
    ok = [r["calls"] for r in results if r["real_time"]]
    print(
        "first-second lag p99 ms (opening and placement included): "
        + ", ".join(f"{r['calls']}: {fmt(r['first_second_lag_p99_ms'])}" for r in results)
    )
    print(f"most live echo calls in real time (lag p99 < 100 ms): {max(ok) if ok else 0}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
