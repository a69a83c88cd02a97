"""The conductor's restore with many ended calls behind it: delete markers kept forever
(a plain KV delete, as before) against removals whose marker expires (kv.MARKER_TTL_S).

For each way: N call records written and removed the way the conductor does, 100 records
of calls still live, then the real `ConductorService._restore()` timed (median of 3).

    .venv/bin/python -m bench.kv_markers --ended 100000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import nats
from nats.js.kv import KeyValue

from bench.machine import machine
from services.conductor.service import ConductorService
from shared.bus import kv as kv_module
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config

LIVE = 100
BATCH = 2000  # writes in flight at once


def _record(i: int) -> bytes:
    return wire.encode(wire.CallRecord(cid=f"{i:024x}", request_id=f"r{i}", model="echo", frontend_id="f", state="running",
                                       live=True, created=time.time(), partitions=["Encoder", "Talker"],
                                       placement={"Encoder": "w", "Talker": "w"}))  # fmt: skip


async def _fill(bus: BusConnection, raw: KeyValue, ended: int, markers_kept: bool) -> None:
    bucket = bus.kv[subjects.KV_CALLS]
    for start in range(0, ended, BATCH):
        keys = [f"{i:024x}" for i in range(start, min(start + BATCH, ended))]
        await asyncio.gather(*(bucket.put(k, _record(int(k, 16))) for k in keys))
        if markers_kept:
            await asyncio.gather(*(raw.delete(k) for k in keys))  # as before: the marker stays
        else:
            await asyncio.gather(*(bucket.delete(k) for k in keys))
    await asyncio.gather(*(bucket.put(f"{ended + i:024x}", _record(ended + i)) for i in range(LIVE)))


async def _restore_s(url: str) -> float:
    conductor = ConductorService(parse_config({"nats_url": url}))
    conductor._bus = await BusConnection.open(conductor.config, "bench-restore", buckets=[subjects.KV_CALLS])
    try:
        start = time.perf_counter()
        await conductor._restore()
        took = time.perf_counter() - start
        assert len(conductor.core.calls) == LIVE, len(conductor.core.calls)
        return took
    finally:
        await conductor.bus.close()


async def one_way(ended: int, markers_kept: bool) -> tuple[int, float]:
    with tempfile.TemporaryDirectory(prefix="duplexbus-bench-kv-") as store, NatsServer(store) as server:
        bus = await BusConnection.open(parse_config({"nats_url": server.url}), "bench-fill", buckets=[subjects.KV_CALLS])
        nc = await nats.connect(server.url)
        try:
            await _fill(bus, await nc.jetstream().key_value(subjects.KV_CALLS), ended, markers_kept)
            if not markers_kept:
                await asyncio.sleep(kv_module.MARKER_TTL_S + 1)
            held = int((await nc.jetstream().stream_info(f"KV_{subjects.KV_CALLS}")).state.messages)
            times = [await _restore_s(server.url) for _ in range(3)]
            return held, statistics.median(times)
        finally:
            await nc.close()
            await bus.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ended", type=int, default=100_000)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print(f"{args.ended} ended calls, {LIVE} live; the conductor's restore, median of 3")
    print("| removal | messages left in duplex_calls | restore |")
    print("|---|---|---|")
    results = {}
    for kept in (True, False):
        held, took = await one_way(args.ended, kept)
        results[kept] = took
        name = "KV delete, marker kept (before)" if kept else f"purge, marker TTL {kv_module.MARKER_TTL_S} s (now)"
        print(f"| {name} | {held} | {took * 1000:.0f} ms |")
    print(f"ratio before/now: {results[True] / results[False]:.0f}x")


if __name__ == "__main__":
    asyncio.run(main())
