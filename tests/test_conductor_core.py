"""The conductor's pure core: admission, placement, completion, liveness, recovery."""

from __future__ import annotations

from typing import Any

from services.conductor import core
from shared.bus import wire
from shared.runtime.config import parse_config

PARTS = ["Encoder", "Talker"]


def conductor(**cfg: object) -> core.Conductor:
    return core.Conductor(parse_config({"max_concurrent_requests": 2, "max_queued_requests": 1, **cfg}))


def hb(worker: str, parts: list[str], capacity: int = 10, load: int = 0) -> core.WorkerSeen:
    return core.WorkerSeen(
        wire.WorkerHeartbeat(
            worker_id=worker,
            model="echo",
            partitions=parts,
            model_partitions=PARTS,
            capacity=capacity,
            load=load,
            ts=0.0,
        )
    )


def opened(cid: str, live: bool = True, now: float = 0.0) -> core.Opened:
    msg = wire.Open(
        cid=cid,
        request_id=f"r{cid}",
        model="echo",
        frontend_id="fe1",
        open_streams=["audio_in"] if live else [],
        live=live,
    )
    return core.Opened(msg, now)


def assigns(actions: list[core.Action]) -> dict[str, list[str]]:
    return {a.worker_id: a.msg.partitions for a in actions if isinstance(a, core.SendAssign)}


def fins(actions: list[core.Action]) -> list[wire.Fin]:
    return [a.msg for a in actions if isinstance(a, core.PublishFin)]


def ack_all(c: core.Conductor, cid: str, actions: list[core.Action]) -> None:
    for a in actions:
        if isinstance(a, core.SendAssign):
            c.handle(core.AssignResult(cid, a.worker_id, tuple(a.msg.partitions), True))


def test_places_each_partition_on_the_worker_with_most_free_slots() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS, capacity=10, load=8))
    c.handle(hb("w2", ["Encoder"], capacity=10, load=1))
    c.handle(hb("w3", ["Talker"], capacity=4, load=0))
    acts = c.handle(opened("a"))
    assert assigns(acts) == {"w2": ["Encoder"], "w3": ["Talker"]}


def test_live_call_at_the_cap_is_refused_at_once_and_one_shot_queues() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    for cid in ("a", "b"):
        ack_all(c, cid, c.handle(opened(cid)))
    refused = fins(c.handle(opened("c", live=True)))
    assert refused and refused[0].status == 503 and "max_concurrent_requests" in (refused[0].error or "")
    queued = c.handle(opened("d", live=False))
    assert not fins(queued) and not assigns(queued) and list(c.queue) == ["d"]
    over = fins(c.handle(opened("e", live=False)))
    assert over[0].status == 503 and "max_queued_requests" in (over[0].error or "")
    # a slot frees: the queued one-shot is placed
    acts = c.handle(core.AbortRequested("a", "socket closed", 499))
    assert fins(acts)[0].status == 499
    assert assigns(acts) == {"w1": PARTS} and not c.queue


def test_finish_when_every_partition_is_done() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    ack_all(c, "a", c.handle(opened("a")))
    c.handle(core.InputEnded("a", "audio_in", 5))
    assert c.calls["a"].state is core.CallState.INPUT_ENDED
    first = c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0, usage={})))
    assert not fins(first)
    again = c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0, usage={})))
    assert again == []  # a redelivered done changes nothing
    last = c.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w1", outputs=5, usage={"frames": 5})))
    f = fins(last)[0]
    assert (f.status, f.reason, f.usage, f.outputs) == (200, "completed", {"frames": 5}, {"Encoder": 0, "Talker": 5})
    assert f.usage_by_partition == {"Encoder": {}, "Talker": {"frames": 5}}
    assert any(isinstance(a, core.DeleteRecord) for a in last) and "a" not in c.calls


