"""A worker that refuses an assignment as busy (stopping after its SIGTERM, or full) makes the
conductor place the call on another worker: a rolling upgrade's race, where a call is placed
on a worker in the instant after its SIGTERM, before its heartbeat has said so."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from models.echo import FRAME
from services.conductor import core
from services.worker.assignment import Assignment
from shared.bus import subjects, wire
from tests.support import bus
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, running_stack

GHOST = "ghost"  # a worker id no process of the stack has
PARTS = ["Encoder", "Talker"]


async def refusal(accepting: bool, capacity: int) -> str | None:
    """What a real worker's Assignment answers a new call when stopping (not `accepting`) or
    full (`capacity` 0). It refuses before touching its engines or the bus, so stand-ins serve."""
    ctx = SimpleNamespace(worker_id="worker-7-abc", runners={})
    intake = SimpleNamespace(calls={})
    a = Assignment(cast(Any, ctx), cast(Any, intake), lambda: accepting, lambda: capacity)
    reply = await a.answer(wire.encode(wire.Assign(cid="c1", model="echo", partitions=PARTS)))
    assert not reply.ok
    return reply.error


async def test_the_workers_own_refusals_are_taken_as_busy_and_others_are_not() -> None:
    """The conductor reads a refusal's text (a worker of the release before has no other
    way to say it): this holds the worker's wording and the conductor's reading together."""
    stopping = await refusal(accepting=False, capacity=10)
    full = await refusal(accepting=True, capacity=0)
    assert (stopping, full) == ("worker is shutting down", "worker worker-7-abc is full (0 calls)")
    assert core.busy_refusal(stopping) and core.busy_refusal(full)
    for other in (None, "no reply", "internal error: the worker could not take the call", "bad model_kwargs: full"):
        assert not core.busy_refusal(other), other


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo"}) as s:
        yield s


@contextlib.asynccontextmanager
async def ghost_worker(nats_url: str, error: str) -> AsyncIterator[list[str]]:
    """A worker that heartbeats the most free slots of all (so the conductor picks it) and
    refuses every assignment with `error`; yields the cids it was asked to take."""
    asked: list[str] = []
    async with bus.connected(nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
        hb = wire.WorkerHeartbeat(
            worker_id=GHOST, model="echo", partitions=PARTS, model_partitions=PARTS, capacity=100_000, load=0, ts=0.0
        )

        async def beat() -> None:
            while True:
                await kv.put(GHOST, wire.encode(hb))
                await asyncio.sleep(0.25)

        async def on_assign(msg: Any) -> None:
            asked.append(wire.decode_as(msg.data, wire.Assign).cid)
            await msg.respond(wire.encode(wire.AssignReply(ok=False, error=error)))

        sub = await nc.subscribe(subjects.assign(GHOST), cb=on_assign)
        beating = asyncio.create_task(beat())

        async def seen() -> bool:
            reply = await nc.request(subjects.conductor_status(), b"", timeout=2)
            return GHOST in json.loads(reply.data)["workers"]

        try:
            await until(seen, 15, "the conductor sees the ghost worker")
            yield asked
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await sub.unsubscribe()
            await kv.delete(GHOST)


async def test_a_call_placed_on_a_stopping_worker_is_served_by_another(stack: Stack, ws: WS) -> None:
    """The ghost refuses as a worker does just after its SIGTERM; the call, placed there
    first, finishes byte-exact on the stack's real worker. Before, it ended with 503."""
    stopping = await refusal(accepting=False, capacity=10)
    assert stopping is not None
    samples = (np.arange(12 * FRAME) % 20000).astype("<i2")
    async with ghost_worker(stack.nats_url, stopping) as asked:
        await ws.send({"request_id": "r", "files": [pcm_file(samples)], "end_input": True})
        final = await ws.final("r")
        assert "finish" in final, (final, stack.logs())
        assert echo_bytes(ws.outputs("r")) == samples.tobytes()
        assert len(asked) == 1, asked  # placed there once, then elsewhere
