"""What confirmed publishes cost (shared/bus/confirmed.py): `BusConnection.publish` of
--messages 2.6 kB items to one nats-server, plain core publishes against confirmed ones,
alternating, twice each; rate, and CPU per message of the publisher and of nats-server.

    .venv/bin/python -m bench.confirm_cost --messages 100000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.machine import machine
from shared.bus import subjects
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config

ITEM = b"\x00" * 2600  # about one 80 ms frame of 16 kHz PCM16, as the frontend publishes it


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(url: str, pid: int, confirm: bool, n: int) -> tuple[float, float, float]:
    """(messages/s, publisher CPU µs per message, nats-server CPU µs per message)."""
    bus = await BusConnection.open(parse_config({"nats_url": url, "retention": {"confirm_publishes": confirm}}), "bench")
    try:
        server, own, t = cpu_s(pid), time.process_time(), time.perf_counter()
        for i in range(n):
            await bus.publish(subjects.input_(f"c{i % 100}", "audio_in"), ITEM)
        if bus.confirmer is not None:
            while len(bus.confirmer.unconfirmed):
                await asyncio.sleep(0.001)
        else:
            await bus.round_trip(10.0)  # everything sent has reached the server
        wall = time.perf_counter() - t
        return n / wall, 1e6 * (time.process_time() - own) / n, 1e6 * (cpu_s(pid) - server) / n
    finally:
        await bus.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100_000)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="duplexbus-bench-confirm-") as store, NatsServer(store) as server:
        assert server.proc is not None
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for confirm in (False, True, False, True):
            runs[confirm].append(await one(server.url, server.proc.pid, confirm, args.messages))
    print("| publishes | messages/s | publisher CPU µs/message | nats-server CPU µs/message |")
    print("|---|---|---|---|")
    for confirm, rs in runs.items():
        rate, own, srv = (statistics.median(col) for col in zip(*rs, strict=True))
        print(f"| {'confirmed' if confirm else 'core'} | {rate:.0f} | {own:.1f} | {srv:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
