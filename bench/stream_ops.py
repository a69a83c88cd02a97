"""What the server's stream operations cost on a big stream of interleaved calls.

A stream under hundreds of live calls holds every call's messages interleaved: each block
of the server's store holds messages of hundreds of calls. This fills a stream of the
project's own configuration (`stream_config`, one replica, file storage) on an embedded
nats-server with `--mb` of messages of `--live` calls at a time (each call 250 messages of
2,700 bytes over three subjects, as echo's input, output and edge), then times, in one
process:

- a batched direct get of a live call's subject from sequence 1, against one from near the
  call's messages (`wire.Open.read_after`: where a worker's read at placement starts);
- a purge of one finished call's subjects (`call.{cid}.>`: how the janitor removed each call);
- a purge of the stream's head (every message below a sequence: retention.py's cut).

    .venv/bin/python -m bench.stream_ops --mb 2000

The server and its store are removed when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import nats
from nats.aio.client import Client

from shared.bus import subjects
from shared.bus.connection import stream_config
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config

BODY = b"x" * 2700
KINDS = ("in.audio_in", "out", "edge.frames")
PER_CALL = 250


async def fill(nc: Client, mb: int, live: int) -> tuple[list[int], list[int]]:
    """The stream filled; (the calls still live at the end, the calls that ended), by number."""
    calls = list(range(live))
    count = dict.fromkeys(calls, 0)
    done: list[int] = []
    nxt = live
    for k in range(mb * 2**20 // len(BODY)):
        i = k % live
        c = calls[i]
        await nc.publish(f"call.c{c}.{KINDS[count[c] % len(KINDS)]}", BODY)
        count[c] += 1
        if count[c] >= PER_CALL:
            done.append(c)
            calls[i], count[nxt] = nxt, 0
            nxt += 1
        if k % 5000 == 0:
            await nc.flush()
    await nc.flush()
    return calls, done


async def direct_get_ms(nc: Client, subject: str, seq: int) -> float:
    """One batched direct get of `subject` from `seq` (up to 64 messages), to its end status."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    t = time.perf_counter()
    body = json.dumps({"seq": seq, "next_by_subj": subject, "batch": 64}).encode()
    await nc.publish(subjects.js_api_direct_get(subjects.STREAM), body, reply=inbox)
    while True:
        m = await sub.next_msg(timeout=30)
        if m.headers and m.headers.get("Status"):
            break
    ms = (time.perf_counter() - t) * 1000
    await sub.unsubscribe()
    return ms


async def run(mb: int, live: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="duplexbus-stream-ops-") as d:
        server = NatsServer(d)
        server.start()
        try:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await js.add_stream(stream_config(parse_config({})))
            t = time.monotonic()
            live_calls, ended = await fill(nc, mb, live)
            await asyncio.sleep(1)
            state = (await js.stream_info(subjects.STREAM)).state
            took = time.monotonic() - t
            size = f"{state.messages:,} messages, {state.bytes / 2**20:,.0f} MB"
            print(f"stream: {size}, {live} calls at a time, filled in {took:.1f} s")
            last = int(state.last_seq)
            subject = f"call.c{live_calls[0]}.{KINDS[0]}"
            for label, seq in (("from sequence 1", 1), ("from near the call (last - 2,000)", last - 2000)):
                ms = [await direct_get_ms(nc, subject, seq) for _ in range(rounds)]
                median = statistics.median(ms)
                print(f"direct get of a live call's subject {label}: median {median:.2f} ms (first {ms[0]:.1f} ms)")
            ms = []
            for c in ended[:rounds]:
                t0 = time.perf_counter()
                await js.purge_stream(subjects.STREAM, subject=f"call.c{c}.>")
                ms.append((time.perf_counter() - t0) * 1000)
            print(f"purge of one finished call's subjects: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms")
            first = int((await js.stream_info(subjects.STREAM)).state.first_seq)
            for step in (10_000, 100_000):
                t0 = time.perf_counter()
                await js.purge_stream(subjects.STREAM, seq=first + step)
                first += step
                print(f"purge of the stream's head, {step:,} messages: {(time.perf_counter() - t0) * 1000:.1f} ms")
            await nc.close()
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=2000, help="megabytes of messages to fill the stream with")
    ap.add_argument("--live", type=int, default=300, help="calls whose messages interleave at a time")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    asyncio.run(run(args.mb, args.live, args.rounds))


if __name__ == "__main__":
    main()
