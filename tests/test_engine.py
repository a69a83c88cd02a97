"""The worker engine's pure core, the stream buffer and the chunk policies, with hand-made inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from models.echo import EchoModel
from services.worker.engine import (
    Action,
    Engine,
    FailCall,
    LocalPipeline,
    PublishDone,
    PublishEdgeEnd,
    PublishEdgeItem,
    PublishOutput,
)
from shared.runtime.errors import LimitExceeded, ProtocolError
from shared.sdk.chunking import CatchUpChunkPolicy, FixedChunkPolicy, Item, StreamBuffer
from shared.sdk.model import CallInfo, EdgeItem, Emission, Output, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology


def item(v: int) -> Item:
    return Item(np.full(4, v, dtype="<i2"), {"v": v})


# -- chunk policies and the stream buffer --------------------------------------
def test_fixed_policy_waits_for_full_chunks_then_flushes_the_rest() -> None:
    p = FixedChunkPolicy(3)
    assert p.take(2, complete=False) == 0
    assert p.take(7, complete=False) == 3
    assert p.take(2, complete=True) == 2


def test_catch_up_policy_releases_everything_up_to_the_cap() -> None:
    p = CatchUpChunkPolicy(5)
    assert p.take(1, complete=False) == 1
    assert p.take(12, complete=False) == 5


def test_buffer_reorders_and_deduplicates() -> None:
    b = StreamBuffer(CatchUpChunkPolicy(100))
    assert b.push(1, item(1))
    assert not b.has_chunk()  # seq 0 missing: nothing is released past a gap
    assert b.push(0, item(0))
    assert not b.push(1, item(1))  # duplicate (catch-up read overlapping the live subscription)
    chunk = b.pop_chunk()
    assert chunk is not None and [i.meta["v"] for i in chunk.items] == [0, 1]
    assert not b.push(0, item(0))  # already released


def test_end_count_before_items_and_final_partial_chunk() -> None:
    b = StreamBuffer(FixedChunkPolicy(2))
    b.end(3)  # the count arrives before the items
    for s in (2, 0, 1):
        b.push(s, item(s))
    c1 = b.pop_chunk()
    c2 = b.pop_chunk()
    assert c1 is not None and c2 is not None
    assert [len(c1), c1.last, len(c2), c2.last] == [2, False, 1, True]
    assert c2.data is not None and c2.data.shape == (4,)
    assert b.finished and b.pop_chunk() is None


def test_empty_stream_yields_one_empty_last_chunk() -> None:
    b = StreamBuffer(FixedChunkPolicy(2))
    b.end(0)
    c = b.pop_chunk()
    assert c is not None and c.last and len(c) == 0


def test_buffer_bounds_and_bad_counts() -> None:
    b = StreamBuffer(FixedChunkPolicy(1), capacity=2)
    b.push(5, item(5))
    b.push(6, item(6))
    with pytest.raises(LimitExceeded):
        b.push(7, item(7))
    b2 = StreamBuffer(FixedChunkPolicy(1))
    b2.push(0, item(0))
    b2.push(1, item(1))
    with pytest.raises(ProtocolError):
        b2.end(1)  # fewer than already received
    b2.end(2)
    with pytest.raises(ProtocolError):
        b2.end(3)  # a different count for the same stream
    with pytest.raises(ProtocolError):
        b2.push(2, item(2))  # past the end


# -- the engine -------------------------------------------------------------
class Recorder(Partition):
    """Records each batch; emits one output per item and one edge item per chunk."""

    blocking = False

    def __init__(self) -> None:
        self.batches: list[list[StepInput]] = []
        self.closed: list[str] = []
        self.pending_ticks: dict[str, int] = {}

    def open_call(self, call: CallInfo) -> None:
        self.pending_ticks[call.cid] = int(call.model_kwargs.get("ticks", 0))

    def step(self, batch: list[StepInput]) -> list[Emission]:
        self.batches.append(batch)
        out: list[Emission] = []
        for s in batch:
            for chunk in s.chunks.values():
                for it in chunk.items:
                    out.append(Output(s.cid, {"v": it.meta["v"]}))
                out.append(EdgeItem(s.cid, "down", Item(None, {"n": len(chunk)})))
            if s.inputs_ended and self.pending_ticks.get(s.cid, 0) > 0:
                self.pending_ticks[s.cid] -= 1
                out.append(Output(s.cid, {"tick": True}))
        return out

    def wants_step(self, cid: str) -> bool:
        return self.pending_ticks.get(cid, 0) > 0

    def close_call(self, cid: str) -> dict[str, Any]:
        self.closed.append(cid)
        self.pending_ticks.pop(cid, None)
        return {"closed": 1}


TOPO = PartitionTopology(
    ["P", "Q"],
    [
        Connection(CLIENT, "P", "in", lambda: FixedChunkPolicy(1), ClientStreamLimits(item_size=4)),
        Connection("P", "Q", "down", lambda: FixedChunkPolicy(1)),
    ],
)


def make(max_batch: int = 64) -> tuple[Engine, Recorder]:
    part = Recorder()
    return Engine("P", TOPO, part, max_batch=max_batch), part


def test_one_step_batches_many_calls_one_chunk_each() -> None:
    e, part = make()
    for c in ("a", "b", "c"):
        e.add_call(c)
        for s in range(3):
            e.push(c, "in", s, item(s))
    actions = e.step()
    assert len(part.batches) == 1
    assert sorted(s.cid for s in part.batches[0]) == ["a", "b", "c"]
    assert all(len(s.chunks["in"]) == 1 for s in part.batches[0])  # FixedChunkPolicy(1): one item per step
    outs = [a for a in actions if isinstance(a, PublishOutput)]
    assert [(a.cid, a.seq) for a in outs] == [("a", 0), ("b", 0), ("c", 0)]


def test_max_batch_and_least_recently_served_first() -> None:
    e, part = make(max_batch=2)
    for c in ("a", "b", "c"):
        e.add_call(c)
        for s in range(5):
            e.push(c, "in", s, item(s))
    e.step()
    e.step()
    served = [[s.cid for s in b] for b in part.batches]
    assert served[0] == ["a", "b"]
    assert served[1][0] == "c"  # c waited longest


def test_end_of_stream_finishes_with_edge_end_and_done() -> None:
    e, part = make()
    e.add_call("a")
    e.push("a", "in", 1, item(1))
    e.end("a", "in", 2)
    e.push("a", "in", 0, item(0))
    actions: list[Action] = []
    while e.has_work():
        actions.extend(e.step())
    edge_items = [a for a in actions if isinstance(a, PublishEdgeItem)]
    assert [a.seq for a in edge_items] == [0, 1]
    ends = [a for a in actions if isinstance(a, PublishEdgeEnd)]
    assert ends == [PublishEdgeEnd("a", "down", 2)]
    done = [a for a in actions if isinstance(a, PublishDone)]
    assert done == [PublishDone("a", 2, {"closed": 1})]
    assert "a" not in e and part.closed == ["a"]


def test_wants_step_keeps_a_call_alive_after_its_input_ended() -> None:
    e, _ = make()
    e.add_call("a", {"ticks": 3})
    e.end("a", "in", 0)
    actions: list[Action] = []
    steps = 0
    while e.has_work():
        actions.extend(e.step())
        steps += 1
    ticks = [a for a in actions if isinstance(a, PublishOutput) and a.data.get("tick")]
    assert len(ticks) == 3 and steps == 3
    assert isinstance(actions[-1], PublishDone)


def test_bad_input_fails_only_that_call() -> None:
    e, _ = make()
    e.add_call("a")
    e.add_call("b")
    e.push("b", "in", 0, item(0))
    e.end("a", "in", 1)
    acts = e.push("a", "in", 5, item(5))  # past the end
    assert isinstance(acts[0], FailCall) and acts[0].cid == "a"
    assert "a" not in e and "b" in e
    assert e.push("a", "in", 0, item(0)) == []  # late input of a failed call is ignored
    assert [a.cid for a in e.step() if isinstance(a, PublishOutput)] == ["b"]


def test_local_pipeline_runs_echo_in_order() -> None:
    p = LocalPipeline(EchoModel())
    frames = [np.full(1280, i, dtype="<i2") for i in range(7)]
    p.open("x")
    for i in reversed(range(7)):  # out of order on purpose
        p.push("x", "audio_in", i, Item(frames[i]))
    p.end("x", "audio_in", 7)
    while p.run_once():
        pass
    r = p.result("x")
    assert [o[1]["frame"] for o in r.outputs] == list(range(7))
    assert r.usage["Talker"] == {"frames": 7} and not r.errors


def test_calls_without_input_are_stepped_at_most_every_tick() -> None:
    part = Recorder()
    e = Engine("P", TOPO, part, tick_s=0.02)
    e.add_call("a", {"ticks": 5})
    e.end("a", "in", 0)
    e.step(now=10.0)  # the final (empty) chunk is input: stepped at once
    assert not e.has_work(now=10.01)  # only wants_step left: paced
    assert e.next_due(10.01) == pytest.approx(0.01)
    assert e.has_work(now=10.025)
    e.step(now=10.025)
    e.add_call("b")
    e.push("b", "in", 0, item(0))
    assert e.has_work(now=10.026)  # new input is never paced
    assert [s.cid for s in e.next_batch(now=10.026)] == ["b"]


def test_echo_batch_energy_matches_one_frame_at_a_time() -> None:
    from models.echo import frame_rms, frames_rms

    rng = np.random.default_rng(3)
    same = [rng.integers(-3000, 3000, 1280).astype("<i2") for _ in range(5)]
    assert frames_rms(same) == pytest.approx([frame_rms(f) for f in same])
    mixed = [*same, rng.integers(-3000, 3000, 100).astype("<i2"), np.zeros(0, dtype="<i2")]
    assert frames_rms(mixed) == pytest.approx([frame_rms(f) for f in mixed])


def test_a_call_failing_during_its_step_keeps_its_state_until_the_step_is_done() -> None:
    """A blocking partition steps in a thread while items still arrive; an item that fails
    the call then must not drop the partition's state for it in the middle of that step."""
    e, part = make()
    e.add_call("a")
    e.push("a", "in", 0, item(0))
    batch = e.next_batch()  # the step of "a" is under way
    failed = e.push("a", "nope", 0, item(0))  # an edge the partition does not have: the call fails
    assert [type(a) for a in failed] == [FailCall]
    assert part.closed == []  # not dropped under the running step
    e.complete(batch, part.step(batch))
    assert part.closed == ["a"]  # dropped once the step is done
