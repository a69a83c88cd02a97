"""nats-server paused (SIGSTOP: a GC pause, a disk stall, a VM hiccup) under live calls, then
thawed: every call finishes byte-exact, and a new call is admitted within seconds of the thaw.

- one server, one stack, three pauses in turn (2, 8 and 12 s), each over three live `echo`
  calls opened for it. Before, a pause over a second left the conductor's connection deaf for
  4 to 6 minutes (nats-py's read loop died on a late PONG: docs/reliability.md);
- a three-node cluster whose node the conductor is connected to is paused 8 s (the conductor
  moves to another node once the paused one is found stale).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from shared.bus.embedded import NatsCluster, NatsServer
from tests.support import freeze
from tests.support.bus import own_nats_server
from tests.support.calls import EchoCall, stream_for
from tests.support.stack import Stack, cluster_stack

CONFIG = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0}
CALLS = 3
FPS = 12.5  # stream_for's pace: one 80 ms frame each


def paused(server: NatsServer) -> contextlib.AbstractContextManager[None]:
    assert server.proc is not None
    return freeze.frozen(server.proc.pid)


async def _open(stack: Stack, prefix: str, seconds: float) -> list[EchoCall]:
    """CALLS live calls with frames for `seconds` of streaming, each echoing already."""
    frames = int(seconds * FPS) + 8
    calls = [await EchoCall.open(stack.ws_url(), f"{prefix}-{i}", frames, seed=i) for i in range(CALLS)]
    await stream_for(calls, 0.5)
    await asyncio.gather(*(c.echoed(1) for c in calls))
    return calls


async def _admitted(stack: Stack, prefix: str, within: float) -> float:
    """Seconds until a new call is served to its end (each refused or unanswered one is tried
    again at once); fails past `within`."""
    start = time.monotonic()
    for i in range(1000):
        call = await EchoCall.open(stack.ws_url(), f"{prefix}-new-{i}", frames=3, seed=i)
        try:
            final = await call.end(timeout=max(0.5, within - (time.monotonic() - start)))
        except TimeoutError:
            final = {"error": "no answer in time"}
        finally:
            await call.ws.close()
        if "finish" in final:
            call.check(final)
            return time.monotonic() - start
        assert time.monotonic() - start < within, (final, stack.logs())
    raise AssertionError("unreachable")


async def _pause_under_calls(stack: Stack, node: NatsServer, seconds: float, prefix: str) -> tuple[float, float]:
    """Pause `node` for `seconds` while CALLS live calls stream in real time; after the thaw a
    new call is admitted and the live ones finish exact. (new call's wait, live calls' finish)."""
    calls = await _open(stack, prefix, seconds + 2.0)
    with paused(node):
        await stream_for(calls, seconds)
    thawed = time.monotonic()
    admitted = await _admitted(stack, prefix, within=15.0)
    await asyncio.gather(*(c.finish(timeout=30, logs=stack.logs()) for c in calls))
    finished = time.monotonic() - thawed
    print(f"paused {seconds:.0f} s: new call served {admitted:.1f} s after the thaw, {CALLS} calls exact {finished:.1f} s after")
    return admitted, finished


async def test_a_paused_server_2_8_and_12_s_under_live_calls() -> None:
    with own_nats_server("duplexbus-pause-") as server:
        stack = Stack(server.url, CONFIG)
        try:
            await stack.start(workers=[["Encoder"], ["Talker"]])
            await stack.wait_workers(2)
            for seconds in (2.0, 8.0, 12.0):
                admitted, _ = await _pause_under_calls(stack, server, seconds, f"pause{seconds:.0f}")
                assert admitted < 10.0, stack.logs()
            assert all(p.alive() for p in stack.procs.values()), stack.logs()
        finally:
            stack.stop()


def _cluster_stack() -> contextlib.AbstractAsyncContextManager[tuple[NatsCluster, Stack]]:
    """The conductor alone on node c; the workers on a and b, the frontend on a."""
    placement = {"conductor": 2, "worker-a": 0, "worker-b": 1, "frontend-0": 0}
    return cluster_stack({**CONFIG, "retention": {"replicas": 3}}, placement, "duplexbus-pause-cluster-")


async def test_the_conductors_node_of_a_cluster_paused_8_s_under_live_calls() -> None:
    async with _cluster_stack() as (cluster, stack):
        admitted, _ = await _pause_under_calls(stack, cluster.nodes[2], 8.0, "cluster")
        assert admitted < 10.0, stack.logs()
        assert "reconnected" in stack.procs["conductor"].log.read_text(), stack.logs()
