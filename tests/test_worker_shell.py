"""The worker shell's own rules that need no bus."""

from __future__ import annotations

import pytest

from services.worker.service import WorkerService
from shared.runtime.config import parse_config
from shared.runtime.errors import ConfigError


def test_worker_capacity_is_the_smallest_partition_bound() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    assert w.capacity == 100
    w.runners["Talker"].engine.partition.capacity = lambda: 3  # type: ignore[method-assign]
    assert w.capacity == 3


def test_unknown_partition_is_refused_at_start() -> None:
    with pytest.raises(ConfigError) as e:
        WorkerService(parse_config({}), "echo", ["Nope"])
    assert e.value.key == "partition" and "'Nope'" in e.value.message and "Encoder, Talker" in e.value.message


async def test_a_partition_added_during_a_catch_up_read_gets_its_input_read_too() -> None:
    import asyncio

    from services.worker.service import _Assigned

    w = WorkerService(parse_config({}), "echo")
    reads: list[list[str]] = []
    starts: list[bool] = []
    gate = asyncio.Event()

    async def catch_up(call: _Assigned, edges: list[str], placed: bool) -> None:
        reads.append(edges)
        starts.append(placed)
        await gate.wait()

    w._catch_up = catch_up  # type: ignore[method-assign]
    call = _Assigned("c", ["Encoder"])
    w._start_catch_up(call)
    first = call.catchup
    await asyncio.sleep(0)
    w._start_catch_up(call)  # nothing new: the running read covers it
    assert call.catchup is first
    call.partitions.append("Talker")  # placed here while the first read still runs
    w._start_catch_up(call)
    await asyncio.sleep(0)
    assert first is not None and first.cancelled()
    assert reads == [["audio_in"], ["audio_in", "frames"]]
    assert starts == [True, True]  # new subscriptions both times: from the start, behind a barrier
    gate.set()
    await asyncio.sleep(0)
    call.read_to = 120  # what the read read to
    w._start_catch_up(call)  # a repair: the same edges
    await asyncio.sleep(0)
    assert starts == [True, True, False] and call.read_to == 120  # read on from where the last read ended
    await w.tasks.close()


def test_a_stopping_worker_has_no_free_slots() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    w._accepting = False  # what run() sets on SIGTERM, before its drain
    assert w.capacity == 0
