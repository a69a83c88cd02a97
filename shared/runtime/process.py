"""What every service process shares: logging, signals, graceful shutdown, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.js.kv import KeyValue

from shared.runtime import health

log = logging.getLogger(__name__)


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("DUPLEXBUS_LOG", "INFO").upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


async def every(period: float, fn: Callable[[], Awaitable[None]], what: str) -> None:
    """Call `fn` every `period` seconds until cancelled; a failing call is logged, not fatal."""
    while True:
        start = time.monotonic()
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(max(0.0, period - (time.monotonic() - start)))


async def heartbeat(kv: KeyValue, key: str, payload: Callable[[], bytes], period: float) -> None:
    async def beat() -> None:
        await kv.put(key, payload())
        health.beat()  # stored: the conductor sees this process alive, and so may a healthcheck

    await every(period, beat, f"heartbeat {key}")


async def delete_quietly(kv: KeyValue, key: str) -> None:
    with contextlib.suppress(Exception):
        await kv.delete(key)


def tune_gc() -> None:
    """After start-up: freeze what is loaded (modules, models) out of the cyclic collector,
    and collect less often. A full collection over every loaded object is a pause of tens
    of milliseconds in the middle of a call's frames."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 50)


class TaskSet:
    """Owns the tasks a service starts on the side (unsubscribing, catch-up reads, assignments):
    each is referenced until it ends (asyncio keeps only weak references), and `close()`
    cancels and awaits whatever is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
