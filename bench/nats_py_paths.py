"""What one message costs a service in nats-py's read loop: nats-py's own client against the
project's `GuardedClient` (shared/bus/internals.py, whose parser is `FastParser`), in one
process, on a nats-server of its own.

    .venv/bin/python -m bench.nats_py_paths                 # 5 pairs, interleaved
    .venv/bin/python -m bench.nats_py_paths --pairs 9 --size 2700

- **read**: the bytes of `MSG` lines as a server sends them (each of `--size` bytes, to a
  direct subscription whose handler counts them), fed to the client's parser as its read
  loop feeds them; µs a message. Twice: in reads of 20 whole messages, then in reads of
  16 KiB cut wherever they fall (most end inside a message, as a socket read under load
  does).

Each pair runs nats-py's client then GuardedClient, the best of 5 repeats each; it prints
each pair and the median of each side and of their ratios, for each kind of read.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.protocol.parser import Parser

from shared.bus.embedded import NatsServer
from shared.bus.internals import GuardedClient, subscribe_direct

SUBJECT = "call.0123456789abcdef.in.audio_in"
PER_READ = 20  # messages in one read of the socket, in the "whole" reads
CUT_READ = 16_384  # bytes in one read in the "cut" reads: most end inside a message, as under load
REPEATS = 5


async def _connected(url: str, guarded: bool) -> Client:
    nc = GuardedClient() if guarded else Client()
    await nc.connect(url)
    return nc


async def read_us(url: str, guarded: bool, size: int, n: int, cut: bool = False) -> float:
    nc = await _connected(url, guarded)
    try:
        got = 0

        def count(m: Msg) -> None:
            nonlocal got
            got += 1

        sub = await subscribe_direct(nc, SUBJECT, count)
        if not guarded:
            nc._ps = Parser(nc)
        one = b"MSG %s %d %d\r\n" % (SUBJECT.encode(), sub._id, size) + bytes(size) + b"\r\n"
        n -= n % PER_READ
        if cut:
            stream = one * n
            reads = [stream[i : i + CUT_READ] for i in range(0, len(stream), CUT_READ)]
        else:
            reads = [one * PER_READ] * (n // PER_READ)

        async def run() -> None:
            for data in reads:
                await nc._ps.parse(data)

        best = await _best(run, n)
        assert got == REPEATS * n, "a message was not handed over"
        return best
    finally:
        await nc.close()


async def _best(run: Callable[[], Awaitable[None]], n: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        await run()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


async def main(url: str, pairs: int, size: int, n: int) -> None:
    for cut in (False, True):
        kind = f"reads of {CUT_READ} bytes" if cut else f"reads of {PER_READ} whole messages"
        rows = []
        for i in range(pairs):
            plain = await read_us(url, False, size, n, cut)
            guarded = await read_us(url, True, size, n, cut)
            rows.append((plain, guarded))
            print(f"{kind}, pair {i + 1}: nats-py {plain:.2f} µs, GuardedClient {guarded:.2f} µs")
        plain_m = statistics.median(p for p, _ in rows)
        guarded_m = statistics.median(g for _, g in rows)
        ratio = statistics.median(g / p for p, g in rows)
        print(f"{kind}: median nats-py {plain_m:.2f} µs, GuardedClient {guarded_m:.2f} µs, ratio {ratio:.2f}")


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--size", type=int, default=2700, help="payload bytes (an 80 ms msgpack append is about 2,700)")
    ap.add_argument("--messages", type=int, default=20_000, help="messages in each repeat")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.size < 0 or args.messages < PER_READ:
        ap.error(f"--pairs must be at least 1, --size at least 0, --messages at least {PER_READ}")
    with tempfile.TemporaryDirectory(prefix="duplexbus-nats-paths-") as store, NatsServer(store) as server:
        asyncio.run(main(server.client_url, args.pairs, args.size, args.messages))


if __name__ == "__main__":
    cli()
