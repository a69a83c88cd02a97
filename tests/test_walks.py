"""Walks (pure, no NATS): an edge's consumer_walk names, on the producer's side, the walk each
item's chunk runs under in the consumer; chunks are cut where the walk changes, one step's
batch holds one walk, and a topology whose walk has more than one authority is refused."""

from __future__ import annotations

import dataclasses
import random
import re
import sys
import types
from typing import Any, cast

import numpy as np
import pytest

from services.worker import engine as eng
from services.worker import service
from services.worker.calls import AssignedCall
from services.worker.engine import Engine, LocalPipeline
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from shared.runtime.errors import ConfigError, ModelFailed
from shared.sdk.chunking import CatchUpChunkPolicy, Chunk, FixedChunkPolicy, Item, StreamBuffer
from shared.sdk.model import CallInfo, EdgeItem, Emission, Model, Partition, StepInput
from shared.sdk.topology import (
    CLIENT,
    ClientStream,
    ClientStreamLimits,
    Connection,
    PartitionTopology,
    ProducerWalkCtx,
    client_stream_limits,
    find_client_streams,
)
from tests.support import wire_next
from tests.support.bus import StandInBus


def by_meta(ctx: ProducerWalkCtx) -> str:
    """The walk the producer wrote into the item (as it is: a test writes a wrong one)."""
    return cast(str, ctx.item.meta["walk"])


def upper_of_producer(ctx: ProducerWalkCtx) -> str:
    return ctx.producer_walk.upper()


def catch_up() -> CatchUpChunkPolicy:
    return CatchUpChunkPolicy(64)


class Forward(Partition):
    """Each item of each chunk, forwarded on `out` with its metadata (and the walk it ran under)."""

    blocking = False

    def __init__(self, out: str) -> None:
        self.out = out

    def open_call(self, call: CallInfo) -> None:
        pass

    def step(self, batch: list[StepInput]) -> list[Emission]:
        return [
            EdgeItem(s.cid, self.out, Item(None, {**i.meta, "ran": s.walk}))
            for s in batch
            for chunk in s.chunks.values()
            for i in chunk.items
        ]

    def close_call(self, cid: str) -> dict[str, Any]:
        return {}


class Recorder(Partition):
    """Keeps every batch it is stepped with."""

    blocking = False

    def __init__(self) -> None:
        self.batches: list[list[StepInput]] = []

    def open_call(self, call: CallInfo) -> None:
        pass

    def step(self, batch: list[StepInput]) -> list[Emission]:
        self.batches.append(batch)
        return []

    def close_call(self, cid: str) -> dict[str, Any]:
        return {}


def client(edge: str, to: str) -> Connection:
    return Connection(CLIENT, to, edge, catch_up, ClientStreamLimits())


class WalkModel(Model):
    """Client `in` -> P -> `down` (walk: the item's meta) -> Q, and, with `chain`, Q -> `up`
    (walk: Q's own walk in capitals) -> R."""

    name = "walks"

    def __init__(self, chain: bool = False, policy: Any = catch_up) -> None:
        conns = [client("in", "P"), Connection("P", "Q", "down", policy, consumer_walk=by_meta)]
        if chain:
            conns.append(Connection("Q", "R", "up", catch_up, consumer_walk=upper_of_producer))
        self.topology = PartitionTopology(["P", "Q", "R"] if chain else ["P", "Q"], conns)
        self.chain = chain
        self.parts: dict[str, Partition] = {}

    def create_partition(self, name: str) -> Partition:
        part: Partition = Forward("down") if name == "P" else Forward("up") if name == "Q" and self.chain else Recorder()
        self.parts[name] = part
        return part


def run(pipe: LocalPipeline, calls: dict[str, list[str]]) -> None:
    """Each call's items (their walks, in order) in and ended, then the pipeline run to the end."""
    for cid, walks in calls.items():
        pipe.open(cid)
        for seq, w in enumerate(walks):
            pipe.push(cid, "in", seq, Item(None, {"cid": cid, "seq": seq, "walk": w}))
        pipe.end(cid, "in", len(walks))
    for _ in range(200):
        if not pipe.run_once():
            break
    assert all(pipe.finished(cid) for cid in calls)


