"""Models and partitions that break the model API on purpose, for the tests of what the engine
does with a failing model (tests/test_model_failures.py) and of what `duplexbus check-model`
finds (tests/test_check_model.py). The models load by path: `tests.support.broken_models:Name`.

`SlotPartition` holds a fixed pool of per-call slots, as tiny_duplex's KV cache pool does:
open_call takes one (refusing with Overloaded when none is free), close_call and drop_call
give it back. It counts every close_call and drop_call by cid (in its `tally`, which a
served partition would not keep: it grows with every call), and raises (or misbehaves)
where its `fault` says.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from duplexbus.sdk import (
    CLIENT,
    CallInfo,
    ClientStreamLimits,
    Connection,
    EdgeItem,
    Emission,
    FixedChunkPolicy,
    Item,
    Model,
    Output,
    Overloaded,
    Partition,
    PartitionTopology,
    StepInput,
)

SECRET = "secret model detail at 0x7f3a"  # the text of every exception raised here: never for a client

# What a SlotPartition's fault may be:
FAULTS = (
    "open_call",  # raises before it takes a slot
    "open_call_late",  # raises after it took its slot
    "step",  # raises
    "close_call",  # raises after giving the slot back
    "drop_call",  # raises after giving the slot back
    "wants_step",  # raises
    "edge",  # emits on an edge the partition does not have
    "stray",  # emits for a call its step was not given (one opened before it)
    "not_emission",  # returns something that is neither an Output nor an EdgeItem
    "leak",  # close_call forgets to give the slot back
    "never_done",  # wants a step for ever: no call ever finishes
    "unsendable_output",  # an output holding a numpy scalar, which no client encoding carries
    "unsendable_item",  # an item on edge "mid" holding one in its meta (a _TwoStage model's P)
    "not_item",  # an EdgeItem on edge "mid" holding an array where an Item goes (a _TwoStage model's P)
    "not_dict",  # an Output whose data is a str
)


@dataclass
class Tally:
    """What a test reads of a SlotPartition's lifecycle."""

    seen: list[str] = field(default_factory=list)  # every call opened, in order
    closed: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)


class SlotPartition(Partition):
    """One output per item it is given; `fault` (one of FAULTS) only for the calls whose
    model_kwargs carry {"fail": true} when `only_asked`, else for every call."""

    blocking = False

    def __init__(self, slots: int = 4, fault: str | None = None, only_asked: bool = False) -> None:
        assert fault is None or fault in FAULTS, fault
        self.slots = slots
        self.fault = fault
        self.only_asked = only_asked
        self.free = list(range(slots))
        self.held: dict[str, int] = {}  # cid -> its slot
        self.asked: set[str] = set()  # calls that asked to fail
        self.tally = Tally()

    def _faulty(self, kind: str, cids: list[str]) -> bool:
        return self.fault == kind and (not self.only_asked or any(c in self.asked for c in cids))

    def capacity(self) -> int:
        return self.slots

    def open_call(self, call: CallInfo) -> None:
        if call.model_kwargs.get("fail"):
            self.asked.add(call.cid)
        if self._faulty("open_call", [call.cid]):
            raise RuntimeError(SECRET)
        if not self.free:
            raise Overloaded(f"all {self.slots} slots in use")
        self.held[call.cid] = self.free.pop()
        self.tally.seen.append(call.cid)
        if self._faulty("open_call_late", [call.cid]):
            raise RuntimeError(SECRET)

    def step(self, batch: list[StepInput]) -> list[Emission]:
        cids = [s.cid for s in batch]
        if self._faulty("step", cids):
            raise RuntimeError(SECRET)
        out: list[Emission] = []
        for s in batch:
            for chunk in s.chunks.values():
                out += [Output(s.cid, {"n": it.meta.get("n", 0)}) for it in chunk.items]
            if self._faulty("edge", [s.cid]):
                out.append(EdgeItem(s.cid, "no_such_edge", Item(None, {})))
            if self._faulty("unsendable_output", [s.cid]):
                out.append(Output(s.cid, {"n": np.float32(1)}))
            if self._faulty("unsendable_item", [s.cid]):
                out.append(EdgeItem(s.cid, "mid", Item(None, {"n": np.float32(1)})))
            if self._faulty("not_item", [s.cid]):
                out.append(EdgeItem(s.cid, "mid", np.zeros(2)))  # type: ignore[arg-type]  # the fault itself
            if self._faulty("not_dict", [s.cid]):
                out.append(Output(s.cid, "text"))  # type: ignore[arg-type]  # the fault itself
        if self._faulty("stray", cids):
            others = [c for c in self.tally.seen if c not in cids]
            out.append(Output(others[0] if others else "not-a-call", {"stray": True}))
        if self._faulty("not_emission", cids):
            out.append({"cid": cids[0]})  # type: ignore[arg-type]  # the fault itself
        return out

    def wants_step(self, cid: str) -> bool:
        if self._faulty("wants_step", [cid]):
            raise RuntimeError(SECRET)
        return self._faulty("never_done", [cid]) and cid in self.held

    def _give_back(self, cid: str) -> None:
        slot = self.held.pop(cid, None)
        if slot is not None:
            self.free.append(slot)
        self.asked.discard(cid)

    def close_call(self, cid: str) -> dict[str, Any]:
        self.tally.closed[cid] += 1
        faulty = self._faulty("close_call", [cid])
        if not self._faulty("leak", [cid]):
            self._give_back(cid)
        if faulty:
            raise RuntimeError(SECRET)
        return {"closed": 1}

    def drop_call(self, cid: str) -> None:
        self.tally.dropped[cid] += 1
        faulty = self._faulty("drop_call", [cid])
        self._give_back(cid)
        if faulty:
            raise RuntimeError(SECRET)


