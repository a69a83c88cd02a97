"""What the worker's parts share: the worker's id, connection, engines and metrics
(`Context`), each partition's engine with what its stepper needs (`Runner`), each assigned
call's subscriptions and reads (`AssignedCall`), and the signal that held input was freed
(`Freed`). No bus I/O here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from services.worker import engine as eng
from shared.bus.connection import BusConnection, BusSubscription
from shared.runtime.metrics import WorkerMetrics

Took = tuple[list[eng.Action], str]  # what an engine made of one input (actions to carry out, partition)
CarryOut = Callable[[list[eng.Action], str], Coroutine[Any, Any, None]]  # the stepper's: publish actions of a partition
BusOf = Callable[[], BusConnection]  # the service's connection, once it has opened one


@dataclass
class AssignedCall:
    cid: str
    partitions: list[str]
    binary: bool = False  # its client reads msgpack: its outputs are published packed (wire.pack_event)
    read_after: int = 0  # nothing of it is stored at or before this stream sequence (wire.Assign.read_after)
    inputs: dict[str, BusSubscription] = field(default_factory=dict)  # edge -> live input (none while paused)
    catchups: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # partition -> the read InputReads last started


class Freed:
    """Wakes every task waiting on it at the next fire() (steps free room for reads)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0

    async def wait(self, timeout: float) -> None:
        event = self._event
        self._waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:
            self._waiting -= 1

    def fire(self) -> None:
        if self._waiting:
            self._event.set()
            self._event = asyncio.Event()


class Runner:
    """One engine, and what the task that steps it waits on."""

    def __init__(self, engine: eng.Engine, blocking: bool) -> None:
        self.engine = engine
        self.blocking = blocking  # run step() in a thread so bus I/O goes on meanwhile
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # partition state is not touched while a step runs in a thread


@dataclass(frozen=True)
class Context:
    """What every part of a worker uses (the service builds it once)."""

    worker_id: str
    bus_of: BusOf  # the service's connection, opened when it runs
    runners: dict[str, Runner]  # partition -> its engine
    metrics: WorkerMetrics
    binary_fields: tuple[str, ...] = ()  # the model's (Model.binary_fields)

    @property
    def bus(self) -> BusConnection:
        return self.bus_of()