def stepped(rec: Recorder) -> list[tuple[str, str, int, str]]:
    """(cid, walk it ran under, seq, walk it picked) of every item stepped, in step order."""
    return [
        (s.cid, s.walk, int(i.meta["seq"]), str(i.meta["walk"]))
        for batch in rec.batches
        for s in batch
        for c in s.chunks.values()
        for i in c.items
    ]


# -- the engine and the pipeline ---------------------------------------------------------


def test_each_item_runs_under_the_walk_it_picked_in_chunks_and_batches_of_one_walk() -> None:
    model = WalkModel()
    pipe = LocalPipeline(model)
    calls = {"c1": ["a", "a", "b", "a", "b", "b"], "c2": ["b", "b", "a"], "c3": ["a", "c", "c", "a"]}
    run(pipe, calls)
    rec = model.parts["Q"]
    assert isinstance(rec, Recorder)
    items = stepped(rec)
    assert all(ran == picked for _, ran, _, picked in items)  # each item under the walk it picked
    for cid, walks in calls.items():  # every item, once, in order
        assert [(seq, picked) for c, _, seq, picked in items if c == cid] == list(enumerate(walks))
    for batch in rec.batches:
        assert len({s.walk for s in batch}) == 1, [(s.cid, s.walk) for s in batch]
        for s in batch:
            assert all(c.walk == s.walk and {str(i.meta["walk"]) for i in c.items} <= {s.walk} for c in s.chunks.values())
    # the chunks were cut at each walk change (CatchUpChunkPolicy would take all of a call's items at once)
    chunks = {cid: [len(c) for b in rec.batches for s in b if s.cid == cid for c in s.chunks.values()] for cid in calls}
    assert chunks == {"c1": [2, 1, 1, 2], "c2": [2, 1], "c3": [1, 2, 1]}
    assert not any(pipe.errors.values())


def test_a_partition_no_stream_drives_runs_under_the_empty_walk() -> None:
    model = WalkModel()
    pipe = LocalPipeline(model)
    run(pipe, {"c": ["a"]})
    assert pipe.outputs["c"] == []
    # P (fed by the client) ran under "": what it forwarded says so
    producer = pipe.engines["P"]
    assert producer.stats.steps >= 1
    assert StepInput("x", {}).walk == ""


def test_the_producer_walk_is_the_walk_the_producers_own_step_ran_under() -> None:
    model = WalkModel(chain=True)
    pipe = LocalPipeline(model)
    run(pipe, {"c": ["a", "b", "b", "a"]})
    rec = model.parts["R"]
    assert isinstance(rec, Recorder)
    got = [(s.walk, str(i.meta["ran"])) for b in rec.batches for s in b for c in s.chunks.values() for i in c.items]
    assert got == [("A", "a"), ("B", "b"), ("B", "b"), ("A", "a")]


def _driven_engine(max_batch: int) -> Engine:
    return Engine("Q", WalkModel().topology, Recorder(), max_batch=max_batch)


def test_a_walk_few_calls_run_is_served_in_its_turn() -> None:
    """Ten calls of walk a, fed every step, and one of walk b: b is served as soon as it is the
    least recently served call, not after a's calls run dry (they never do here)."""
    engine = _driven_engine(max_batch=4)
    a_calls = [f"a{i}" for i in range(10)]
    for cid in [*a_calls, "b"]:
        engine.add_call(cid)
    served_b_at = None
    for step in range(6):
        for cid in a_calls:
            engine.push(cid, "down", step, Item(None, {"seq": step, "walk": "a"}), "a")
        if step == 0:
            engine.push("b", "down", 0, Item(None, {"seq": 0, "walk": "b"}), "b")
        batch = engine.next_batch()
        assert len({s.walk for s in batch}) == 1
        if any(s.cid == "b" for s in batch):
            served_b_at = step
            assert [s.walk for s in batch] == ["b"]
        engine.complete(batch, [])
    # 10 a-calls 4 at a time: b, least recently served once the first 10 have had a step, goes 4th
    assert served_b_at == 3


