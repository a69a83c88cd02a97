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
import heapq
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import numpy as np

from bench.machine import machine
from models.echo import FRAME
from shared.runtime.stats import percentile
from shared.sdk.audio import b64_pcm16
from tests.support.stack import UpStack

PERIOD = 0.08
WARMUP_FRAMES = 12  # the first second of each call (its opening and placement) is reported apart


TICK = 0.005  # a socket's due appends are written together, at most this late


def ws_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """A client WebSocket frame with a zero mask key (the payload goes as it is): the load
    client builds each call's append once and writes it again and again."""
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class _Frame(msgspec.Struct):
    frame: int = -1


class _Reply(msgspec.Struct):
    """What the load client reads of a server message; the rest (the audio) is skipped unread."""

    request_id: str | None = None
    output: _Frame | None = None
    finish: dict[str, Any] | None = None
    error: str | None = None
    append: bool | None = None


class LoadSocket(asyncio.Protocol):
    """A bare WebSocket client: a client of a serving system should cost the machine under
    test as little as possible, and the `websockets` client costs about as much per message
    as the frontend does. Server frames are parsed by hand; pings are answered."""

    def __init__(self, on_text: Callable[[bytes], None]) -> None:
        self.on_text = on_text
        self.buf = bytearray()
        self.open: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's is a full Transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.open.done():
            self.open.set_exception(ConnectionError(f"closed during the handshake: {exc}"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.open.done():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(self.buf[:end]).split(b"\r\n", 1)[0]
            del self.buf[: end + 4]
            if b" 101 " not in status:
                self.open.set_exception(ConnectionError(status.decode(errors="replace")))
                return
            self.open.set_result(None)
        self._frames()

    def _frames(self) -> None:
        buf, at = self.buf, 0
        while len(buf) - at >= 2:
            opcode, n = buf[at] & 0x0F, buf[at + 1] & 0x7F
            head = 2
            if n == 126:
                n, head = int.from_bytes(buf[at + 2 : at + 4], "big"), 4
            elif n == 127:
                n, head = int.from_bytes(buf[at + 2 : at + 10], "big"), 10
            if len(buf) - at < head + n:
                break
            payload = bytes(buf[at + head : at + head + n])
            at += head + n
            if opcode == 0x1:
                self.on_text(payload)
            elif opcode == 0x9 and self.transport is not None:
                self.transport.write(ws_frame(payload, 0xA))
            elif opcode == 0x8 and self.transport is not None:
                self.transport.close()
        del buf[:at]


async def socket_calls(
    host: str,
    port: int,
    n: int,
    seconds: float,
    lags: list[float],
    warm: list[float],
    stats: dict[str, Any],
    tag: str,
    ramp_s: float,
    start_at: float | None = None,
    record: Callable[[str, int, float, float], None] | None = None,
) -> None:
    """n live calls on one socket, each paced at one frame per 80 ms. The calls open at random
    over `ramp_s` from `start_at` (loop time; None: once the socket is open). `record` is told
    of each output: (request_id, frame, when its append was sent, lag), both in seconds."""
    loop = asyncio.get_running_loop()
    decoder = msgspec.json.Decoder(_Reply)
    frame = b64_pcm16(np.zeros(FRAME, dtype="<i2"))
    rids = [f"{tag}-{i}" for i in range(n)]
    sent: dict[str, list[float]] = {rid: [] for rid in rids}
    done = asyncio.Event()
    finals: set[str] = set()

    def on_text(payload: bytes) -> None:
        m = decoder.decode(payload)
        rid = m.request_id or ""
        if m.output is not None:
            k, times = m.output.frame, sent.get(rid, [])
            if 0 <= k < len(times):
                lag = time.monotonic() - times[k]
                (lags if k >= WARMUP_FRAMES else warm).append(lag)
                if record is not None:
                    record(rid, k, times[k], lag)
        elif m.error is not None and m.append:
            stats["append_errors"] = stats.get("append_errors", 0) + 1
            stats.setdefault("last_error", m.error)
        elif m.finish is not None or m.error is not None:
            finals.add(rid)
            stats["finished" if m.finish is not None else "errors"] += 1
            if m.error is not None:
                stats.setdefault("last_error", m.error)
            if len(finals) == n:
                done.set()

    transport, proto = await loop.create_connection(lambda: LoadSocket(on_text), host, port)
    key = base64.b64encode(random.randbytes(16)).decode()
    transport.write(
        f"GET /generate/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    await proto.open
    opening = {rid: ws_frame(json.dumps({"request_id": rid}).encode()) for rid in rids}
    append = {
        rid: ws_frame(json.dumps({"request_id": rid, "append": [{"name": "f.pcm", "data": frame}]}).encode()) for rid in rids
    }
    end = {rid: ws_frame(json.dumps({"request_id": rid, "end_input": True}).encode()) for rid in rids}
    now = loop.time() if start_at is None else start_at
    # (when, rid) of each call's next message, earliest first: a tick pops only what is due.
    due = [(now + random.random() * max(PERIOD, ramp_s), rid) for rid in rids]  # calls arrive over the ramp
    heapq.heapify(due)
    t0: dict[str, float] = {}
    try:
        while due:
            now = loop.time()
            out: list[bytes] = []
            while due and due[0][0] <= now:
                _, rid = heapq.heappop(due)
                if rid not in t0:
                    t0[rid] = now
                    out.append(opening[rid])
                k = len(sent[rid])
                if now - t0[rid] < seconds:
                    out.append(append[rid])
                    sent[rid].append(time.monotonic())  # not loop.time(): uvloop's clock ticks in whole ms
                    heapq.heappush(due, (t0[rid] + (k + 1) * PERIOD, rid))
                else:
                    out.append(end[rid])
            if out:
                transport.write(b"".join(out))
            await asyncio.sleep(TICK)
        try:
            await asyncio.wait_for(done.wait(), timeout=60)
        except TimeoutError:
            stats["unfinished"] = stats.get("unfinished", 0) + n - len(finals)
            stats.setdefault("last_error", f"no finish for {sorted(set(rids) - finals)[:5]}")
    finally:
        transport.close()


async def level(stack: UpStack, calls: int, seconds: float, per_socket: int, ramp_s: float) -> dict[str, Any]:
    await stack.worker_stats(reset=True)
    cpu0, t0 = stack.cpu_seconds(), time.monotonic()
    lags: list[float] = []
    warm: list[float] = []
    stats: dict[str, Any] = {"finished": 0, "errors": 0}
    sockets = max(1, -(-calls // per_socket))
    sizes = [calls // sockets + (1 if i < calls % sockets else 0) for i in range(sockets)]
    # Every frontend serves on stack.port: the kernel spreads the sockets over them. Request ids
    # differ from one level to the next: the last level's may not all be freed yet (409).
    tag = f"{calls}-{int(time.monotonic() * 1000) % 100000}"
    await asyncio.gather(
        *(
            socket_calls("127.0.0.1", stack.port, n, seconds, lags, warm, stats, f"{tag}s{i}", ramp_s)
            for i, n in enumerate(sizes)
            if n
        )
    )
    cpu1, wall = stack.cpu_seconds(), time.monotonic() - t0
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
        "cpu_percent": {k: round(100 * (v - cpu0.get(k, 0.0)) / wall) for k, v in cpu1.items()},
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
    ap.add_argument("--workers", type=int, default=1, help="workers per partition (with --colocate: worker processes)")
    ap.add_argument("--colocate", action="store_true", help="each worker process runs both partitions (up --colocate)")
    ap.add_argument("--step-window-ms", type=float, help="the workers' step_window_ms (the config default otherwise)")
    ap.add_argument(
        "--nice",
        type=int,
        default=10,
        help="the load client's niceness once the services are up: it shares the machine with the server under test, "
        "and its wakeups should not delay the server's (0: same priority)",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    levels = [int(x) for x in args.calls.split(",")]
    print(f"machine: {machine()}")
    cfg: dict[str, Any] = {"max_concurrent_requests": max(levels) + 10, "worker_slots": max(levels) + 10}
    if args.step_window_ms is not None:
        cfg["step_window_ms"] = args.step_window_ms
    results = []
    with UpStack("echo", frontends=args.frontends, workers=args.workers, config=cfg, colocate=args.colocate) as stack:
        os.nice(args.nice)  # the services were started before: they keep the normal priority
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
    print("CPU, % of one core, over each level (the machine has " + f"{os.cpu_count()}" + " cores):")
    for r in results:
        cpu = r["cpu_percent"]
        print(f"  {r['calls']} calls: total {sum(cpu.values())}%; " + ", ".join(f"{k} {v}%" for k, v in sorted(cpu.items())))
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
