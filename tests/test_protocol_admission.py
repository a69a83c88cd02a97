"""Admission through the real services: at `max_concurrent_requests` a live call is refused
with 503 at once, a one-shot waits in a bounded FIFO (`max_queued_requests`) with its input
in JetStream, and a closed socket's calls free their slots."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import nats
import numpy as np
import pytest

from models.echo import FRAME
from services.conductor import core
from shared.bus import subjects, wire
from shared.runtime.config import parse_config
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import conductor_status, until_call_records
from tests.support.client import WS, nothing_for
from tests.support.poll import until
from tests.support.stack import Stack, running_stack

# One socket here holds every slot and the queue: its share (max_calls_per_socket, a quarter
# of the slots by default) is raised to let it.
CONFIG = {"model": "echo", "max_concurrent_requests": 2, "max_queued_requests": 2, "max_calls_per_socket": 8}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


def _by_rid(records: dict[str, wire.CallRecord]) -> dict[str, wire.CallRecord]:
    return {r.request_id: r for r in records.values()}


async def until_records(
    nats_url: str, pred: Callable[[dict[str, wire.CallRecord]], bool], timeout: float = 10.0
) -> dict[str, wire.CallRecord]:
    """The call records by request_id once `pred` holds of them."""
    return _by_rid(await until_call_records(nats_url, lambda rs: pred(_by_rid(rs)), timeout))


@pytest.fixture
async def idle(stack: Stack) -> AsyncIterator[None]:
    """Each test starts with no call in the conductor (the last test's aborts processed). The
    conductor is asked, not only its records listed: a listing is a watch, which can come back
    empty on a busy server, and that once let a test start beside the last one's live calls."""

    async def quiet() -> bool:
        status = await conductor_status(stack.nats_url)
        return bool(status["live_calls"] == 0 and status["queued"] == 0)

    await until(quiet, 10.0, "the conductor without calls of an earlier test")
    await until_records(stack.nats_url, lambda r: not r)
    yield


def frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9000, 9000, n * FRAME).astype("<i2")


async def admitted(ws: WS, rid: str) -> None:
    """Opens live call `rid` and waits for its first output: it holds a slot."""
    await ws.send({"request_id": rid})
    await ws.send({"request_id": rid, "append": [pcm_file(frames(1, 0))]})
    first = await ws.until(lambda m: m.get("request_id") == rid and ("output" in m or "error" in m), keep=True)
    assert "output" in first, first


async def end(ws: WS, rid: str) -> None:
    await ws.send({"request_id": rid, "end_input": True})
    assert "finish" in await ws.final(rid)
    ws.outputs(rid)


async def test_live_call_at_the_cap_is_refused_with_503_at_once(stack: Stack, idle: None) -> None:
    ws = await WS.connect(stack.ws_url())
    await admitted(ws, "l1")
    await admitted(ws, "l2")
    t = time.monotonic()
    await ws.send({"request_id": "l3"})
    m = await ws.final("l3", timeout=5)
    assert m.get("status") == 503 and "max_concurrent_requests" in m["error"], m
    assert time.monotonic() - t < 1.0
    await end(ws, "l1")  # the calls at the cap went on
    await end(ws, "l2")
    await ws.close()


async def test_one_shot_queues_in_a_bounded_fifo_with_its_input_in_jetstream(stack: Stack, idle: None) -> None:
    ws = await WS.connect(stack.ws_url())
    await admitted(ws, "l1")
    await admitted(ws, "l2")
    q1, q2 = frames(5, 1), frames(3, 2)
    await ws.send({"request_id": "q1", "files": [pcm_file(q1)], "end_input": True})
    await ws.send({"request_id": "q2", "files": [pcm_file(q2)], "end_input": True})
    records = await until_records(stack.nats_url, lambda r: "q1" in r and "q2" in r)
    assert records["q1"].state == records["q2"].state == "queued"
    assert not records["q1"].placement and not records["q1"].live
    # Its input is in the stream, not held by any process: every item, before any worker has the call.
    nc = await nats.connect(stack.nats_url)
    try:
        for rid, n in (("q1", 5), ("q2", 3)):
            info = await nc.jetstream().stream_info(subjects.STREAM, subjects_filter=subjects.call_all(records[rid].cid))
            held = info.state.subjects or {}
            assert held.get(subjects.input_(records[rid].cid, "audio_in")) == n, held
            assert held.get(subjects.eoi(records[rid].cid, "audio_in")) == 1, held
    finally:
        await nc.close()
    t = time.monotonic()
    await ws.send({"request_id": "q3", "files": [pcm_file(frames(1, 3))], "end_input": True})
    m = await ws.final("q3", timeout=5)
    assert m.get("status") == 503 and "max_queued_requests" in m["error"], m
    assert time.monotonic() - t < 1.0
    async with httpx.AsyncClient(base_url=stack.http_url(), timeout=10) as client:  # POST: a line, not a status
        r = await client.post("/generate", json={"files": [pcm_file(frames(1, 3))]})
        assert r.status_code == 200
        line = json.loads(r.text.splitlines()[-1])
        assert line["status"] == 503 and "max_queued_requests" in line["error"] and line["request_id"] is None
    await ws.send({"request_id": "l3"})  # a live call is still refused at once
    assert (await ws.final("l3", timeout=5)).get("status") == 503
    await nothing_for(ws, lambda m: m.get("request_id") in ("q1", "q2"), 1.0)  # nothing ran yet

    await end(ws, "l1")  # one slot: q1 first, then q2 once q1 is done
    order = []
    for _ in range(2):
        m = await ws.until(lambda m: m.get("request_id") in ("q1", "q2") and ("finish" in m or "error" in m))
        assert "finish" in m, m
        order.append(m["request_id"])
    assert order == ["q1", "q2"]
    assert echo_bytes(ws.outputs("q1")) == q1.tobytes()
    assert echo_bytes(ws.outputs("q2")) == q2.tobytes()
    await end(ws, "l2")
    await ws.close()