def test_a_call_whose_edges_disagree_steps_one_walk_at_a_time() -> None:
    """Two edges from one producer under one hook: the call's chunks of another walk wait for
    a step of their own."""
    topo = PartitionTopology(
        ["P", "Q"],
        [
            client("in", "P"),
            Connection("P", "Q", "x", catch_up, consumer_walk=by_meta),
            Connection("P", "Q", "y", catch_up, consumer_walk=by_meta),
        ],
    )
    engine = Engine("Q", topo, Recorder())
    engine.add_call("c")
    engine.push("c", "x", 0, Item(None, {"walk": "a"}), "a")
    engine.push("c", "y", 0, Item(None, {"walk": "b"}), "b")
    first = engine.next_batch()
    assert [(s.walk, sorted(s.chunks)) for s in first] == [("a", ["x"])]
    engine.complete(first, [])
    second = engine.next_batch()
    assert [(s.walk, sorted(s.chunks)) for s in second] == [("b", ["y"])]


def test_a_walk_on_an_edge_that_drives_none_is_ignored() -> None:
    """A producer whose model differs from ours names a walk for an edge that drives none
    here: the item runs under "" rather than waiting for ever for a batch of its walk."""
    topo = PartitionTopology(["P", "Q"], [client("in", "P"), Connection("P", "Q", "down", catch_up)])
    engine = Engine("Q", topo, Recorder())
    engine.add_call("c")
    engine.push("c", "down", 0, Item(None, {}), "a")
    assert [(s.walk, len(s.chunks["down"])) for s in engine.next_batch()] == [("", 1)]


