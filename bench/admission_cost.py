"""What admitting a call costs, process by process, and the bus operations behind it.

1. `--calls N` (200) calls opened at once on an idle stack (`duplexbus up`, echo; each call
   an opening and one append, on 20 sockets of the `websockets` library), until every call's
   first output; then each call's input ended, until every finish. Printed: the time to the
   last first output, and the CPU seconds each process of the stack spent per call on the
   opening and on the ending (from /proc, so the machine's other load does not count, though
   it stretches the times). With `--baseline REV`, the same on a stack of REV's code, the two
   alternating round by round (`--rounds`).
2. `--ops`: the bus operations of one call's admission, in one process on a nats-server of
   its own: a stored publish through nats-py's JetStream publish and through
   `shared/bus/acks.py`; a catch-up read of a call's input (its four subjects, three items
   stored) through an ephemeral consumer and through direct gets up to a bound
   (`shared/bus/direct.py`); a direct get of a wildcard filter (`call.{cid}.*.audio_in`) and of
   a subject named; 400 of each at once, on a stream of 3200 messages: the client's CPU per
   operation and the server's, best of `--rounds`.

    .venv/bin/python -m bench.admission_cost --calls 200 --rounds 2 --baseline b1f9182
    .venv/bin/python -m bench.admission_cost --ops
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import websockets

from bench.machine import machine
from bench.open_storm import start_stack, wav_frame
from bench.ordinary_load import describe, worktree
from shared.bus import subjects
from shared.bus.connection import BusConnection
from shared.bus.direct import DirectReads
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config
from tests.support.stack import UpStack

SOCKETS = 20


async def burst(stack: UpStack, n: int, tag: str, data: str) -> dict[str, Any]:
    """n calls opened at once; CPU per call of the opening (to the last first output) and of
    the ending (to the last finish), per process, in ms."""
    url = stack.ws_url()
    socks = [await websockets.connect(url, max_size=None, max_queue=None, ping_interval=None) for _ in range(SOCKETS)]
    ids = [[f"{tag}-{i}" for i in range(k, n, SOCKETS)] for k in range(SOCKETS)]
    first: dict[str, float] = {}
    finished: set[str] = set()
    all_first, all_done = asyncio.Event(), asyncio.Event()
    errors: list[str] = []

    async def read(ws: websockets.ClientConnection) -> None:
        async for raw in ws:
            m = json.loads(raw)
            rid = m.get("request_id")
            if "output" in m and rid not in first:
                first[rid] = time.monotonic()
                if len(first) == n:
                    all_first.set()
            elif "finish" in m or ("error" in m and not m.get("append")):
                if "error" in m:
                    errors.append(str(m.get("error")))
                finished.add(rid)
                if len(finished) == n:
                    all_done.set()
                    return

    readers = [asyncio.create_task(read(ws)) for ws in socks]
    try:
        cpu0, t0 = stack.cpu_seconds(), time.monotonic()
        for ws, rids in zip(socks, ids, strict=True):
            for rid in rids:
                await ws.send(json.dumps({"request_id": rid}))
                await ws.send(json.dumps({"request_id": rid, "append": [{"name": "f.wav", "data": data}]}))
        await asyncio.wait_for(all_first.wait(), 60)
        opened_s = time.monotonic() - t0
        await asyncio.sleep(0.3)  # what the opening left under way
        cpu1 = stack.cpu_seconds()
        for ws, rids in zip(socks, ids, strict=True):
            for rid in rids:
                await ws.send(json.dumps({"request_id": rid, "end_input": True}))
        await asyncio.wait_for(all_done.wait(), 60)
        await asyncio.sleep(0.3)
        cpu2 = stack.cpu_seconds()
    finally:
        for t in readers:
            t.cancel()
        for ws in socks:
            await ws.close()

    def per_call(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: round(1000 * (v - a.get(k, 0.0)) / n, 2) for k, v in b.items() if k not in ("up", "load client")}

    return {"opened_ms": round(1000 * opened_s), "open": per_call(cpu0, cpu1), "end": per_call(cpu1, cpu2), "errors": errors}


async def stacks(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}")
    n = args.calls
    cfg = {"max_concurrent_requests": n + 30, "worker_slots": n + 30, "max_calls_per_socket": n, "max_calls_per_token": n}
    with contextlib.ExitStack() as trees:
        versions: list[tuple[str, Path | None]] = [("this", None)]
        if args.baseline:
            versions.insert(0, ("baseline", trees.enter_context(worktree(args.baseline))))
            print(f"baseline: {describe(args.baseline)}")
        print(f"{n} calls opened at once (an opening and one append each), then ended; CPU ms per call")
        print("| round | code | load avg | all first outputs ms | opening: total | by process | ending: total | by process |")
        print("|---|---|---|---|---|---|---|---|")
        data = wav_frame()
        for r in range(args.rounds):
            for name, code in versions if r % 2 == 0 else versions[::-1]:
                stack = await asyncio.to_thread(start_stack, code, cfg)
                try:
                    await burst(stack, SOCKETS, f"warm{r}{name}", data)
                    for k in range(args.bursts):
                        await asyncio.sleep(1.0)
                        load = os.getloadavg()[0]
                        res = await burst(stack, n, f"r{r}{name}{k}", data)
                        o, e = res["open"], res["end"]
                        print(
                            f"| {r} | {name} | {load:.1f} | {res['opened_ms']} | {sum(o.values()):.1f} | "
                            + ", ".join(f"{p} {v}" for p, v in sorted(o.items()))
                            + f" | {sum(e.values()):.1f} | "
                            + ", ".join(f"{p} {v}" for p, v in sorted(e.items()))
                            + " |"
                            + (f" errors: {res['errors'][:3]}" if res["errors"] else ""),
                            flush=True,
                        )
                finally:
                    await asyncio.to_thread(stack.close)


def _server_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def ops(n: int, rounds: int) -> None:
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="duplexbus-admission-") as store, NatsServer(store) as server:
        assert server.proc is not None
        pid = server.proc.pid
        bus = await BusConnection.open(parse_config({"nats_url": server.url}), "bench-admission")
        try:
            for i in range(2000):  # a stream with history, as a running deployment's
                await bus.publish(subjects.input_(f"old{i}", "audio_in"), b"\0" * 2560)
            cids = [subjects.new_cid() for _ in range(n)]
            barrier = 0
            for cid in cids:
                for _ in range(3):
                    await bus.publish(subjects.input_(cid, "audio_in"), b"\0" * 2560)
                barrier = await bus.store(subjects.placed(cid, "w"), b"placed")
            js = bus._nc.jetstream()  # nats-py's own JetStream publish, for the comparison

            async def nats_py_store(i: int) -> None:
                await js.publish(subjects.placed(cids[i], "bench"), b"x" * 300)

            async def acks_store(i: int) -> None:
                await bus.store(subjects.placed(cids[i], "bench"), b"x" * 300)

            async def read(i: int, upto: int | None) -> None:
                cid = cids[i]
                # As a worker's read names them (services/worker/intake.py `_read_on`).
                filters = [
                    subjects.input_(cid, "audio_in"),
                    subjects.eoi(cid, "audio_in"),
                    subjects.abort(cid),
                    subjects.fin(cid),
                ]
                got = [m async for m in bus.read_stored(filters, batch=64, upto=upto)]
                assert len(got) == 3, got

            async def consumer_read(i: int) -> None:
                await read(i, None)

            async def direct_read(i: int) -> None:
                await read(i, barrier)

            async def wildcard_get(i: int) -> None:
                await direct.page(subjects.consumed(cids[i], "audio_in"), 1, 64)

            async def named_get(i: int) -> None:
                await direct.page(subjects.input_(cids[i], "audio_in"), 1, 64)

            direct = DirectReads(bus._nc, subjects.STREAM)
            cases = (
                ("stored publish, nats-py's JetStream publish", nats_py_store),
                ("stored publish, shared/bus/acks.py", acks_store),
                ("catch-up read, ephemeral consumer", consumer_read),
                ("catch-up read, direct gets up to the barrier", direct_read),
                ("direct get, a wildcard filter", wildcard_get),
                ("direct get, a subject named", named_get),
            )
            best: dict[str, tuple[float, float]] = {}
            for _ in range(rounds):
                for name, op in cases:
                    s0, c0 = _server_cpu(pid), time.process_time()
                    await asyncio.gather(*(op(i) for i in range(n)))
                    client, srv = time.process_time() - c0, _server_cpu(pid) - s0
                    old = best.get(name, (client, srv))
                    best[name] = (min(old[0], client), min(old[1], srv))
            print(f"{n} of each at once, best of {rounds}; CPU per operation, µs")
            print("| operation | this process | nats-server |")
            print("|---|---|---|")
            for name, (client, srv) in best.items():
                print(f"| {name} | {1e6 * client / n:.0f} | {1e6 * srv / n:.0f} |")
        finally:
            await bus.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bursts", type=int, default=2, help="bursts per stack and round")
    ap.add_argument("--baseline", help="a git revision, run beside this tree round by round")
    ap.add_argument("--ops", action="store_true", help="the bus operations alone, in one process")
    args = ap.parse_args()
    asyncio.run(ops(400, max(3, args.rounds)) if args.ops else stacks(args))


if __name__ == "__main__":
    main()
