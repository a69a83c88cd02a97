"""Retention never cuts a live call: the stream has no byte limit of its own, and the
conductor removes finished calls, oldest first, to keep it under `retention.max_bytes`;
past `retention.hard_max_bytes` it refuses new calls (503) and the live ones go on.

A long call runs on a stream whose max_bytes other calls fill many times over and that it
outgrows by itself; its worker is killed, and its replacement reads the call's input from
the stream, from item 0. Before, the stream had dropped the oldest messages (the long
call's start) by itself, and the replacement waited for item 0 forever: no finish, no
error."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats

from services.conductor import retention
from shared.bus import subjects
from tests.support.calls import EchoCall, stream_for
from tests.support.stack import Stack, running_stack

MAX_BYTES = 256 * 1024  # a background call of 40 frames puts about 0.3 MB through the stream
HARD_MAX_BYTES = 1024 * 1024  # the long call alone (150 frames) outgrows it
CONFIG = {
    "model": "echo",
    "retention": {"max_bytes": MAX_BYTES, "hard_max_bytes": HARD_MAX_BYTES},
    "placement_timeout_s": 20,
}


async def _stream(stack: Stack) -> tuple[int, int]:
    """(bytes the stream holds, finished calls it holds: their fins)."""
    nc = await nats.connect(stack.nats_url)
    try:
        info = await nc.jetstream().stream_info(subjects.STREAM, subjects_filter=subjects.fin("*"))
        return int(info.state.bytes), len(info.state.subjects or {})
    finally:
        await nc.close()


async def _finished_calls_removed(stack: Stack, long: EchoCall) -> None:
    """Until the stream holds no finished call, the long call streaming meanwhile: slowly, two
    frames a second. It must stay under hard_max_bytes until its last frames: at 12.5 a second
    it had sent most of its 150 by the second group on a slow run, and that group, refused
    until it ended, failed."""
    deadline = time.monotonic() + retention.GRACE_S + 15
    while (await _stream(stack))[1] and time.monotonic() < deadline:
        await stream_for([long], 0.5, frames_per_s=2)
    assert (await _stream(stack))[1] == 0, stack.logs()
    await stream_for([long], 1.5, frames_per_s=2)  # the janitor's next round has seen it


def _stream_full(final: dict[str, Any]) -> bool:
    return final.get("status") == 503 and "hard_max_bytes" in final.get("error", "")


async def _background_call(stack: Stack, rid: str, seed: int) -> None:
    """A call of the load. Six at once outgrow hard_max_bytes for a moment: when they open
    slower than the conductor's round (a busy machine), the last are refused as the stream is
    full, rightly; such a call is tried again once the janitor has made room, as a client would.

    It waits past the janitor's grace before it tries again. A refused call's input is in the
    stream too (sent before the refusal came), and a finished call stays there for GRACE_S: two
    callers trying again every second kept the stream over hard_max_bytes with their refused
    calls alone, 30 times in a row, on a loaded run (the long call, the only live one, held
    0.2 MB)."""
    for attempt in range(REFUSALS):
        call = await EchoCall.open(stack.ws_url(), f"{rid}-r{attempt}", frames=40, seed=seed)
        final = await call.end()
        if not _stream_full(final):
            call.check(final, stack.logs())
            await call.ws.close()
            return
        await call.ws.close()
        await asyncio.sleep(retention.GRACE_S + 1.0)
    raise AssertionError(f"{rid}: refused as the stream is full {REFUSALS} times\n{stack.logs()}")


REFUSALS = 5


async def test_a_long_call_outlives_retention_and_its_worker(nats_url: str) -> None:
    async with running_stack(nats_url, CONFIG, workers=[["Encoder"], ["Talker"], ["Encoder"], ["Talker"]]) as stack:
        long = await EchoCall.open(stack.ws_url(), "long", frames=150)
        await stream_for([long], 1.0)
        await long.echoed(5)
        for group in range(2):  # 12 x 0.3 MB: max_bytes filled 14 times over
            await asyncio.gather(*(_background_call(stack, f"bg-{group}-{i}", seed=i + 1) for i in range(6)))
            await _finished_calls_removed(stack, long)
        busy = await stack.workers_of_live_calls()
        stack.procs[busy["Encoder"]].kill()  # its twin reads the long call's input from item 0
        await long.send(long.frames)
        await long.echoed(long.frames - 1)
        held = (await _stream(stack))[0]
        assert held > HARD_MAX_BYTES, held
        await stream_for([long], 1.5)  # the janitor's next round
        refused = await EchoCall.open(stack.ws_url(), "refused", frames=1)
        final = await refused.ws.final("refused")
        assert _stream_full(final), final
        await long.finish(timeout=30, logs=stack.logs())
