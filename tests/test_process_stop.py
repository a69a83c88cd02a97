"""A service's stop is bounded (shared.runtime.process.run_until_stopped): one that ends on
its own is left to, one that does not is cancelled after its grace, and one that does not
end even then ends the process (as `exit_after` does, the frontend's hard stop)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time

import pytest

from shared.runtime.process import TaskSet, cancel_and_wait, run_until_stopped
from tests.support import REPO
from tests.support.poll import until


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


def _run(code: str, timeout: float = 20.0) -> tuple[int, float, str]:
    """A Python process running `code`: (exit status, seconds it took, stderr)."""
    start = time.monotonic()
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return done.returncode, time.monotonic() - start, done.stderr


def test_a_service_that_ignores_its_cancellation_ends_the_process() -> None:
    """The last step of run_until_stopped: cancelled and still not done (a step stuck in a
    thread, a handler that swallows its cancellation), the process exits with status 1."""
    code, took, err = _run("""
        import asyncio
        from shared.runtime import process
        process.STOP_GRACE_S = 0.3

        async def deaf(stop):
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    pass  # will not stop

        async def main():
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.1, stop.set)
            await process.run_until_stopped(deaf, stop, grace_s=0.3)

        asyncio.run(main())
        print("returned")
        """)
    assert code == 1 and "did not stop when cancelled: exiting" in err, err
    assert took < 10


def test_a_hard_stop_ends_a_process_whose_loop_is_stuck() -> None:
    """process.exit_after (the frontend arms it on the stop signal): it exits from a thread of
    its own, so a loop stuck in a blocking call does not hold the process."""
    code, took, err = _run("""
        import time
        from shared.runtime.process import exit_after
        exit_after(1.0, "the test's process")
        time.sleep(60)  # the event loop's thread, stuck
        """)
    assert code == 1 and "the test's process still stopping 1 s after the signal: exiting" in err, err
    assert took < 10


async def test_cancelling_tasks_does_not_swallow_the_callers_own_cancellation() -> None:
    async def slow_tocancel_and_wait() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # takes a while to stop

    writer = asyncio.create_task(slow_tocancel_and_wait())
    await asyncio.sleep(0)
    after: list[str] = []

    async def handler() -> None:
        await cancel_and_wait(writer)
        after.append("went on")  # would run if cancel_and_wait swallowed the handler's cancellation

    h = asyncio.create_task(handler())
    await until(writer.cancelling, 5, "the handler cancelling its writer")  # and waiting for it to stop
    h.cancel()
    results = await asyncio.gather(h, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) and after == []
    await asyncio.gather(writer, return_exceptions=True)


async def test_a_task_that_swallows_its_cancel_is_cancelled_again_until_it_ends() -> None:
    """nats-py swallows a CancelledError that comes while a publish flushes; the task then goes
    on as if never cancelled. Before, a conductor's stop waited for ever on its janitor so."""
    cancels = 0

    async def janitor() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # as nats-py's Client._flush_pending does
                cancels += 1
                if cancels == 2:
                    raise

    tasks = TaskSet()
    t = tasks.spawn(janitor())
    await asyncio.sleep(0)
    started = time.monotonic()
    await asyncio.wait_for(tasks.close(), 5)
    assert t.cancelled() and cancels == 2 and time.monotonic() - started < 2


async def test_a_side_task_that_fails_is_logged_once_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def failing_side_task() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("a bug in a side task")

    tasks = TaskSet()
    tasks.spawn(failing_side_task())
    await until(lambda: len(tasks) == 0, 5.0, "the failed task gone from its set")
    await tasks.close()
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 1, [r.getMessage() for r in failed]
    # by the set, when it ends (not by asyncio's "never retrieved" when collected, if ever)
    assert failed[0].name == "shared.runtime.process" and "failing_side_task" in failed[0].getMessage()
    assert failed[0].exc_info is not None and "a bug in a side task" in str(failed[0].exc_info[1])


async def test_a_cancelled_or_awaited_side_task_is_not_logged_as_failed(caplog: pytest.LogCaptureFixture) -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def failing_write() -> None:
        raise RuntimeError("reported by whoever awaits it")

    tasks = TaskSet()
    tasks.spawn(forever())
    write = tasks.spawn(failing_write(), awaited=True)
    results = await asyncio.gather(write, return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    await tasks.close()  # cancels forever(): a stop, not a failure
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
