"""`duplexbus check-model`: the built-in models pass it, and each model broken on purpose
(tests/support/broken_models.py) is caught, with the rule it breaks named. voice_assistant's
run is in tests/test_check_model_voice.py (it loads real speech models)."""

from __future__ import annotations

import pytest

from duplexbus.check_model import (
    Check,
    Counted,
    Options,
    Record,
    Rig,
    check,
    grouped,
    leftover_violations,
    lifecycle_violations,
    order_violations,
    topology_violations,
)
from duplexbus.cli import main
from models.registry import served_model
from models.tiny_duplex import TinyDuplexPartition
from shared.sdk.chunking import FixedChunkPolicy
from shared.sdk.model import CallInfo
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology
from tests.support.broken_models import SlotPartition

BROKEN = "tests.support.broken_models"


def test_echo_passes_with_32_interleaved_calls_some_aborted() -> None:
    report = check("echo", Options(calls=32, seed=1))
    assert report.violations == [], report.violations
    assert report.calls == 32 and 0 < report.aborted < 32
    for part in ("Encoder", "Talker"):
        f = report.figures[part]
        assert f["steps"] > 0 and f["batch_p95"] > 1  # steps took several calls at once


def test_tiny_duplex_passes_and_gives_back_every_kv_slot() -> None:
    check_ = Check(served_model("tiny_duplex"), Options(calls=8, items=2, appends=2, seed=2))
    report = check_.run()
    assert report.violations == [], report.violations
    part = check_.rig.parts["Duplex"].inner
    assert isinstance(part, TinyDuplexPartition)
    assert part.free_slots == part.capacity()
    assert sum(check_.rig.parts["Duplex"].closes.values()) + sum(check_.rig.parts["Duplex"].drops.values()) == 8


def test_a_healthy_model_loaded_by_path_passes() -> None:
    """The control for the broken ones below: the same partition without its fault."""
    assert check(f"{BROKEN}:Healthy", Options(calls=32)).violations == []


@pytest.mark.parametrize(
    ("model", "found"),
    [
        ("StepRaises", ["the call failed in P (step): partition P failed"]),
        ("OpenRaises", ["the call was refused: open_call of P raised RuntimeError"]),
        ("CloseRaises", ["the call failed in P (close_call)"]),
        ("UnknownEdge", ["the call failed in P (step)"]),
        ("StrayEmission", ["P: ", "emissions for calls its step was not given"]),
        ("LeaksState", ["P: 8 ended calls still in its attribute 'held'", "took 0 new calls of its capacity() 8, then refused"]),
        ("NeverFinishes", ["the call did not finish in P: 6 steps after its input ended (max_steps 5)"]),
        ("UnsendableOutput", ["failed in P: an output that the wire cannot carry (Encoding objects of type numpy.float32"]),
        ("UnsendableItem", ["failed in P: an item on 'mid' that the wire cannot carry"]),
        ("NotAnItem", ["the call failed in P (step)"]),
        ("NotADict", ["the call failed in P (step)"]),
    ],
)
def test_a_broken_model_is_caught_naming_what_it_broke(model: str, found: list[str]) -> None:
    report = check(f"{BROKEN}:{model}", Options(calls=12, max_steps=5, timeout_s=60))
    for words in found:
        assert any(words in v for v in report.violations), (words, report.violations)


def test_the_command_prints_a_line_per_violation_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", f"{BROKEN}:StepRaises", "--calls", "4", "--abort-share", "0"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "check-model broken_step_raises: 4 calls, 0 aborted by the check"
    assert [line for line in out if line.startswith("violation:")] == [
        "violation: 4 calls (check-0000, check-0001, check-0002 and 1 more): the call failed in P (step): partition P failed"
    ]
    assert out[-1] == "1 violation"


def test_the_command_exits_0_on_a_good_model_and_2_on_one_it_cannot_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", "echo", "--calls", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok: no violation"
    assert main(["check-model", f"{BROKEN}:NoSuchModel"]) == 2
    assert "has no 'NoSuchModel'" in capsys.readouterr().err


