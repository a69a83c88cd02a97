"""What one subject set per call costs JetStream, with 10,000 finished calls in the stream.

1. Fill: 10,000 finished calls (every subject kind a call uses) into DUPLEX_CALLS,
   published the way the services publish (core publish, stored by the stream);
   publish rate and server memory (from /varz) before and after.
2. Live calls on top of that history, read two ways:
   A (chosen): a core subscription per call and edge, plus one catch-up read per call
      (an ephemeral consumer created, read to the end and deleted);
   B (alternative): one ordered push consumer per call and edge, all reads through JetStream.
   For each: consumer/subscription set-up time per call (p50/p99) and the receive rate
   with 200 calls publishing at once.

    .venv/bin/python -m bench.jetstream_cost --calls 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bench.machine import machine
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config
from shared.runtime.stats import percentile

ITEM = b"\x00" * 2560  # one 80 ms frame of 16 kHz PCM16


def varz(server: NatsServer) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz", timeout=5) as r:
        v: dict[str, Any] = json.loads(r.read())
        return v


def item_msg(seq: int) -> bytes:
    return wire.encode(wire.InputItem(seq=seq, item=wire.WireItem(wire.Tensor("<i2", [1280], ITEM))))


async def fill(nc: Client, calls: int, items: int) -> tuple[int, float]:
    """Publish `calls` finished calls; returns (messages, seconds until all are stored)."""
    js = nc.jetstream()
    start_n = (await js.stream_info(subjects.STREAM)).state.messages
    t0 = time.perf_counter()
    n = 0
    for c in range(calls):
        cid = f"{c:012x}fill"
        await nc.publish(subjects.open_(cid), b"open")
        for worker in ("worker-e", "worker-t"):  # each partition's worker stores where it took the call
            await nc.publish(subjects.placed(cid, worker), b"placed")
        for s in range(items):
            await nc.publish(subjects.input_(cid, "audio_in"), item_msg(s))
            await nc.publish(subjects.edge(cid, "frames"), item_msg(s))
            await nc.publish(subjects.out(cid), b"o" * 3500)
        for subj in (subjects.eoi(cid, "audio_in"), subjects.edge_end(cid, "frames"), subjects.done(cid, "Encoder"),
                     subjects.done(cid, "Talker"), subjects.fin(cid)):  # fmt: skip
            await nc.publish(subj, b"x")
        n += 3 + 3 * items + 5
        if c % 500 == 0:
            await nc.flush()
    await nc.flush()
    while (await js.stream_info(subjects.STREAM)).state.messages < start_n + n:
        await asyncio.sleep(0.05)
    return n, time.perf_counter() - t0


Subscribe = Callable[[Client, str, Callable[[Any], Awaitable[None]]], Awaitable[Any]]


async def core_sub_and_catch_up(nc: Client, cid: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
    """A (chosen): core subscription per call, then, as a worker does, a barrier (its placed
    message, stored with an ack) and one catch-up read (an ephemeral consumer)."""
    sub = await nc.subscribe(subjects.consumed(cid, "audio_in"), cb=cb)
    js = nc.jetstream()
    await js.publish(subjects.placed(cid, "worker-bench"), b"placed")
    cfg = ConsumerConfig(filter_subjects=[subjects.consumed(cid, "audio_in")], deliver_policy=DeliverPolicy.ALL,
                         ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True)  # fmt: skip
    info = await js.add_consumer(subjects.STREAM, cfg)
    await js.delete_consumer(subjects.STREAM, info.name)  # nothing stored yet: the read ends at once
    return sub


async def ordered_consumer(nc: Client, cid: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
    """B (alternative): one ordered push consumer per call; every read through JetStream."""
    return await nc.jetstream().subscribe(subjects.input_(cid, "audio_in"), cb=cb, ordered_consumer=True, stream=subjects.STREAM)


async def measure(nc: Client, cids: list[str], items: int, subscribe: Subscribe) -> dict[str, float]:
    """Set-up time per call, then the receive rate while every call gets `items` items."""
    total = len(cids) * items
    received = 0
    done = asyncio.Event()

    async def cb(m: Any) -> None:
        nonlocal received
        received += 1
        if received >= total:
            done.set()

    setup: list[float] = []
    subs = []
    for cid in cids:
        t = time.perf_counter()
        subs.append(await subscribe(nc, cid, cb))
        setup.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    await publish_all(nc, cids, items)
    await asyncio.wait_for(done.wait(), 120)
    rate = total / (time.perf_counter() - t0)
    for s in subs:
        await s.unsubscribe()
    p50, p99 = percentile(setup, 50) or 0.0, percentile(setup, 99) or 0.0
    return {"setup_p50_ms": p50 * 1000, "setup_p99_ms": p99 * 1000, "msgs_per_s": rate}


async def publish_all(nc: Client, cids: list[str], items: int) -> None:
    pub = await nats.connect(nc.connected_url.geturl() if nc.connected_url else "")
    for s in range(items):
        body = item_msg(s)
        for cid in cids:
            await pub.publish(subjects.input_(cid, "audio_in"), body)
        await pub.flush()
    await pub.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--items", type=int, default=5, help="items per finished call and edge")
    ap.add_argument("--live", type=int, default=200, help="live calls in the read test")
    ap.add_argument("--live-items", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as d, NatsServer(d) as server:
        cfg = parse_config({"nats_url": server.url})
        await (await BusConnection.open(cfg, "bench")).close()  # the stream, as the services make it
        nc = await nats.connect(server.url)
        mem0 = varz(server)["mem"]
        n, secs = await fill(nc, args.calls, args.items)
        info = await nc.jetstream().stream_info(subjects.STREAM)
        mem1 = varz(server)["mem"]
        res: dict[str, Any] = {
            "finished_calls": args.calls,
            "messages": n,
            "fill_msgs_per_s": n / secs,
            "stream_bytes": info.state.bytes,
            "server_mem_before_mb": mem0 / 2**20,
            "server_mem_after_mb": mem1 / 2**20,
        }
        print(f"fill: {args.calls} finished calls, {n} messages, {n / secs:,.0f} msgs/s published and stored")
        print(f"stream: {info.state.bytes / 2**20:.1f} MiB; server memory {mem0 / 2**20:.1f} -> {mem1 / 2**20:.1f} MiB")
        print()
        head = f"| read pattern ({args.live} live calls x {args.live_items} items)"
        print(head + " | set-up p50 ms | set-up p99 ms | receive rate msgs/s |")
        print("|---|---|---|---|")
        patterns: list[tuple[str, Subscribe]] = [
            ("A: core subscription + catch-up read (chosen)", core_sub_and_catch_up),
            ("B: ordered consumer per call", ordered_consumer),
        ]
        for name, fn in patterns:
            cids = [f"{i:012x}{name[0].lower()}live" for i in range(args.live)]
            r = await measure(nc, cids, args.live_items, fn)
            res[name[0]] = r
            print(f"| {name} | {r['setup_p50_ms']:.2f} | {r['setup_p99_ms']:.2f} | {r['msgs_per_s']:,.0f} |", flush=True)
        res["server_mem_end_mb"] = varz(server)["mem"] / 2**20
        print(f"server memory at the end: {res['server_mem_end_mb']:.1f} MiB")
        await nc.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "results": res}, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
