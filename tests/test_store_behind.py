"""End-of-call messages are stored behind the step loop (shared.bus.store_behind.StoreBehind).

The queue's own rules with a hand-made publisher; then a worker against a real nats-server
that stops answering (SIGSTOP) just as a call's done is due: the worker's steps go on, and
the done is stored once the server answers again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from services.worker import engine as eng
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.bus.store_behind import StoreBehind
from shared.runtime.config import parse_config
from tests.support.bus import own_nats_server


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
    await asyncio.sleep(0.01)
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
            raise TimeoutError

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
            await w._assign(wire.Assign(cid="c1", model="echo", partitions=["Talker"]))
            assert "c1" in w.calls
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                w.runners["Talker"].engine.drop_call("c1")  # as the engine does when it emits the done
                t0 = time.monotonic()
                await w._carry_out([eng.PublishDone("c1", 0, {"frames": 0})], "Talker")
                assert time.monotonic() - t0 < 0.5  # the step loop does not wait for the ack
                assert len(w.ends) == 1
                await asyncio.sleep(6)  # past the publish's own timeout: it fails, and is sent again
                assert not run.done(), "the worker ended while the server was stopped"
                assert "c1" in w.calls  # not let go before its done is stored
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            for _ in range(200):
                if "c1" not in w.calls:
                    break
                await asyncio.sleep(0.05)
            assert "c1" not in w.calls and len(w.ends) == 0
            assert w.ends.retries >= 1
            stored = await w.bus.last_stored(subjects.done("c1", "Talker"))
            assert wire.decode_as(stored, wire.Done).usage == {"frames": 0}
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)
