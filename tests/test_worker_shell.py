"""The worker shell's own rules that need no bus."""

from __future__ import annotations

from services.worker.service import WorkerService
from shared.runtime.config import parse_config
from shared.runtime.errors import ConfigError


def test_worker_capacity_is_the_smallest_partition_bound() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    assert w.capacity == 100
    w.runners["Talker"].engine.partition.capacity = lambda: 3  # type: ignore[method-assign]
    assert w.capacity == 3


def test_unknown_partition_is_refused_at_start() -> None:
    try:
        WorkerService(parse_config({}), "echo", ["Nope"])
    except ConfigError as e:  # `duplexbus worker --partition Nope`: a config error naming the key, exit 2
        assert "Nope" in str(e) and "Encoder" in str(e) and e.message.startswith("partition:")
    else:
        raise AssertionError("an unknown partition was accepted")


def test_a_stopping_worker_has_no_free_slots() -> None:
    w = WorkerService(parse_config({"worker_slots": 100}), "echo")
    w._accepting = False  # what run() sets on SIGTERM, before its drain
    assert w.capacity == 0
