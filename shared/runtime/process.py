"""What every service process shares: logging, signals, periodic work, the GC, owned tasks."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from shared.runtime.errors import BusError

log = logging.getLogger(__name__)


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child between fork and exec (`preexec_fn`): the kernel sends it SIGTERM when the
    process that started it dies, even by SIGKILL, so no child outlives its supervisor."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such call, nothing to do
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


LOG_FORMATS = ("text", "json")


def setup_logging(role: str, fmt: str | None = None) -> None:
    """Logs on stderr at $DUPLEXBUS_LOG (INFO), as text or, with `fmt="json"` (or
    $DUPLEXBUS_LOG_FORMAT=json), one JSON object a line: time, level, role, logger, message
    and the fields of `event()` lines (cid, request_id, status, ...), for a log pipeline."""
    fmt = fmt or os.environ.get("DUPLEXBUS_LOG_FORMAT", "text")
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "name": "logger", "asctime": "time"},
                static_fields={"role": role},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("DUPLEXBUS_LOG", "INFO").upper(), handlers=[handler], force=True)


def event(logger: logging.Logger, what: str, **fields: object) -> None:
    """One INFO line about a call (opened, placed, finished): `what k=v ...` as text, and the
    fields as their own keys in JSON logs."""
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    logger.info("%s %s", what, text, extra={"event": what, **fields})


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
        except BusError as e:  # the bus's own failures say enough in one line, each period
            log.error("%s failed: %s", what, e)
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(max(0.0, period - (time.monotonic() - start)))


class TimeSlice:
    """Lets a task that finds its input always ready give the loop back now and then.

    Awaiting a queue that is not empty does not yield: a socket with 256 client messages
    read ahead is handled in one go. A fast upload's appends cost about a millisecond each
    on a small machine, so twenty fast uploads held a frontend's loop for 2 to 3 s at a
    time; its heartbeats, the conductor's ask, every other call's outputs waited, and the
    conductor took it for lost. `due()` after each piece of work yields once `slice_s` has
    passed since the task last did."""

    def __init__(self, slice_s: float = 0.005) -> None:
        self.slice_s = slice_s
        self._since = time.monotonic()

    async def due(self) -> None:
        now = time.monotonic()
        if now - self._since >= self.slice_s:
            await asyncio.sleep(0)
            self._since = time.monotonic()


STOP_GRACE_S = 5.0  # past a service's own drain: how long a stop may take before it is cut short


def stop_bound_s(drain_s: float) -> float:
    """The longest a service takes to stop once signalled: its drain, STOP_GRACE_S to end on
    its own, STOP_GRACE_S more once it is cut short; past that the process exits."""
    return drain_s + 2 * STOP_GRACE_S


def exit_after(seconds: float, what: str) -> threading.Timer:
    """A stop's last resort: unless cancelled, the process exits (status 1) `seconds` from now,
    from a thread of its own, so it does even where the event loop is stuck. The line that
    says so is written from yet another thread, waited on for a second at most: a stuck
    process may be stuck writing its log (a full pipe), holding the handler's lock."""

    def cut() -> None:
        said = threading.Thread(
            target=log.error, args=("%s still stopping %.0f s after the signal: exiting", what, seconds), daemon=True
        )
        said.start()
        said.join(1.0)
        os._exit(1)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    return timer


async def run_until_stopped(run: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event, grace_s: float) -> None:
    """Run `run(stop)` to its end. Once `stop` is set it has `grace_s` to finish on its own
    (drain, close); past that it is cancelled, and a service that does not end even then (a
    step stuck in a thread) ends the process: a stop signal always stops a service, NATS
    reachable or not."""
    task = asyncio.ensure_future(run(stop))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            log.warning("still stopping %.0f s after the signal: cutting it short", grace_s)
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_GRACE_S)
        if not task.done():
            log.error("did not stop when cancelled: exiting")
            logging.shutdown()
            os._exit(1)
    finally:
        stopped.cancel()
    if not task.cancelled():
        task.result()  # a service that failed ends the process with its error


def tune_gc() -> None:
    """After start-up: freeze what is loaded (modules, models) out of the cyclic collector,
    and collect less often. A full collection over every loaded object is a pause of tens
    of milliseconds in the middle of a call's frames."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 50)


RECANCEL_S = 0.5  # a task still running this long after its cancel is cancelled again


async def cancel_and_wait(*tasks: asyncio.Task[Any], report: bool = True) -> None:
    """Cancel tasks of ours and wait until each has ended. The caller's own cancellation goes
    on up (it is not taken for one of theirs), and a task that failed is logged (unless not
    `report`: the tasks report their own failures).

    nats-py swallows a CancelledError that comes while a publish flushes
    (`Client._flush_pending`): the task goes on as if it had never been cancelled, and a
    conductor's stop waited for ever on its janitor so. One still running RECANCEL_S after
    its cancel is cancelled again, until it ends."""
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        for t in pending:
            log.warning("task %s went on after it was cancelled: cancelling it again", t.get_name())
            t.cancel()
    for t in tasks if report else ():
        if not t.cancelled() and t.exception() is not None:
            log.error("a task failed as it was stopped", exc_info=t.exception())


class TaskSet:
    """Owns the tasks a service starts on the side (unsubscribing, catch-up reads, assignments):
    each is referenced until it ends (asyncio keeps only weak references), and `close()`
    cancels and awaits whatever is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, awaited: bool = False) -> asyncio.Task[Any]:
        """Start `coro` as a task of the set. Its failure is logged when it ends, unless
        `awaited`: the caller awaits the task and reports its failure itself (with what it
        knows of it)."""
        # Named by its coroutine ("ConductorService._assign"): what a failure's line says it was.
        task = asyncio.get_running_loop().create_task(coro, name=getattr(coro, "__qualname__", None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if not awaited:
            task.add_done_callback(_report_failure)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks, report=False)  # each reports its own failure (spawn)


def _report_failure(task: asyncio.Task[Any]) -> None:
    """Nobody awaits a side task: its failure is logged here, once, with its traceback, or it
    would be lost (asyncio says nothing of an exception never retrieved until the task is
    collected, if then). A cancel is how a task is stopped, not a failure."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.error("task %s failed", task.get_name(), exc_info=e)
