"""Open storms: many calls opened at once (a frontend restart, a network blip: clients
reconnect together) while others stream.

- A worker takes a call with no subscription of the call's own but its input: every call's
  abort and fin come on two subscriptions made once (each per call, in a storm, was made
  and dropped by the hundred); an end that came before the call was taken is found by the
  read at placement, which reads up to its barrier without a consumer.
- Through the real services: fifty openings at once on several sockets beside live calls,
  each admitted or refused by the rules (503 past max_concurrent_requests, 429 past a
  socket's share, 409 for a request_id in use), every admitted one answered, and the live
  calls' frames not held up beyond a loose bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.runtime.config import parse_config
from tests.support.bus import own_nats_server
from tests.support.poll import until


def subscriptions(w: WorkerService) -> set[str]:
    """The worker connection's subscriptions (nats-py's own list, read for the count), but
    the reply inboxes its requests and reads share."""
    return {s.subject for s in w.bus._nc._subs.values() if not s.subject.startswith("_INBOX.")}


@pytest.fixture
async def worker() -> AsyncIterator[WorkerService]:
    """An echo worker of both partitions in this process, on a server of its own (no
    conductor: the test assigns the calls)."""
    with own_nats_server("duplexbus-storm-worker-") as server:
        stop = asyncio.Event()
        w = WorkerService(parse_config({"nats_url": server.url, "shutdown_drain_s": 0.1}), "echo")
        run = asyncio.create_task(w.run(stop))
        try:
            up = lambda: w._bus is not None and w.bus.is_connected and subjects.fin("*") in subscriptions(w)  # noqa: E731
            await until(up, 20, "the worker subscribed")
            yield w
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)


async def test_a_worker_takes_calls_with_their_input_subscriptions_alone_and_hears_their_ends(worker: WorkerService) -> None:
    w = worker
    before = subscriptions(w)
    assert {subjects.abort("*"), subjects.fin("*")} <= before
    cids = [subjects.new_cid() for _ in range(20)]
    # One call's abort is stored before the worker takes it (its assignment came late).
    await w.bus.store(subjects.abort(cids[0]), wire.encode(wire.Abort(reason="the client left", status=499)))
    for cid in cids:
        assert (await w.assignment.answer(wire.encode(wire.Assign(cid=cid, model="echo", partitions=["Encoder", "Talker"])))).ok
    # Echo's Talker takes the Encoder's edge in this process: the client stream is the one subscription.
    assert subscriptions(w) - before <= {subjects.consumed(cid, "audio_in") for cid in cids}
    await until(lambda: cids[0] not in w.calls, 5, "the call aborted before it was taken let go")  # its placement read
    # Ends published after the calls were taken come on the worker's own subscriptions.
    await w.bus.store(subjects.fin(cids[1]), wire.encode(wire.Fin(status=200, reason="completed")))
    await w.bus.store(subjects.abort(cids[2]), wire.encode(wire.Abort(reason="aborted", status=499)))
    await w.bus.store(subjects.fin(subjects.new_cid()), wire.encode(wire.Fin(status=200, reason="completed")))  # not here
    await until(lambda: cids[1] not in w.calls and cids[2] not in w.calls, 5, "the ended calls let go")
    assert set(w.calls) == set(cids[3:])
    assert not any(cid in w.runners[p].engine for p in ("Encoder", "Talker") for cid in cids[:3])
    live = {subjects.consumed(cid, "audio_in") for cid in cids[3:]}
    await until(lambda: subscriptions(w) - before == live, 5, "the ended calls' input subscriptions ended")