def test_usage_is_merged_by_meaning_not_added() -> None:
    """A one-turn voice call: the Listener and the Talker each count the one turn. Before, the
    finish said turns: 2."""
    by_partition: dict[str, dict[str, Any]] = {
        "Listener": {"turns": 1, "seconds": 4.2},
        "Talker": {"turns": 1, "audio_s": 1.5},
        "Recognizer": {"turns": 1},
    }
    assert core.merge_usage(by_partition) == {"turns": 1, "seconds": 4.2, "audio_s": 1.5}
    assert core.merge_usage({"A": {"frames": 3, "tag": "x"}, "B": {"frames": 5, "tag": "y"}}) == {"frames": 5, "tag": "x"}


def test_no_free_worker_is_503_but_no_worker_at_all_waits_then_503() -> None:
    c = conductor(placement_timeout_s=5)
    c.handle(hb("w1", PARTS, capacity=1, load=1))
    assert fins(c.handle(opened("full")))[0].status == 503
    c2 = conductor(placement_timeout_s=5)
    acts = c2.handle(opened("early", now=100.0))
    assert not fins(acts) and c2.calls["early"].state is core.CallState.WAITING
    placed = c2.handle(hb("w1", PARTS))  # a worker appears: the waiting call is placed
    assert assigns(placed) == {"w1": PARTS}
    c3 = conductor(placement_timeout_s=5)
    c3.handle(opened("never", now=100.0))
    assert not fins(c3.handle(core.Tick(104.0)))
    assert fins(c3.handle(core.Tick(106.0)))[0].status == 503


def test_a_lost_worker_gets_no_new_calls_and_its_partitions_are_replaced() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    c.handle(hb("w2", PARTS, load=5))
    ack_all(c, "a", c.handle(opened("a")))
    assert set(c.calls["a"].placement.values()) == {"w1"}
    acts = c.handle(core.WorkerLost("w1"))
    assert assigns(acts) == {"w2": PARTS}  # re-placed: the new worker replays the input from the stream
    assert "w1" not in c.workers
    assert assigns(c.handle(opened("b"))) == {"w2": PARTS}


def test_frontend_lost_aborts_its_calls() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    ack_all(c, "a", c.handle(opened("a")))
    acts = c.handle(core.FrontendLost("fe1"))
    assert any(isinstance(a, core.PublishAbort) for a in acts)
    assert fins(acts)[0].status == 499 and not c.calls


def test_max_call_duration() -> None:
    c = conductor(max_call_duration_s=10)
    c.handle(hb("w1", PARTS))
    ack_all(c, "a", c.handle(opened("a", now=1000.0)))
    assert not fins(c.handle(core.Tick(1009.0)))
    f = fins(c.handle(core.Tick(1011.0)))[0]
    assert f.status == 408 and "max_call_duration_s" in (f.error or "")


def test_refused_assignment_fails_the_call() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    c.handle(opened("a"))
    acts = c.handle(core.AssignResult("a", "w1", tuple(PARTS), False, "full"))
    assert fins(acts)[0].status == 503


def test_a_refusal_from_a_worker_the_call_has_left_is_ignored() -> None:
    """w1 is lost before its assignment failed (it was asked again and again meanwhile: no
    responders); the call is on w2 now, and w1's late failure must not end it."""
    c = conductor()
    c.handle(hb("w1", PARTS))
    c.handle(opened("a"))
    c.handle(hb("w2", PARTS))
    c.handle(core.WorkerLost("w1"))
    assert set(c.calls["a"].placement.values()) == {"w2"}
    assert fins(c.handle(core.AssignResult("a", "w1", tuple(PARTS), False, "no responders"))) == []
    assert "a" in c.calls and c.calls["a"].state is not core.CallState.FINISHED


DRAINING = "worker is shutting down"  # services/worker/assignment.py's words, as a worker of any release sends them


