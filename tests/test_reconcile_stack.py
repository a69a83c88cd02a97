"""Ghost calls, through a real stack: calls a frontend opened and let go while the conductor
could not read must not stay live in the conductor once it reads again, and their admission
slots come back (docs/design.md, "Reconciliation"; the pure rules: tests/test_reconcile.py).

A frozen conductor (SIGSTOP) reads on its thaw everything stored meanwhile, in order: the
opens, then their aborts, and nothing is left. A deaf one (its connection up, its read loop
dead) loses what the server delivered to it, and gets it again after `ack_wait`, maybe after
what came later: an abort read before its open, or never. So the test freezes the conductor,
opens and aborts calls at the frontend meanwhile, and takes their aborts out of the stream
before the thaw: what the conductor reads then is what a deaf one reads, opens of calls no
frontend holds. Before, each was placed and kept its slot until max_call_duration_s."""

from __future__ import annotations

import asyncio
import time

from shared.bus import subjects, wire
from tests.support.bus import conductor_status, connected
from tests.support.calls import EchoCall
from tests.support.client import WS
from tests.support.freeze import frozen
from tests.support.poll import until
from tests.support.stack import Stack, running_stack

LIMIT = 8  # max_concurrent_requests: each ghost keeps a slot a new call cannot have
# The ghosts share one socket: its fair share is every slot.
CONFIG = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0, "max_concurrent_requests": LIMIT, "max_calls_per_socket": LIMIT}
PULL_EXPIRES_S = 1.5  # past the conductor's pull request (fetch's 1 s): the server delivers it nothing more


async def conductor_live(stack: Stack) -> int:
    live: int = (await conductor_status(stack.nats_url))["live_calls"]
    return live


async def frontends_hold(stack: Stack) -> int:
    """The calls the frontends hold, as their latest heartbeats list them."""
    async with connected(stack.nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_FRONTENDS)
        held = 0
        for key in await kv.keys():
            with_calls = wire.decode_as((await kv.get(key)).value or b"", wire.FrontendHeartbeat)
            assert with_calls.calls is not None
            held += len(with_calls.calls)
    return held


async def fins(stack: Stack) -> int:
    """The calls the conductor ended (or refused), each with its fin in the stream."""
    async with connected(stack.nats_url) as nc:
        info = await nc.jetstream().stream_info(subjects.STREAM, subjects_filter=subjects.fin("*"))
    return len(info.state.subjects or {})


async def drop_aborts(stack: Stack) -> None:
    """Every abort out of the stream, before the conductor has read it."""
    async with connected(stack.nats_url) as nc:
        await nc.jetstream().purge_stream(subjects.STREAM, subject=subjects.abort("*"))


async def test_calls_let_go_while_the_conductor_could_not_read_end_and_free_their_slots(nats_url: str) -> None:
    async with running_stack(nats_url, CONFIG) as stack:
        ws = await WS.connect(stack.ws_url())
        conductor = stack.procs["conductor"].p.pid
        with frozen(conductor):
            await asyncio.sleep(PULL_EXPIRES_S)
            for i in range(LIMIT):
                await ws.send({"request_id": f"ghost-{i}"})
            for i in range(LIMIT):
                await ws.send({"request_id": f"ghost-{i}", "abort": True})
            for i in range(LIMIT):
                assert (await ws.final(f"ghost-{i}")).get("status") == 499
            await drop_aborts(stack)
        thawed = time.monotonic()
        assert await frontends_hold(stack) == 0

        async def ghosts_ended() -> bool:
            return await fins(stack) == LIMIT

        try:
            await until(ghosts_ended, 10, "a fin for each call the frontend let go", interval=0.1)
        except TimeoutError as e:
            raise AssertionError(f"{e}; the conductor holds {await conductor_live(stack)}\n{stack.logs()}") from None
        took = time.monotonic() - thawed
        assert await conductor_live(stack) == 0  # as many as the frontends hold
        calls = [await EchoCall.open(stack.ws_url(), f"new-{i}", frames=2, seed=i) for i in range(LIMIT)]
        for c in calls:
            await c.send(1)
        await asyncio.gather(*(c.echoed(0, timeout=10) for c in calls))  # every slot came back: all placed
        await asyncio.gather(*(c.finish(logs=stack.logs()) for c in calls))
        await ws.close()
        print(f"ghosts ended {took:.2f} s after the thaw")
        assert took < 5, stack.logs()
