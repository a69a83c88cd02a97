"""A service's stop is bounded (shared.runtime.process.run_until_stopped): one that ends on
its own is left to, one that does not is cancelled after its grace."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.runtime.process import run_until_stopped


async def test_a_service_that_stops_by_itself_is_not_cut_short() -> None:
    stop = asyncio.Event()
    done: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        await asyncio.sleep(0.2)  # draining
        done.append("drained")

    asyncio.get_running_loop().call_later(0.1, stop.set)
    await run_until_stopped(service, stop, grace_s=5.0)
    assert done == ["drained"]


async def test_a_service_stuck_after_the_signal_is_cancelled_after_its_grace() -> None:
    stop = asyncio.Event()
    cancelled: list[bool] = []

    async def stuck(stop: asyncio.Event) -> None:
        try:
            await asyncio.sleep(3600)  # connecting to a NATS that never answers, say
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    asyncio.get_running_loop().call_later(0.1, stop.set)
    start = time.monotonic()
    await run_until_stopped(stuck, stop, grace_s=0.5)
    assert cancelled == [True]
    assert 0.5 <= time.monotonic() - start < 3


async def test_a_service_that_fails_raises_its_error() -> None:
    async def failing(stop: asyncio.Event) -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        await run_until_stopped(failing, asyncio.Event(), grace_s=1.0)
