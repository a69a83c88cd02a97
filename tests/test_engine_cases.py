"""The worker engine's pure core in three cases the bus brings and hand-made inputs tend to miss.

- Calls given the same seqs: each call must get its own items and number its own outputs.
  With identical items for every call (as hand-made inputs often are), one call stepped
  with another's chunk, or outputs numbered across calls, look the same as right.
- The end count before the items: the end of a stream and its items travel apart, so the
  count may come first, or after every item has been stepped, or alone (an empty stream).
- A call on two edges: a chunk from each edge in one step, a step for input on either, the
  end only once both have ended, and each output edge numbered and ended on its own.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from services.worker.engine import Action, Engine, FailCall, PublishDone, PublishEdgeEnd, PublishEdgeItem, PublishOutput
from shared.sdk.chunking import FixedChunkPolicy, Item
from shared.sdk.model import CallInfo, EdgeItem, Emission, Output, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology


def item(cid: str, edge: str, seq: int) -> Item:
    """An item that says whose it is, in its tensor as in its metadata."""
    value = zlib.crc32(f"{cid}/{edge}/{seq}".encode()) % 30_000  # the same in every run
    return Item(np.full(4, value, dtype="<i2"), {"cid": cid, "edge": edge, "seq": seq})


class Tagger(Partition):
    """One output per item it is given (whose item, on which edge, its tensor's value), and per
    chunk one edge item on `down` (on `side` too for a chunk of `text`)."""

    blocking = False

    def __init__(self) -> None:
        self.batches: list[list[StepInput]] = []
        self.closed: list[str] = []

    def open_call(self, call: CallInfo) -> None:
        pass

    def step(self, batch: list[StepInput]) -> list[Emission]:
        self.batches.append(batch)
        out: list[Emission] = []
        for s in batch:
            for edge, chunk in s.chunks.items():
                for it in chunk.items:
                    assert it.data is not None
                    out.append(Output(s.cid, {**it.meta, "value": int(it.data[0])}))
                out.append(EdgeItem(s.cid, "down", Item(None, {"edge": edge, "n": len(chunk)})))
                if edge == "text":
                    out.append(EdgeItem(s.cid, "side", Item(None, {"n": len(chunk)})))
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        self.closed.append(cid)
        return {}


def _client(edge: str, chunk: int) -> Connection:
    return Connection(CLIENT, "P", edge, lambda: FixedChunkPolicy(chunk), ClientStreamLimits(item_size=4))


ONE_EDGE = PartitionTopology(["P", "Q"], [_client("in", 2), Connection("P", "Q", "down", lambda: FixedChunkPolicy(1))])
TWO_EDGES = PartitionTopology(
    ["P", "Q", "R"],
    [
        _client("audio", 2),
        _client("text", 1),
        Connection("P", "Q", "down", lambda: FixedChunkPolicy(1)),
        Connection("P", "R", "side", lambda: FixedChunkPolicy(1)),
    ],
)


MAX_STEPS = 100  # far more than any test here needs: an engine that never runs out of work fails, not hangs


def run(e: Engine, into: list[Action]) -> list[Action]:
    """Steps while the engine has work; what they did is added to `into` and returned."""
    done: list[Action] = []
    for _ in range(MAX_STEPS):
        if not e.has_work():
            break
        done.extend(e.step())
    else:
        raise AssertionError(f"still work after {MAX_STEPS} steps")
    into.extend(done)
    return done


def outputs(actions: list[Action], cid: str) -> list[PublishOutput]:
    return [a for a in actions if isinstance(a, PublishOutput) and a.cid == cid]


def dones(actions: list[Action], cid: str) -> list[PublishDone]:
    return [a for a in actions if isinstance(a, PublishDone) and a.cid == cid]


# -- calls given the same seqs -------------------------------------------------
def test_each_call_gets_its_own_items_and_numbers_its_own_outputs() -> None:
    """Three calls get items 0.. on the same edge, interleaved, and a fourth joins after two
    steps: each call's outputs are its own items, in order, numbered from 0."""
    e = Engine("P", ONE_EDGE, Tagger())
    counts = {"a": 5, "b": 2, "c": 3}
    for cid in counts:
        e.add_call(cid)
    for seq in range(max(counts.values())):
        for cid, n in counts.items():
            if seq < n:
                e.push(cid, "in", seq, item(cid, "in", seq))
    actions = [*e.step(), *e.step()]
    counts["d"] = 3
    e.add_call("d")
    for seq in range(counts["d"]):
        e.push("d", "in", seq, item("d", "in", seq))
    for cid, n in counts.items():
        e.end(cid, "in", n)
    run(e, actions)
    for cid, n in counts.items():
        outs = outputs(actions, cid)
        assert [o.seq for o in outs] == list(range(n)), cid  # numbered per call, not across calls
        assert [o.data for o in outs] == [expected(cid, "in", s) for s in range(n)], cid
        assert [d.outputs for d in dones(actions, cid)] == [n], cid


def expected(cid: str, edge: str, seq: int) -> dict[str, Any]:
    """The output Tagger makes of that call's item."""
    it = item(cid, edge, seq)
    assert it.data is not None
    return {**it.meta, "value": int(it.data[0])}


# -- the end count before the items ----------------------------------------------
def test_an_end_count_before_the_items_waits_for_every_item() -> None:
    """The count comes first, then the items one by one (out of order), a step after each as
    the worker would: nothing ends early, the gap the count reveals is asked for, and the
    call ends with the last item."""
    e = Engine("P", ONE_EDGE, Tagger())
    e.add_call("a")
    e.end("a", "in", 5)
    assert e.missing() == {"a": (("in", 0),)}  # the count says items exist that have not come
    actions: list[Action] = []
    for seq in (0, 1, 3, 2):
        e.push("a", "in", seq, item("a", "in", seq))
        run(e, actions)
        assert "a" in e and not dones(actions, "a"), f"ended after item {seq} of 5"
    # The last item, lost in transit: no later item shows the gap, the count does; and the
    # call still awaits input (a worker reads a stalled call's input from the stream).
    assert e.missing() == {"a": (("in", 4),)} and e.awaiting_input() == ["a"]
    e.push("a", "in", 4, item("a", "in", 4))
    run(e, actions)
    assert [o.data for o in outputs(actions, "a")] == [expected("a", "in", s) for s in range(5)]
    assert [d.outputs for d in dones(actions, "a")] == [5] and "a" not in e


def test_an_end_count_after_every_item_was_stepped_ends_the_call() -> None:
    """Items first, all stepped; the count comes on its own later: it alone brings the last
    (empty) chunk, and the call ends (a partition that never asks for a step of its own).
    Another call is stepped in between, as on a busy worker, so "a" is no longer among the
    calls that had input lately when its count comes."""
    e = Engine("P", ONE_EDGE, Tagger())
    e.add_call("a")
    e.add_call("other")
    actions: list[Action] = []
    for seq in range(4):
        e.push("a", "in", seq, item("a", "in", seq))
    run(e, actions)
    for seq in range(2):
        e.push("other", "in", seq, item("other", "in", seq))
    run(e, actions)
    assert "a" in e and not e.has_work()
    e.end("a", "in", 4)
    run(e, actions)
    assert [d.outputs for d in dones(actions, "a")] == [4] and "a" not in e


def test_an_end_count_of_zero_alone_ends_the_call() -> None:
    e = Engine("P", ONE_EDGE, Tagger())
    e.add_call("a")
    e.end("a", "in", 0)
    actions = run(e, [])
    assert dones(actions, "a") == [PublishDone("a", 0, {})]
    assert [a for a in actions if isinstance(a, PublishEdgeEnd)] == [PublishEdgeEnd("a", "down", 1)]  # the empty chunk's


def test_items_and_an_end_count_that_contradict_fail_the_call() -> None:
    """An item ahead of a gap, then a count that says it cannot exist; a count first, then an
    item numbered past it: either way the stream is wrong, and only that call fails."""
    e = Engine("P", ONE_EDGE, Tagger())
    for cid in ("a", "b", "ok"):
        e.add_call(cid)
    e.push("a", "in", 3, item("a", "in", 3))
    assert [type(x) for x in e.end("a", "in", 2)] == [FailCall]
    e.end("b", "in", 2)
    assert [type(x) for x in e.push("b", "in", 2, item("b", "in", 2))] == [FailCall]
    assert "a" not in e and "b" not in e and "ok" in e


# -- a call on two edges --------------------------------------------------------
def test_a_call_on_two_edges_is_stepped_on_either_and_ends_when_both_have() -> None:
    e = Engine("P", TWO_EDGES, Tagger())
    part = e.partition
    assert isinstance(part, Tagger)
    e.add_call("a")
    actions: list[Action] = []
    for seq in (0, 1):
        e.push("a", "audio", seq, item("a", "audio", seq))
    e.push("a", "text", 0, item("a", "text", 0))
    assert e.has_chunk("a")
    run(e, actions)
    # one step took a chunk from each edge
    assert [sorted(s.chunks) for s in part.batches[0]] == [["audio", "text"]]
    assert [(o.data["edge"], o.data["seq"]) for o in outputs(actions, "a")] == [("audio", 0), ("audio", 1), ("text", 0)]

    e.push("a", "text", 1, item("a", "text", 1))  # input on one edge only is enough for a step
    assert e.has_chunk("a") and e.has_work()
    run(e, actions)
    assert outputs(actions, "a")[-1].data == expected("a", "text", 1)

    e.end("a", "audio", 2)  # one edge ends: the call goes on while the other is open
    run(e, actions)
    assert "a" in e and not dones(actions, "a") and e.awaiting_input() == ["a"]
    e.push("a", "text", 2, item("a", "text", 2))
    e.end("a", "text", 3)
    run(e, actions)
    assert [o.data for o in outputs(actions, "a")] == [
        *(expected("a", "audio", s) for s in (0, 1)),
        *(expected("a", "text", s) for s in (0, 1, 2)),
    ]
    assert [o.seq for o in outputs(actions, "a")] == list(range(5))
    # each output edge numbered from 0 and ended with its own count
    by_edge: dict[str, list[int]] = {}
    for a in actions:
        if isinstance(a, PublishEdgeItem):
            by_edge.setdefault(a.edge, []).append(a.seq)
    ends = {a.edge: a.total for a in actions if isinstance(a, PublishEdgeEnd)}
    assert {k: v == list(range(len(v))) for k, v in by_edge.items()} == {"down": True, "side": True}
    assert ends == {k: len(v) for k, v in by_edge.items()}
    assert dones(actions, "a") == [PublishDone("a", 5, {})] and part.closed == ["a"]
