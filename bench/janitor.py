"""What the conductor's janitor costs: removing finished calls from a full stream.

A stream holding --calls finished calls (every subject kind a call uses, --items items per
edge, as in bench.jetstream_cost) is cut to a quarter of its bytes by the conductor's own
code (`ConductorService._clean`, which purges each call by subject, 32 at a time); the
time and CPU per call removed, of the conductor and of nats-server, and the start-up
listing of the finished calls (a restarted conductor's).

    .venv/bin/python -m bench.janitor --calls 4000 --items 25
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import nats
from nats.aio.client import Client

from bench.jetstream_cost import item_msg
from bench.machine import machine
from services.conductor import retention
from services.conductor.service import ConductorService
from shared.bus import subjects
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config


async def fill(nc: Client, calls: int, items: int) -> tuple[int, float]:
    """`calls` finished calls as the services publish them (core publishes, stored by the
    stream), each call's fin stored with an ack: a barrier that keeps the filling from
    outrunning the store. Returns (messages stored, seconds)."""
    js = nc.jetstream()
    item = item_msg(0)
    t0 = time.perf_counter()
    for c in range(calls):
        cid = f"{int(time.time() * 1000) - calls + c:012x}{c:012x}"
        await nc.publish(subjects.open_(cid), b"open")
        for worker in ("worker-e", "worker-t"):
            await nc.publish(subjects.placed(cid, worker), b"placed")
        for _ in range(items):
            await nc.publish(subjects.input_(cid, "audio_in"), item)
            await nc.publish(subjects.edge(cid, "frames"), item)
            await nc.publish(subjects.out(cid), b"o" * 3500)
        for subj in (subjects.eoi(cid, "audio_in"), subjects.edge_end(cid, "frames"), subjects.done(cid, "Encoder"),
                     subjects.done(cid, "Talker")):  # fmt: skip
            await nc.publish(subj, b"x")
        await js.publish(subjects.fin(cid), b"fin")
    return int((await js.stream_info(subjects.STREAM)).state.messages), time.perf_counter() - t0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--items", type=int, default=25)
    args = ap.parse_args()
    retention.GRACE_S = 0.0  # the calls finished long ago
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="duplexbus-bench-janitor-") as store, NatsServer(store) as server:
        assert server.proc is not None
        nc = await nats.connect(server.url)
        conductor = ConductorService(parse_config({"nats_url": server.url}))
        conductor._bus = await BusConnection.open(conductor.config, "bench-janitor")
        try:
            messages, fill_s = await fill(nc, args.calls, args.items)
            full = (await conductor.bus.stream_state()).bytes
            print(f"stream: {args.calls} finished calls, {messages} messages, {full / 1e6:.0f} MB (filled in {fill_s:.1f} s)")
            t = time.perf_counter()
            await conductor._find_finished()
            listing_ms = (time.perf_counter() - t) * 1000
            print(f"start-up listing of the finished calls: {listing_ms:.0f} ms for {len(conductor.janitor)}")
            conductor.janitor.max_bytes = full // 4
            server_cpu, own_cpu, t = cpu_s(server.proc.pid), time.process_time(), time.perf_counter()
            while (await conductor.bus.stream_state()).bytes > full // 4:
                await conductor._clean()
            wall = time.perf_counter() - t
            server_cpu, own_cpu = cpu_s(server.proc.pid) - server_cpu, time.process_time() - own_cpu
            n = conductor.removed
            left = (await conductor.bus.stream_state()).bytes
            print(f"removed {n} calls ({(full - left) / 1e6:.0f} MB) in {wall:.2f} s: {n / wall:.0f} calls/s")
            print("| per call removed | wall | nats-server CPU | conductor CPU |")
            print("|---|---|---|---|")
            print(f"| {messages / args.calls:.0f} messages, {(full - left) / n / 1e3:.0f} kB "
                  f"| {wall / n * 1000:.2f} ms | {server_cpu / n * 1000:.2f} ms | {own_cpu / n * 1000:.2f} ms |")  # fmt: skip
            assert len(await conductor.bus.stored_subjects(subjects.fin("*"))) == args.calls - n
        finally:
            await conductor.bus.close()
            await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
