"""What a replicated stream costs: live echo capacity on one nats-server (replicas 1)
against a three-node cluster on this machine (replicas 3, bench.live_load's load).

Three set-ups in one run, each ascending through --calls (until a level's lag p99 is past
500 ms); its capacity is the most calls of a level in real time (lag p99 < 100 ms, no
error). The set-ups: one server at R1 as `duplexbus up` runs by default; the same with
confirmed publishes (what R3 turns on: shared/bus/confirmed.py), to tell that
share of the cost apart; and NatsCluster at R3. Everything shares the machine's cores,
the three nodes too, so this is R3's cost in CPU on one box, an upper bound for a cluster
whose nodes have machines of their own.

    .venv/bin/python -m bench.cluster_cost --calls 50,100,150,200,250,300 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from typing import Any

from bench.live_load import fmt, level
from bench.machine import machine
from shared.bus.embedded import NatsCluster, NatsServer
from tests.support.stack import UpStack

SETUPS = {
    "R1": ({"replicas": 1}, 1),
    "R1, confirmed publishes": ({"replicas": 1, "confirm_publishes": True}, 1),
    "R3, 3-node cluster": ({"replicas": 3}, 3),
}


async def capacity(name: str, retention: dict[str, Any], nodes: int, levels: list[int], args: argparse.Namespace) -> int:
    cfg: dict[str, Any] = {"max_concurrent_requests": max(levels) + 10, "worker_slots": max(levels) + 10, "retention": retention}
    best = 0
    with tempfile.TemporaryDirectory(prefix="duplexbus-bench-cluster-") as store:
        nats: NatsServer | NatsCluster = NatsServer(store) if nodes == 1 else NatsCluster(store)
        with nats, UpStack("echo", workers=1, config=cfg, nats_url=nats.url) as stack:
            for n in levels:
                r = await level(stack, n, args.seconds, args.per_socket, args.ramp)
                real_time = r["lag_p99_ms"] is not None and r["lag_p99_ms"] < 100 and r["errors"] == 0
                print(f"| {name} | {n} | {fmt(r['lag_p50_ms'])} | {fmt(r['lag_p99_ms'])} | {r['errors']} "
                      f"| {'yes' if real_time else 'no'} |", flush=True)  # fmt: skip
                if r.get("last_error"):
                    print(f"  ({name}, {n} calls: last error: {r['last_error']})", flush=True)
                if real_time:
                    best = n
                elif r["lag_p99_ms"] is None or r["lag_p99_ms"] > 500:
                    break  # far past it: the levels above would only be slower
    return best


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="50,100,150,200,250,300")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--per-socket", type=int, default=25)
    ap.add_argument("--ramp", type=float, default=2.0)
    args = ap.parse_args()
    levels = [int(x) for x in args.calls.split(",")]
    print(f"machine: {machine()}")
    print("| set-up | live calls | lag p50 ms | lag p99 ms | errors | real time |")
    print("|---|---|---|---|---|---|")
    best = {name: await capacity(name, r, nodes, levels, args) for name, (r, nodes) in SETUPS.items()}
    for name, n in best.items():
        print(f"most live echo calls in real time, {name}: {n}")
    if best["R1"]:
        for name in list(SETUPS)[1:]:
            print(f"{name} / R1: {best[name] / best['R1']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
