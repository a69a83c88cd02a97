"""End-of-call messages are stored behind the step loop (shared.bus.store_behind.StoreBehind).

The queue's own rules with a hand-made publisher; then a worker against a real nats-server
that stops answering (SIGSTOP) just as a call's done is due: the worker's steps go on, and
the done is stored once the server answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest

from services.worker import engine as eng
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.bus.store_behind import StoreBehind
from shared.runtime.config import parse_config
from shared.runtime.errors import BusDenied, BusError, BusRefused, BusTimeout, BusUnavailable
from tests.support.bus import own_nats_server
from tests.support.freeze import frozen
from tests.support.poll import until


async def test_messages_are_stored_in_order_and_then_runs_after_its_store() -> None:
    log: list[str] = []
    gate = asyncio.Event()

    async def publish(subject: str, body: bytes) -> None:
        log.append(f"pub {subject}")
        await gate.wait()  # the acks come back only later

    async def then() -> None:
        log.append("then b")

    store = StoreBehind(publish)
    task = asyncio.create_task(store.run())
    store.put("a", b"1")
    store.put("b", b"2", then)
    store.put("c", b"3")
    assert len(store) == 3
    await until(lambda: len(log) == 3, 5, "three publishes")
    assert log == ["pub a", "pub b", "pub c"]  # written at once, in order, acks awaited together
    assert len(store) == 3  # not stored yet
    gate.set()
    for _ in range(100):
        if not len(store):
            break
        await asyncio.sleep(0.01)
    assert log[-1] == "then b" and len(store) == 0
    task.cancel()


async def test_a_message_not_stored_is_sent_again_until_it_is() -> None:
    tries: dict[str, int] = {}

    async def publish(subject: str, body: bytes) -> None:
        tries[subject] = tries.get(subject, 0) + 1
        if subject == "flaky" and tries[subject] < 3:
            raise BusTimeout(f"storing {subject}", "no answer in time")  # as store_once says a late ack

    stored = asyncio.Event()

    async def then() -> None:
        stored.set()

    store = StoreBehind(publish, max_pause_s=0.05)
    task = asyncio.create_task(store.run())
    store.put("flaky", b"x", then)
    store.put("fine", b"y")
    await asyncio.wait_for(stored.wait(), 5)
    assert tries == {"flaky": 3, "fine": 1}  # only the one that failed is sent again
    assert store.retries == 2 and len(store) == 0
    task.cancel()


async def test_a_worker_goes_on_stepping_while_a_done_waits_on_a_stopped_server() -> None:
    """SIGSTOP: the server keeps its connections but answers nothing for longer than a
    JetStream publish waits (5 s). Before, the step loop awaited the done's ack: its steps
    stopped, and the timeout then ended the worker."""
    with own_nats_server("duplexbus-store-behind-") as server:
        stop = asyncio.Event()
        w = WorkerService(parse_config({"nats_url": server.url}), "echo", ["Talker"])
        run = asyncio.create_task(w.run(stop))
        try:
            for _ in range(200):
                if w._bus is not None and w.bus.is_connected:
                    break
                await asyncio.sleep(0.05)
            await w.assignment.assign(wire.Assign(cid="c1", model="echo", partitions=["Talker"]))
            assert "c1" in w.calls
            assert server.proc is not None
            # Returns once the kernel has stopped it: a done sent before that was once stored and
            # its call let go (a fresh-clone run of the suite under load).
            with frozen(server.proc.pid):
                w.runners["Talker"].engine.drop_call("c1")  # as the engine does when it emits the done
                t0 = time.monotonic()
                await w.stepper.carry_out([eng.PublishDone("c1", 0, {"frames": 0})], "Talker")
                assert time.monotonic() - t0 < 0.5  # the step loop does not wait for the ack
                assert len(w.stepper.ends) == 1
                await asyncio.sleep(6)  # past the publish's own timeout: it fails, and is sent again
                assert not run.done(), "the worker ended while the server was stopped"
                assert "c1" in w.calls  # not let go before its done is stored
            for _ in range(200):
                if "c1" not in w.calls:
                    break
                await asyncio.sleep(0.05)
            assert "c1" not in w.calls and len(w.stepper.ends) == 0
            assert w.stepper.ends.retries >= 1
            stored = await w.bus.last_stored(subjects.done("c1", "Talker"))
            assert wire.decode_as(stored, wire.Done).usage == {"frames": 0}
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)


async def _until(done: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    "refusal", [BusDenied("storing bad", "permissions violation"), BusRefused("storing bad", "storage full")]
)
async def test_a_message_refused_for_good_fails_alone_and_does_not_hold_up_later_ones(
    refusal: BusError, caplog: pytest.LogCaptureFixture
) -> None:
    tries: dict[str, int] = {}
    told: list[tuple[str, Exception]] = []
    stored: list[str] = []

    async def publish(subject: str, body: bytes) -> None:
        tries[subject] = tries.get(subject, 0) + 1
        if subject == "bad":
            raise refusal

    def owner(subject: str) -> tuple[Callable[[], Awaitable[None]], Callable[[Exception], Awaitable[None]]]:
        async def then() -> None:
            stored.append(subject)

        async def failed(e: Exception) -> None:
            told.append((subject, e))

        return then, failed

    store = StoreBehind(publish, max_pause_s=0.01)
    task = asyncio.create_task(store.run())
    try:
        store.put("before", b"", *owner("before"))
        store.put("bad", b"", *owner("bad"))
        store.put("same-batch", b"", *owner("same-batch"))
        await _until(lambda: len(store) == 0)
        store.put("later", b"", *owner("later"))
        await _until(lambda: len(store) == 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert tries["bad"] == 1  # not sent again: it would be refused again, for ever
    assert told == [("bad", refusal)] and stored == ["before", "same-batch", "later"]
    assert store.failures == 1 and store.retries == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "bad not stored" in said[0], said


async def test_a_publish_that_fails_with_a_bug_is_logged_with_its_traceback_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    tries = 0

    async def publish(subject: str, body: bytes) -> None:
        nonlocal tries
        tries += 1
        raise RuntimeError("a bug in the publish")

    store = StoreBehind(publish, max_pause_s=0.01)
    task = asyncio.create_task(store.run())
    try:
        store.put("x", b"")
        await _until(lambda: len(store) == 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert tries == 1 and store.failures == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None


async def test_recoverable_failures_keep_the_order_and_log_the_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    """While the server is away every try fails; later messages wait behind the first (the
    order is kept), and the outage is one warning and one line when it ends, not one a try."""
    caplog.set_level(logging.INFO)
    away = True
    order: list[str] = []

    async def publish(subject: str, body: bytes) -> None:
        if away:
            raise BusUnavailable(f"storing {subject}", "no server")

    async def then_of(subject: str) -> None:
        order.append(subject)

    store = StoreBehind(publish, max_pause_s=0.005)
    task = asyncio.create_task(store.run())
    try:
        store.put("first", b"", lambda: then_of("first"))
        await _until(lambda: store.retries >= 5)
        store.put("second", b"", lambda: then_of("second"))
        await _until(lambda: store.retries >= 10)
        assert order == []  # "second" waits behind "first"
        away = False
        await _until(lambda: len(store) == 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert order == ["first", "second"] and store.failures == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "no server" in warned[0], warned
    assert len([r for r in caplog.records if "works again" in r.getMessage()]) == 1