EDGE = "audio_in"
FRAME = 320  # 20 ms at 16 kHz: small items, so generated calls are cheap


class _Broken(Model):
    """One partition, `P`, on one 16 kHz audio stream; its fault is the class's `fault`."""

    name: ClassVar[str] = "broken"
    fault: ClassVar[str | None] = None
    only_asked: ClassVar[bool] = False

    def __init__(self) -> None:
        limits = ClientStreamLimits(max_items=None, item_size=FRAME, unit="samples", sample_rate=16_000)
        self.topology = PartitionTopology(["P"], [Connection(CLIENT, "P", EDGE, lambda: FixedChunkPolicy(1), limits)])

    def create_partition(self, name: str) -> Partition:
        return SlotPartition(slots=8, fault=self.fault, only_asked=self.only_asked)


class _TwoStage(_Broken):
    """`P`, whose fault is the class's, then `Q` on edge "mid", a healthy SlotPartition."""

    def __init__(self) -> None:
        limits = ClientStreamLimits(max_items=None, item_size=FRAME, unit="samples", sample_rate=16_000)
        self.topology = PartitionTopology(
            ["P", "Q"],
            [
                Connection(CLIENT, "P", EDGE, lambda: FixedChunkPolicy(1), limits),
                Connection("P", "Q", "mid", lambda: FixedChunkPolicy(1)),
            ],
        )

    def create_partition(self, name: str) -> Partition:
        return SlotPartition(slots=8, fault=self.fault if name == "P" else None, only_asked=self.only_asked)


class Healthy(_Broken):
    name = "broken_healthy"


class StepRaises(_Broken):
    name = "broken_step_raises"
    fault = "step"


class StepRaisesWhenAsked(_Broken):
    """step raises for a batch with a call opened with model_kwargs {"fail": true}: one call
    fails, the next is served (the end-to-end test)."""

    name = "broken_step_raises_when_asked"
    fault = "step"
    only_asked = True


class OpenRaises(_Broken):
    name = "broken_open_raises"
    fault = "open_call_late"


class CloseRaises(_Broken):
    name = "broken_close_raises"
    fault = "close_call"


class LeaksState(_Broken):
    name = "broken_leaks_state"
    fault = "leak"


class UnknownEdge(_Broken):
    name = "broken_unknown_edge"
    fault = "edge"


class StrayEmission(_Broken):
    name = "broken_stray_emission"
    fault = "stray"


class NeverFinishes(_Broken):
    name = "broken_never_finishes"
    fault = "never_done"


class UnsendableOutput(_Broken):
    name = "broken_unsendable_output"
    fault = "unsendable_output"


class UnsendableOutputWhenAsked(UnsendableOutput):
    name = "broken_unsendable_output_when_asked"
    only_asked = True


class UnsendableItem(_TwoStage):
    name = "broken_unsendable_item"
    fault = "unsendable_item"


class NotAnItem(_TwoStage):
    name = "broken_not_an_item"
    fault = "not_item"


class NotADict(_Broken):
    name = "broken_not_a_dict"
    fault = "not_dict"