@pytest.mark.parametrize("picked", ["", None, 3])
def test_a_hook_that_names_no_walk_fails_its_call_and_the_others_go_on(picked: object, caplog: pytest.LogCaptureFixture) -> None:
    """The producer's model breaks the API: the client is told which partition failed, the
    worker's log what it returned."""
    model = WalkModel()
    pipe = LocalPipeline(model)
    pipe.open("bad")
    pipe.push("bad", "in", 0, Item(None, {"seq": 0, "walk": picked}))
    pipe.end("bad", "in", 1)
    run(pipe, {"good": ["a", "b"]})
    [error] = pipe.errors["bad"]
    assert isinstance(error, ModelFailed) and (error.message, error.during) == ("partition P failed", "consumer_walk")
    logged = [str(r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert logged == [f"consumer_walk of edge 'down' returned {picked!r}, not a walk's name"]
    assert pipe.errors["good"] == [] and set(pipe.usage["good"]) == {"P", "Q"}


# -- stream buffers ------------------------------------------------------------------------


def drain(buf: StreamBuffer) -> list[tuple[str, list[int], bool]]:
    out = []
    while (c := buf.pop_chunk()) is not None:
        out.append((c.walk, [int(i.meta["seq"]) for i in c.items], c.last))
    return out


def test_chunks_are_cut_at_walk_changes_whatever_order_the_items_came_in() -> None:
    buf = StreamBuffer(FixedChunkPolicy(3))
    walks = ["a", "a", "b", "b", "b", "b", "a"]
    for seq in [6, 1, 0, 3, 2, 5, 4]:  # out of order: an item ahead of a gap keeps its walk
        buf.push(seq, Item(None, {"seq": seq}), walks[seq])
    # a full chunk of 3 is not needed to release a run another walk follows
    assert drain(buf) == [("a", [0, 1], False), ("b", [2, 3, 4], False), ("b", [5], False)]
    assert buf.next_walk is None  # the last "a" waits: more of its walk may come
    buf.push(7, Item(None, {"seq": 7}), "a")
    buf.end(8)
    assert drain(buf) == [("a", [6, 7], True)]


def test_the_empty_final_chunk_runs_under_the_last_walk() -> None:
    buf = StreamBuffer(CatchUpChunkPolicy(8))
    buf.push(0, Item(None, {"seq": 0}), "a")
    buf.push(1, Item(None, {"seq": 1}), "b")
    assert drain(buf) == [("a", [0], False), ("b", [1], False)]
    buf.end(2)
    assert buf.next_walk == "b"
    assert drain(buf) == [("b", [], True)]


def test_a_chunk_without_walks_is_as_before() -> None:
    buf = StreamBuffer(FixedChunkPolicy(2))
    for seq in range(5):
        buf.push(seq, Item(None, {"seq": seq}))
    buf.end(5)
    assert drain(buf) == [("", [0, 1], False), ("", [2, 3], False), ("", [4], True)]
    assert Chunk([], 0).walk == ""


# -- the topology --------------------------------------------------------------------------


def other_hook(ctx: ProducerWalkCtx) -> str:
    return "x"


def test_the_topology_names_its_producer_triggered_partitions_and_their_drivers() -> None:
    model = WalkModel(chain=True)
    topo = model.topology
    assert topo.producer_triggered_partitions() == {"Q", "R"}
    assert {p: c.edge_name for p, c in topo.walk_drivers().items()} == {"Q": "down", "R": "up"}
    assert PartitionTopology(["P"], [client("in", "P")]).producer_triggered_partitions() == set()


@pytest.mark.parametrize(
    ("connections", "message"),
    [
        (
            [Connection(CLIENT, "P", "in", catch_up, ClientStreamLimits(), consumer_walk=by_meta)],
            "client edge 'in' has a consumer_walk: only a partition's output can drive a walk",
        ),
        (
            [client("in", "P"), client("aux", "Q"), Connection("P", "Q", "down", catch_up, consumer_walk=by_meta)],
            "partition 'Q' is producer-triggered (edge 'down' drives its walk), so all its incoming edges "
            "must come from one producer; they come from 'P', the client",
        ),
        (
            [
                client("in", "P"),
                Connection("P", "R", "r", catch_up),
                Connection("P", "Q", "down", catch_up, consumer_walk=by_meta),
                Connection("R", "Q", "more", catch_up, consumer_walk=by_meta),
            ],
            "so all its incoming edges must come from one producer; they come from 'P', 'R'",
        ),
        (
            [
                client("in", "P"),
                Connection("P", "Q", "down", catch_up, consumer_walk=by_meta),
                Connection("P", "Q", "side", catch_up),
            ],
            "partition 'Q' is producer-triggered: all its incoming edges must share edge 'down''s consumer_walk "
            "(one function), and ['side'] do not",
        ),
        (
            [
                client("in", "P"),
                Connection("P", "Q", "down", catch_up, consumer_walk=by_meta),
                Connection("P", "Q", "side", catch_up, consumer_walk=other_hook),
            ],
            "and ['side'] do not",
        ),
    ],
)
def test_a_walk_with_more_than_one_authority_is_refused_at_load(connections: list[Connection], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PartitionTopology(["P", "Q", "R"], connections)


def test_find_client_streams_names_each_streams_consumer_and_walk() -> None:
    model = WalkModel(chain=True)
    assert find_client_streams(model) == {"in": ClientStream("P", "")}


def test_client_stream_limits_apply_the_serving_config_to_the_declaration() -> None:
    declared = ClientStreamLimits(max_items=100, item_size=1280, unit="samples", sample_rate=16_000)
    topo = PartitionTopology(["P"], [Connection(CLIENT, "P", "in", catch_up, declared)])
    assert client_stream_limits(topo) == {"in": declared}
    lowered = client_stream_limits(topo, parse_config({"client_streams": {"in": {"max_items": 10}}}))
    assert lowered == {"in": ClientStreamLimits(max_items=10, item_size=1280, unit="samples", sample_rate=16_000)}
    assert topo.stream_limits({"in": 10}) == {"in": 10}  # the same rule, as max_items alone
    with pytest.raises(ConfigError) as e:
        client_stream_limits(topo, {"in": 101})
    assert e.value.key == "client_streams.in.max_items" and "101 raises the model's bound of 100" in e.value.message


# -- the wire ------------------------------------------------------------------------------


def release_1_0() -> types.ModuleType:
    """wire.py as the 1.0 release wrote it: no `walk` on an edge item, minor 0."""
    text = wire_next.WIRE.read_text()
    text, n = re.subn(r"^MINOR = \d+$", "MINOR = 0", text, flags=re.MULTILINE)
    assert n == 1 and text.count('    walk: str = ""\n') == 1
    text = text.replace('    walk: str = ""\n', "")
    mod = types.ModuleType("tests.wire_1_0")
    mod.__file__ = str(wire_next.WIRE)
    sys.modules[mod.__name__] = mod
    exec(compile(text, str(wire_next.WIRE), "exec"), mod.__dict__)
    return mod


def test_the_walk_travels_with_an_edge_item_and_a_1_0_reader_ignores_it() -> None:
    item = wire.WireItem.from_item(Item(np.arange(3, dtype="<i2"), {"k": 1}))
    body = wire.encode(wire.EdgeItemMsg(seq=4, item=item, walk="prefill"))
    back = wire.decode_as(body, wire.EdgeItemMsg)
    assert (back.seq, back.walk, back.vm) == (4, "prefill", wire.MINOR) and wire.MINOR >= 1
    old = release_1_0()
    read_there = old.decode(body)
    assert type(read_there).__name__ == "EdgeItemMsg" and not hasattr(read_there, "walk")
    assert (read_there.seq, read_there.item.meta) == (4, {"k": 1})
    from_1_0 = wire.decode_as(old.encode(old.EdgeItemMsg(seq=4, item=old.WireItem(None, {}))), wire.EdgeItemMsg)
    assert (from_1_0.walk, from_1_0.vm) == ("", 0)  # not sent: no walk named


# -- the worker shell ----------------------------------------------------------------------


def _worker(monkeypatch: pytest.MonkeyPatch, partitions: list[str]) -> WorkerService:
    monkeypatch.setattr(service, "served_model", lambda name: WalkModel())
    w = WorkerService(parse_config({}), "walks", partitions)
    w.intake.calls["c"] = AssignedCall("c", list(partitions))
    for p in partitions:
        w.runners[p].engine.add_call("c")
    return w


async def test_the_worker_publishes_the_walk_with_the_item_and_hands_it_over_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker(monkeypatch, ["P", "Q"])
    bus = StandInBus()
    w.stepper.ctx = dataclasses.replace(w.stepper.ctx, bus_of=lambda: cast(BusConnection, bus))
    await w.stepper.carry_out([eng.PublishEdgeItem("c", "down", 0, Item(None, {"k": 1}), "a")], "P")
    [(subject, body)] = bus.published
    assert subject == subjects.edge("c", "down") and wire.decode_as(body, wire.EdgeItemMsg).walk == "a"
    # Q runs here too: it was handed the item at once, under its walk
    assert [(s.walk, len(s.chunks["down"])) for s in w.runners["Q"].engine.next_batch()] == [("a", 1)]


async def test_the_worker_steps_an_edge_item_from_the_bus_under_its_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker(monkeypatch, ["Q"])
    body = wire.encode(wire.EdgeItemMsg(seq=0, item=wire.WireItem(None, {}), walk="b"))
    took = w.intake._take(subjects.edge("c", "down"), body, live=True)
    assert took == ([], "Q")
    assert [s.walk for s in w.runners["Q"].engine.next_batch()] == ["b"]


def test_a_buffers_next_walk_is_its_head_walk_while_it_has_a_chunk() -> None:
    """`next_walk` reads the head once (it is asked for every stream of every call in every
    step): the same answer as the head's walk whenever `has_chunk`, None otherwise, through
    random pushes (out of order, repeated, of several walks), ends and pops."""
    rng = random.Random(3)
    for policy in (FixedChunkPolicy(3), CatchUpChunkPolicy(4), FixedChunkPolicy(1)):
        for _ in range(50):
            buf = StreamBuffer(policy)
            total = rng.randrange(0, 12)
            order = list(range(total)) * 2
            rng.shuffle(order)
            for seq in order:
                buf.push(seq, Item(), rng.choice(["", "a", "b"]))
                if rng.random() < 0.2:
                    buf.pop_chunk()
                if rng.random() < 0.1 and buf.total is None:
                    buf.end(total)
                assert buf.next_walk == (buf._head()[0] if buf.has_chunk() else None)
            if buf.total is None:
                buf.end(total)
            while not buf.finished:
                assert buf.next_walk == (buf._head()[0] if buf.has_chunk() else None)
                buf.pop_chunk()
            assert buf.next_walk is None