def test_a_worker_that_refuses_as_draining_hands_the_call_to_another_worker() -> None:
    """Placed on w1 in the instant after its SIGTERM, before its heartbeat said so: w1 refuses,
    and the call goes to w2 instead of ending with 503. Before, it ended."""
    c = conductor()
    c.handle(hb("w1", PARTS, capacity=10))
    c.handle(hb("w2", PARTS, capacity=5))
    assert assigns(c.handle(opened("a"))) == {"w1": PARTS}
    acts = c.handle(core.AssignResult("a", "w1", tuple(PARTS), False, DRAINING))
    assert not fins(acts) and assigns(acts) == {"w2": PARTS}
    assert c.calls["a"].placement == {"Encoder": "w2", "Talker": "w2"} and "a" not in c.workers["w1"].calls
    ack_all(c, "a", acts)
    assert c.calls["a"].state is core.CallState.RUNNING
    # Until its next heartbeat, w1 gets no new call either.
    assert assigns(c.handle(opened("b"))) == {"w2": PARTS}
    c.handle(core.InputEnded("a", "audio_in", 1))
    c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w2", outputs=0)))
    done = fins(c.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w2", outputs=1))))
    assert done[0].status == 200


def test_a_busy_refusal_asks_each_worker_once_then_refuses_as_usual() -> None:
    """Every worker refuses as full (their heartbeats lagged): the call is not bounced between
    them, it ends with the usual 503 once each was asked once."""
    c = conductor()
    c.handle(hb("w1", PARTS, capacity=10))
    c.handle(hb("w2", PARTS, capacity=5))
    c.handle(opened("a"))
    to_w2 = c.handle(core.AssignResult("a", "w1", tuple(PARTS), False, "worker w1 is full (10 calls)"))
    assert assigns(to_w2) == {"w2": PARTS}
    c.handle(hb("w1", PARTS, capacity=10))  # a heartbeat offering slots again: still not asked twice
    ended = c.handle(core.AssignResult("a", "w2", tuple(PARTS), False, "worker w2 is full (5 calls)"))
    assert not assigns(ended)
    f = fins(ended)[0]
    assert f.status == 503 and "no worker can take" in (f.error or "") and "a" not in c.calls
    assert not c.workers["w1"].calls and not c.workers["w2"].calls  # no slot kept for it


def test_a_busy_refusal_moves_only_the_refused_partitions() -> None:
    """Encoder runs on w1; Talker, placed on w2 as it began to drain, goes to w3. w1 keeps its
    partition and its slot."""
    c = conductor()
    c.handle(hb("w1", ["Encoder"], capacity=10))
    c.handle(hb("w2", ["Talker"], capacity=10))
    c.handle(hb("w3", ["Talker"], capacity=5))
    c.handle(opened("a"))
    c.handle(core.AssignResult("a", "w1", ("Encoder",), True))
    acts = c.handle(core.AssignResult("a", "w2", ("Talker",), False, DRAINING))
    assert assigns(acts) == {"w3": ["Talker"]} and not fins(acts)
    assert c.calls["a"].placement == {"Encoder": "w1", "Talker": "w3"} and "a" in c.workers["w1"].calls
    c.handle(core.AssignResult("a", "w3", ("Talker",), True))
    assert c.calls["a"].state is core.CallState.RUNNING


def test_a_busy_refusal_by_the_only_worker_is_the_usual_503() -> None:
    """No other worker serves the partition: the call ends at once with 503, as a call opened
    while every worker is full does (not after placement_timeout_s)."""
    c = conductor(placement_timeout_s=5)
    c.handle(hb("w1", PARTS))
    c.handle(opened("a", now=100.0))
    acts = c.handle(core.AssignResult("a", "w1", tuple(PARTS), False, DRAINING))
    assert not assigns(acts)
    f = fins(acts)[0]
    assert f.status == 503 and "no worker can take" in (f.error or "") and "a" not in c.calls


def test_a_refusal_that_is_not_busy_still_fails_the_call() -> None:
    """A model's failure to take the call is not the worker's load: the call ends, as before."""
    c = conductor()
    c.handle(hb("w1", PARTS))
    c.handle(hb("w2", PARTS))
    c.handle(opened("a"))
    first = next(iter(c.calls["a"].placement.values()))
    acts = c.handle(core.AssignResult("a", first, tuple(PARTS), False, "internal error: the worker could not take the call"))
    assert not assigns(acts) and fins(acts)[0].status == 503


def test_restore_from_records_carries_on() -> None:
    c = conductor()
    c.handle(hb("w1", PARTS))
    acts = c.handle(opened("a"))
    ack_all(c, "a", acts)
    c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0)))
    record = c.calls["a"].record()
    fresh = conductor()
    fresh.restore([record])
    assert fresh.calls["a"].done == {"Encoder": 0}
    f = fins(fresh.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w1", outputs=3))))
    assert f[0].status == 200 and f[0].outputs == {"Encoder": 0, "Talker": 3}


def test_a_calls_assignments_carry_its_opens_stream_sequence_also_after_a_restore() -> None:
    """Its workers read its input from where the frontend says its messages start
    (wire.Open.read_after, below the open's own sequence), not from the stream's start; a
    restarted conductor that moves the call to another worker still knows where. A floor at
    or above the open's own sequence (a stream made again) is none."""
    c = conductor()
    c.handle(hb("w1", PARTS))
    msg = opened("a").msg
    msg.read_after = 4300
    acts = c.handle(core.Opened(msg, 0.0, seq=4321))
    assert [a.msg.read_after for a in acts if isinstance(a, core.SendAssign)] == [4300]
    ack_all(c, "a", acts)
    fresh = conductor()
    fresh.restore([c.calls["a"].record()])
    fresh.handle(hb("w1", PARTS))
    fresh.handle(hb("w2", PARTS))
    moved = fresh.handle(core.WorkerLost("w1"))
    assert [(a.worker_id, a.msg.read_after) for a in moved if isinstance(a, core.SendAssign)] == [("w2", 4300)]
    again = opened("b").msg
    again.read_after = 9000
    assert [a.msg.read_after for a in c.handle(core.Opened(again, 0.0, seq=17)) if isinstance(a, core.SendAssign)] == [0]


def test_transitions_are_guarded() -> None:
    call = core.Call("x", "r", "echo", "fe", True, 0.0, {}, PARTS, set())
    call.move(core.CallState.FINISHED)
    try:
        call.move(core.CallState.RUNNING)
    except RuntimeError as e:
        assert "finished -> running" in str(e)
    else:
        raise AssertionError("a finished call moved on")


def test_a_call_takes_one_slot_per_worker_not_per_partition() -> None:
    c = conductor(max_concurrent_requests=10)
    c.handle(hb("w1", PARTS, capacity=2))
    assert assigns(c.handle(opened("a"))) == {"w1": PARTS}
    assert assigns(c.handle(opened("b"))) == {"w1": PARTS}  # a burst, before any heartbeat
    assert fins(c.handle(opened("c")))[0].status == 503  # now full: two calls
    c.handle(core.AbortRequested("a", "done", 499))
    assert assigns(c.handle(opened("d"))) == {"w1": PARTS}  # freed at once


def test_a_failed_placement_gives_its_slots_back() -> None:
    c = conductor(max_concurrent_requests=10)
    c.handle(hb("enc", ["Encoder"], capacity=1))
    c.handle(hb("tal", ["Talker"], capacity=1, load=1))  # full
    assert fins(c.handle(opened("a")))[0].status == 503
    assert c.workers["enc"].free == 1


def test_a_queued_one_shot_does_not_wait_forever() -> None:
    c = conductor(max_call_duration_s=30)
    c.handle(hb("w1", PARTS))
    for cid in ("a", "b"):
        ack_all(c, cid, c.handle(opened(cid, now=0.0)))
    c.handle(opened("q", live=False, now=10.0))
    assert "q" in c.queue
    acts = c.handle(core.Tick(41.0))
    assert {a.cid: a.msg.status for a in acts if isinstance(a, core.PublishFin)}["q"] == 408
    assert "q" not in c.queue


def saves(actions: list[core.Action]) -> list[wire.CallRecord]:
    return [a.record for a in actions if isinstance(a, core.SaveRecord)]


def test_a_call_record_is_written_once_per_change_a_restore_needs() -> None:
    """Placed, then acknowledged: the acknowledgement writes nothing (a restored PLACING call
    is taken as placed); a waiting call is not written again on every new worker."""
    c = conductor()
    waiting = c.handle(opened("w"))  # no worker yet: it waits
    assert [r.state for r in saves(waiting)] == ["waiting"]
    other = wire.WorkerHeartbeat(worker_id="x", model="other", partitions=["P"], model_partitions=["P"], capacity=5, load=0, ts=0)
    assert saves(c.handle(core.WorkerSeen(other))) == []  # a worker of another model: nothing changed
    c.handle(hb("w1", ["Encoder"]))  # serves one partition of two: still waiting
    placed = c.handle(hb("w2", ["Talker"]))
    assert [r.state for r in saves(placed)] == ["placing"]
    results = [
        core.AssignResult("w", a.worker_id, tuple(a.msg.partitions), True) for a in placed if isinstance(a, core.SendAssign)
    ]
    assert [saves(c.handle(r)) for r in results] == [[], []]
    assert c.calls["w"].state is core.CallState.RUNNING
    restored = core.Conductor(c.config)
    restored.restore(saves(placed))
    assert restored.calls["w"].state is core.CallState.RUNNING and restored.calls["w"].acked == {"Encoder", "Talker"}


def test_the_fin_carries_the_revision_that_reserved_the_request_id() -> None:
    """So the conductor frees the request_id of a lost frontend's call in one round trip."""
    c = conductor()
    c.handle(hb("w1", PARTS))
    ev = opened("a")
    ev = core.Opened(wire.Open(**{**{f: getattr(ev.msg, f) for f in ev.msg.__struct_fields__}, "request_id_revision": 42}), 0.0)
    actions = c.handle(ev)
    assert saves(actions)[0].request_id_revision == 42
    fin = [a for a in c.handle(core.FrontendLost("fe1")) if isinstance(a, core.PublishFin)]
    assert [(f.request_id, f.request_id_revision) for f in fin] == [("ra", 42)]
    restored = core.Conductor(c.config)
    restored.restore(saves(actions))
    assert restored.calls["a"].request_id_revision == 42


def test_a_call_survives_its_record_unchanged() -> None:
    """from_record(record()) gives the same call (what a restore needs is all in the record)."""
    c = conductor()
    c.handle(hb("w1", PARTS))
    c.handle(opened("a"))
    call = c.calls["a"]
    call.done["Encoder"] = 3
    call.usage["Encoder"] = {"frames": 3}
    back = core.Call.from_record(call.record())
    assert back.record() == call.record()
    assert (back.state, back.placement, back.open_streams) == (call.state, call.placement, call.open_streams)


def test_a_batch_writes_each_calls_record_once_its_last_where_it_stood() -> None:
    """core.coalesce: a storm's fetch of opens keeps one put per call, in order; a call whose
    end of input and dones come in one fetch has its record deleted, not put twice first;
    every other action stays, in order."""
    c = conductor(max_concurrent_requests=10)
    c.handle(hb("w1", PARTS))
    storm = [a for cid in ("a", "b", "c") for a in c.handle(opened(cid))]
    assert core.coalesce(storm) == storm  # one record per call: nothing dropped
    for a in storm:
        if isinstance(a, core.SendAssign):
            ack_all(c, a.msg.cid, [a])
    end = c.handle(core.InputEnded("a", "audio_in", 5))
    end += c.handle(core.InputEnded("b", "audio_in", 5))
    end += c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0, usage={})))
    end += c.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w1", outputs=5, usage={})))
    assert [type(a).__name__ for a in end] == ["SaveRecord", "SaveRecord", "SaveRecord", "PublishFin", "DeleteRecord"]
    kept = core.coalesce(end)
    assert kept == [end[1], end[3], end[4]]  # b's put; a's fin, then its delete alone
    assert isinstance(kept[0], core.SaveRecord) and kept[0].record.cid == "b"