# -- the rules, on hand-made records ----------------------------------------------------------
def test_outputs_out_of_order_twice_missing_or_miscounted_are_each_a_violation() -> None:
    """The engine numbers a partition's emissions itself, so no model reorders them: the rule
    guards the engine and the wiring, and is tested on records made by hand."""
    rec = Record()
    rec.outputs["a", "P"] = [0, 2, 1]
    rec.outputs["b", "P"] = [0, 1, 1]
    rec.outputs["c", "P"] = [0, 2]
    rec.outputs["d", "P"] = [0, 1]
    rec.dones["d", "P"] = 3
    rec.edge_items["e", "down"] = [1, 0]
    rec.edge_ends["e", "down"] = 3
    rec.after_done.append("PublishOutput from P")
    got = order_violations(rec, ["P"])
    assert got == [
        "call a: the outputs of P: out of order from the 1th: [0, 2, 1]",
        "call b: the outputs of P: seqs [1] more than once",
        "call c: the outputs of P: seqs [1] missing",
        "call d: P's done counts 3 outputs, 2 were sent",
        "call e: the items on edge down: out of order from the 0th: [1, 0]",
        "call e: edge down ended at 3 items, 2 were sent",
        "1 times PublishOutput from P for a call after that partition's done",
    ]
    rec = Record()
    rec.outputs["a", "P"] = [0, 1, 2]
    rec.dones["a", "P"] = 3
    assert order_violations(rec, ["P"]) == []


def test_close_and_drop_once_each_call_is_the_rule() -> None:
    p = Counted(SlotPartition(slots=8))
    for cid in ("ok", "twice", "both", "none", "dropped_though_done", "opened_twice"):
        p.open_call(CallInfo(cid))
    p.open_call(CallInfo("opened_twice"))
    p.close_call("ok")
    p.close_call("twice")
    p.close_call("twice")
    p.close_call("both")
    p.drop_call("both")
    p.drop_call("dropped_though_done")
    p.drop_call("opened_twice")
    got = lifecycle_violations({"P": p}, finished={"ok", "dropped_though_done"})
    assert got == [
        "P: call both got close_call 1 and drop_call 1 times (one of the two, once)",
        "P: call dropped_though_done finished and got drop_call, not close_call",
        "P: call none got close_call 0 and drop_call 0 times (one of the two, once)",
        "P: open_call ran 2 times for call opened_twice",
        "P: call twice got close_call 2 and drop_call 0 times (one of the two, once)",
    ]


def test_a_call_left_in_an_engine_is_a_violation() -> None:
    rig = Rig(served_model(f"{BROKEN}:Healthy"), Options())
    assert rig.open("check-0000") is None
    assert leftover_violations(rig, {"check-0000"}) == [
        "P: the engine still holds 1 calls",
        "P: 1 ended calls still in its attribute 'held' (state not let go)",
        "P: took 7 new calls of its capacity() 8, then refused: Overloaded: all 8 slots in use (state not let go)",
    ]


def test_a_partition_the_client_never_reaches_is_a_violation() -> None:
    """PartitionTopology takes it (each edge is valid); no call would ever reach B or C."""
    policy = FixedChunkPolicy
    topo = PartitionTopology(
        ["A", "B", "C"],
        [Connection(CLIENT, "A", "in", policy, ClientStreamLimits(item_size=4)), Connection("B", "C", "b_c", policy)],
    )
    assert topology_violations(topo) == [
        "partition B is reached by no edge from the client's streams",
        "partition C is reached by no edge from the client's streams",
    ]
    assert topology_violations(PartitionTopology(["A"], [])) == ["the model has no client stream: no call can send it anything"]
    assert topology_violations(TOPO_OK) == []


TOPO_OK = PartitionTopology(
    ["A", "B"],
    [
        Connection(CLIENT, "A", "in", FixedChunkPolicy, ClientStreamLimits(item_size=4)),
        Connection("A", "B", "a_b", FixedChunkPolicy),
    ],
)


def test_violations_of_many_calls_are_one_line() -> None:
    lines = [f"call check-000{i} failed in P (step): partition P failed" for i in range(5)] + ["P: something"]
    assert grouped(lines) == [
        "5 calls (check-0000, check-0001, check-0002 and 2 more): the call failed in P (step): partition P failed",
        "P: something",
    ]
