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


def test_a_stopping_worker_has_no_free_slots() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    w._accepting = False  # what run() sets on SIGTERM, before its drain
    assert w.capacity == 0


def test_the_worker_tells_its_repair_policy_which_edges_it_produces_itself() -> None:
    """Both echo partitions here: the Talker's frames come from the Encoder in this process
    (repair.InputReads.may_lose has the rule; tests/test_repair.py tests it)."""
    w = WorkerService(parse_config({}), "echo")
    for p in ("Encoder", "Talker"):
        w.intake.reads.subscribed("c", p, w.runners[p].engine.input_edges(), now=0.0)
    assert w.intake.reads.may_lose("c", "Encoder") and not w.intake.reads.may_lose("c", "Talker")
