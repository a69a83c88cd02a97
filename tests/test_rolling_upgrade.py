"""Rolling upgrades with real processes on a real nats-server: a call across processes that
speak two adjacent wire minors (the next one adds a field to every message), and a stack
replaced process by process, workers, then the conductor, then the frontend, while calls
stream, with no call lost (docs/operations.md, "Upgrading a running deployment")."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import pytest

from shared.bus import wire
from tests.support.upgrade import LiveCall, MinorTap, MixedStack

NEXT = wire.MINOR + 1
CONFIG = {"model": "echo", "shutdown_drain_s": 30, "placement_timeout_s": 20}


@contextlib.asynccontextmanager
async def mixed(
    nats_url: str, next_minor: set[str], workers: list[list[str] | None]
) -> AsyncIterator[tuple[MixedStack, MinorTap]]:
    stack = MixedStack(nats_url, CONFIG, next_minor)
    tap = MinorTap()
    try:
        await stack.start(workers=workers)
        await stack.wait_workers(len(workers))
        await tap.start(nats_url)
        yield stack, tap
    except BaseException:
        print(stack.logs())
        raise
    finally:
        await tap.close()
        stack.stop()


# Between them the two cases send every call message across the versions, one way or the
# other; each `expect` says which minor wrote what, so a launcher that failed to take
# effect fails the test instead of passing it unmixed.
CASES = {
    "new frontend, old conductor and workers": (
        {"frontend-0"},
        {"open": {NEXT}, "in": {NEXT}, "eoi": {NEXT}, "edge": {wire.MINOR}, "out": {wire.MINOR}, "fin": {wire.MINOR}},
    ),
    "old frontend and Encoder, new conductor and Talker": (
        {"conductor", "worker-1"},
        {"open": {wire.MINOR}, "in": {wire.MINOR}, "edge": {wire.MINOR}, "out": {NEXT}, "fin": {NEXT}},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_call_crosses_two_adjacent_wire_minors_byte_exact(nats_url: str, case: str) -> None:
    next_minor, expect = CASES[case]
    # Each partition in its own worker (worker-0 Encoder, worker-1 Talker): the edge crosses the bus.
    async with mixed(nats_url, next_minor, workers=[["Encoder"], ["Talker"]]) as (stack, tap):
        call = await LiveCall(stack.ws_url(0), "mixed").start()
        try:
            await call.echoed(20)
            await call.finish()
        except BaseException:
            await call.abandon()
            raise
        assert {k: tap.minors[k] for k in expect} == expect
        assert not tap.bad, tap.bad[:3]


async def test_replacing_every_process_one_at_a_time_loses_no_call(nats_url: str) -> None:
    """Old worker-0, conductor and frontend-0 are replaced by new worker-1, conductor-1 and
    frontend-1, in that order, each old one stopped with SIGTERM (it drains) once its
    successor is up. Calls stream on both sides of every step, one is opened while no
    conductor runs, and each ends with every frame back once, in order."""
    async with mixed(nats_url, {"worker-1", "conductor-1", "frontend-1"}, workers=[None]) as (stack, tap):
        calls: list[LiveCall] = []

        async def open_calls(prefix: str, frontend: int, n: int = 2) -> list[LiveCall]:
            new = [await LiveCall(stack.ws_url(frontend), f"{prefix}{i}").start() for i in range(n)]
            calls.extend(new)
            return new

        try:
            # Workers: the new one first, then the old one drains, taking no new call.
            a = await open_calls("a", 0)
            await asyncio.gather(*(c.echoed(5) for c in a))
            stack.start_worker("worker-1")
            await stack.wait_workers(2)
            stack.procs["worker-0"].p.terminate()
            await stack.draining("worker-0")
            b = await open_calls("b", 0)
            await asyncio.gather(*(c.echoed(5) for c in a + b))
            assert await stack.placed_on(c.rid for c in b) == {"worker-1"}
            await asyncio.gather(*(c.finish() for c in a))
            assert await stack.stopped("worker-0") == 0  # it left once its calls were done

            # The conductor: one at a time. A call opened in the gap waits for the new one.
            stack.procs["conductor"].p.terminate()
            assert await stack.stopped("conductor") == 0
            c = await open_calls("c", 0, n=1)
            stack.start_conductor("conductor-1")
            await asyncio.gather(*(x.echoed(5) for x in b + c))

            # Frontends: the new one first; the old one drains its sockets' calls.
            stack.start_frontend("frontend-1")
            await stack.wait_ready(stack.ports[1])
            stack.procs["frontend-0"].p.terminate()
            d = await open_calls("d", 1)
            await asyncio.gather(*(x.echoed(5) for x in b + c + d))
            await asyncio.gather(*(x.finish() for x in b + c))
            # Its calls ended (and no SIGKILL): uvicorn raises again the signal it stopped on.
            assert await stack.stopped("frontend-0") in (0, -signal.SIGTERM)
            await asyncio.gather(*(x.finish() for x in d))
        except BaseException:
            await asyncio.gather(*(x.abandon() for x in calls))
            raise
        assert not tap.bad, tap.bad[:3]
        assert tap.minors["out"] == {wire.MINOR, NEXT}  # calls were served by both releases
