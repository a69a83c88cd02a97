"""Timeouts through the real services: input resets `request_timeout_s`, an idle call ends
with 408, and a call past `max_call_duration_s` ends with 408 too (the conductor's tick)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack

REQUEST_TIMEOUT_S = 1.0
MAX_CALL_DURATION_S = 3.5
CONFIG = {"model": "echo", "request_timeout_s": REQUEST_TIMEOUT_S, "max_call_duration_s": MAX_CALL_DURATION_S}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


def audio(n: int = 640) -> dict[str, str]:
    return pcm_file(np.ones(n, dtype="<i2"))


async def test_idle_call_ends_with_408(ws: WS) -> None:
    t = time.monotonic()
    await ws.send({"request_id": "idle", "files": [audio()]})
    m = await ws.final("idle", timeout=10)
    took = time.monotonic() - t
    assert m.get("status") == 408 and "request_timeout_s" in m["error"], m
    assert REQUEST_TIMEOUT_S * 0.9 <= took < REQUEST_TIMEOUT_S + 1.0, took
    await ws.send({"request_id": "idle", "append": [audio()]})  # the call is gone
    assert (await ws.until(lambda m: m.get("request_id") == "idle" and m.get("append")))["status"] == 404


async def test_input_resets_the_request_timeout(ws: WS) -> None:
    await ws.send({"request_id": "busy"})
    start = time.monotonic()
    while time.monotonic() - start < 2.5 * REQUEST_TIMEOUT_S:  # well past the timeout in all
        await asyncio.sleep(REQUEST_TIMEOUT_S * 0.4)
        await ws.send({"request_id": "busy", "append": [audio(10)]})
    await ws.send({"request_id": "busy", "end_input": True})
    m = await ws.final("busy", timeout=10)
    assert "finish" in m, m


async def test_call_past_max_call_duration_ends_with_408(ws: WS) -> None:
    """Input keeps it from idling; the conductor ends it at max_call_duration_s, and the
    client hears of it as the call's error."""
    await ws.send({"request_id": "long"})
    start = time.monotonic()

    async def keep_talking() -> None:
        while True:
            await asyncio.sleep(REQUEST_TIMEOUT_S * 0.4)
            await ws.send({"request_id": "long", "append": [audio(1280)]})

    talker = asyncio.get_running_loop().create_task(keep_talking())
    try:
        final = await ws.final("long", timeout=MAX_CALL_DURATION_S + 5)
    finally:
        talker.cancel()
    took = time.monotonic() - start
    assert final.get("status") == 408 and "max_call_duration_s" in final["error"], final
    assert MAX_CALL_DURATION_S * 0.9 <= took < MAX_CALL_DURATION_S + 2.0, took