async def test_closed_socket_aborts_its_calls_and_frees_their_slots(stack: Stack, idle: None) -> None:
    ws = await WS.connect(stack.ws_url())
    await admitted(ws, "b1")
    await admitted(ws, "b2")
    await ws.send({"request_id": "bq", "files": [pcm_file(frames(2, 4))], "end_input": True})  # queued
    await until_records(stack.nats_url, lambda r: r.get("bq") is not None and r["bq"].state == "queued")
    await ws.close()
    closed = time.monotonic()

    other = await WS.connect(stack.ws_url())
    # The closed socket's calls are gone from the conductor, their slots free, within a second.
    await until_records(stack.nats_url, lambda r: not {"b1", "b2", "bq"} & set(r), timeout=1.0)
    for rid in ("c1", "c2"):
        await other.send({"request_id": rid})
        await other.send({"request_id": rid, "append": [pcm_file(frames(1, 5))]})
    assert time.monotonic() - closed < 1.0
    for rid in ("c1", "c2"):
        m = await other.until(lambda m, rid=rid: m.get("request_id") == rid and ("output" in m or "error" in m))
        assert "output" in m, m  # admitted: the closed socket's slots were free
    # The closed socket's calls, the queued one too, are gone (listed until so: a listing can
    # come back empty on a busy server).
    await until_records(stack.nats_url, lambda r: set(r) == {"c1", "c2"})
    await end(other, "c1")
    await end(other, "c2")
    await other.close()


async def test_post_client_that_goes_away_ends_its_call(stack: Stack, idle: None) -> None:
    """A `POST /generate` client that leaves before its results: the call is dropped (here
    while queued) and never takes a slot."""
    ws = await WS.connect(stack.ws_url())
    await admitted(ws, "l1")
    await admitted(ws, "l2")
    async with httpx.AsyncClient(base_url=stack.http_url(), timeout=10) as client:
        body = {"request_id": "pq", "files": [pcm_file(frames(3, 6))]}
        async with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            await until_records(stack.nats_url, lambda r: r.get("pq") is not None and r["pq"].state == "queued")
        # out of the block: the connection is closed with the body unread
    await until_records(stack.nats_url, lambda r: "pq" not in r)
    await end(ws, "l1")
    await until_records(stack.nats_url, lambda r: "l1" not in r)
    await admitted(ws, "l3")  # the freed slot went to a new call, not to the one that left
    await until_records(stack.nats_url, lambda r: set(r) == {"l2", "l3"})
    await end(ws, "l2")
    await end(ws, "l3")
    await ws.close()


def test_queued_one_shot_takes_a_freed_slot_before_the_next_heartbeat() -> None:
    """The conductor's core alone: with workers exactly as big as the cap, a slot freed by a
    finished call is usable at once, so the queued one-shot runs instead of getting a 503
    while the workers' last heartbeats still say they are full."""
    c = core.Conductor(parse_config({"max_concurrent_requests": 2, "max_queued_requests": 1}))

    def hb(worker: str, partition: str, load: int) -> core.WorkerSeen:
        return core.WorkerSeen(
            wire.WorkerHeartbeat(
                worker_id=worker,
                model="echo",
                partitions=[partition],
                model_partitions=["Encoder", "Talker"],
                capacity=2,
                load=load,
                ts=0.0,
            )
        )

    def opened(cid: str, live: bool) -> core.Opened:
        msg = wire.Open(
            cid=cid, request_id=cid, model="echo", frontend_id="fe", open_streams=["audio_in"] if live else [], live=live
        )
        return core.Opened(msg, 0.0)

    workers = [("w1", "Encoder"), ("w2", "Talker")]
    for w, p in workers:
        c.handle(hb(w, p, 0))
    for cid in ("a", "b"):
        for act in c.handle(opened(cid, live=True)):
            assert not isinstance(act, core.PublishFin), act
            if isinstance(act, core.SendAssign):
                c.handle(core.AssignResult(cid, act.worker_id, tuple(act.msg.partitions), True))
    for w, p in workers:
        c.handle(hb(w, p, 2))  # each worker reports both calls: full
    c.handle(opened("q", live=False))
    assert c.calls["q"].state is core.CallState.QUEUED
    c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0)))
    actions = c.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w2", outputs=0)))
    assert [a.msg.status for a in actions if isinstance(a, core.PublishFin)] == [200]  # a's finish, no 503 for q
    assert sorted(a.worker_id for a in actions if isinstance(a, core.SendAssign)) == ["w1", "w2"]
