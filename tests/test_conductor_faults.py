"""The conductor under faults of its own: frozen (SIGSTOP) past liveness_s, and NATS gone
for longer than liveness_s. A judge that has not been listening convicts no one: every
live call goes on and ends with every frame."""

from __future__ import annotations

import asyncio

from shared.bus.embedded import NatsServer
from tests.support.bus import own_nats_server
from tests.support.calls import EchoCall, stream_for
from tests.support.freeze import frozen
from tests.support.stack import Stack, running_stack

LIVENESS_S = 3.0
CONFIG = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": LIVENESS_S}
CALLS = 10


async def _open_calls(stack: Stack, prefix: str, frames: int) -> list[EchoCall]:
    calls = [await EchoCall.open(stack.ws_url(), f"{prefix}-{i}", frames, seed=i) for i in range(CALLS)]
    await stream_for(calls, 1.0)
    for c in calls:
        await c.echoed(1)
    return calls


async def test_a_frozen_conductor_aborts_no_live_call(nats_url: str) -> None:
    """SIGSTOP the conductor for 2 x liveness_s while 10 calls stream; on SIGCONT it has
    heartbeats queued that it has not read yet. Before, it judged every worker and frontend
    silent for the whole freeze and ended all 10 calls with 499 "frontend lost"."""
    async with running_stack(nats_url, CONFIG, workers=[["Encoder"], ["Talker"]]) as stack:
        calls = await _open_calls(stack, "frozen", frames=150)
        conductor = stack.procs["conductor"].p.pid
        with frozen(conductor):
            await stream_for(calls, 2 * LIVENESS_S)  # data never passes through the conductor
        await stream_for(calls, 2.0)
        await asyncio.gather(*(c.finish(logs=stack.logs()) for c in calls))
        assert stack.procs["conductor"].alive()


async def test_ten_seconds_without_nats_aborts_no_live_call() -> None:
    """The nats-server is killed under 10 live calls and comes back on its store 10 s later
    (over three times liveness_s). The conductor must not crash (it is not supervised here:
    a crash is the end of it) and must not take the workers and frontends it could not hear
    meanwhile for dead; every call ends with every frame."""
    with own_nats_server("duplexbus-outage-") as first:
        server = first
        stack = Stack(first.url, CONFIG)
        try:
            await stack.start(workers=[["Encoder"], ["Talker"]])
            await stack.wait_workers(2)
            calls = await _open_calls(stack, "outage", frames=300)
            server.kill()
            await stream_for(calls, 10.0)  # appends wait in the frontend's client buffer
            server = NatsServer(first.store_dir, port=first.port).start()  # same port, same store
            await stream_for(calls, 3.0)
            await asyncio.gather(*(c.finish(timeout=90, logs=stack.logs()) for c in calls))
            assert stack.procs["conductor"].alive(), stack.logs()
        finally:
            stack.stop()
            server.stop()
