"""What the wire cannot carry, in a worker (pure: a `WorkerService` on a stand-in bus).

A model may emit what msgpack and JSON cannot encode (a numpy scalar in an output or in an
item's meta, an array of objects), and a stored message on a call's input may be one this
worker cannot read (a writer of another version, or one that is not duplexbus). Each fails
its call, as a model's exception does, and nothing else: before, the first ended the worker's
step loop and so the worker (its supervisor restarted it, and the call, placed again, ended
the next one), and the second left the call waiting on that item for ever, read again every
half second.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np

from services.worker import engine as eng
from services.worker.calls import AssignedCall
from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from shared.runtime.errors import ModelFailed, WorkerFailed
from shared.sdk.chunking import Item
from tests.support.bus import StandInBus


def _echo_worker(cids: list[str]) -> tuple[WorkerService, StandInBus]:
    w = WorkerService(parse_config({}), "echo", ["Encoder", "Talker"])
    for cid in cids:
        w.intake.calls[cid] = AssignedCall(cid, ["Encoder", "Talker"])
        for r in w.runners.values():
            r.engine.add_call(cid)
    bus = StandInBus()
    w.stepper.ctx = dataclasses.replace(w.stepper.ctx, bus_of=lambda: cast(BusConnection, bus))
    return w, bus


def _aborts(w: WorkerService) -> list[tuple[str, wire.Abort]]:
    queued = w.stepper.ends._queue
    return [(m.subject, wire.decode_as(m.body, wire.Abort)) for m in queued if subjects.parse(m.subject).kind == subjects.ABORT]


async def test_an_output_the_wire_cannot_carry_fails_its_call_and_only_it() -> None:
    w, bus = _echo_worker(["bad", "good"])
    actions: list[eng.Action] = [
        eng.PublishOutput("bad", 0, {"score": np.float32(0.5)}),  # msgspec encodes no numpy scalar
        eng.PublishOutput("good", 0, {"score": 0.5}),
        eng.PublishOutput("bad", 1, {"score": 0.5}),  # the failed call's later actions are dropped
        eng.PublishDone("bad", 2, {}),
    ]
    await w.stepper.carry_out(actions, "Talker")
    assert [s for s, _ in bus.published] == [subjects.out("good")]
    [(subject, abort)] = _aborts(w)
    assert subject == subjects.abort("bad") and (abort.status, abort.reason) == (500, "partition Talker failed")
    assert "bad" not in w.intake.calls and all("bad" not in r.engine for r in w.runners.values())
    assert "good" in w.intake.calls and w.runners["Talker"].engine.stats.model_errors == 1


async def test_an_item_the_wire_cannot_carry_fails_its_call() -> None:
    for item in (Item(np.array(["x", None], dtype=object)), Item(None, {"v": np.float32(1)})):
        w, bus = _echo_worker(["c"])
        await w.stepper.carry_out([eng.PublishEdgeItem("c", "frames", 0, item)], "Encoder")
        assert bus.published == []
        assert [(s, a.reason) for s, a in _aborts(w)] == [(subjects.abort("c"), "partition Encoder failed")]
        assert "c" not in w.intake.calls


def test_an_array_of_objects_is_refused_before_it_is_sent() -> None:
    """Its bytes would be pointers into the sender's memory."""
    try:
        wire.Tensor.from_array(np.array([object()]))
    except TypeError as e:
        assert "dtype object cannot be sent" in str(e)
    else:
        raise AssertionError("an object array was encoded")


def test_a_stored_input_this_worker_cannot_read_fails_a_call_it_runs_and_is_dropped_for_others() -> None:
    w, _ = _echo_worker(["c"])
    # An item whose tensor no reader can build, as a foreign writer could store it.
    unreadable = wire.encode(wire.InputItem(seq=0, item=wire.WireItem(wire.Tensor("|O", [1], bytes(8)))))
    garbage = b"\x93not a message"
    for body in (unreadable, garbage):
        took = w.intake._take(subjects.input_("c", "audio_in"), body, live=False)
        assert took is not None
        [fail] = took[0]
        assert isinstance(fail, eng.FailCall) and fail.cid == "c" and took[1] == "Encoder"
        assert isinstance(fail.error, WorkerFailed) and not isinstance(fail.error, ModelFailed)
        assert fail.error.message == "partition Encoder could not read its input 'audio_in'"
    assert w.intake._take(subjects.input_("elsewhere", "audio_in"), unreadable, live=False) == ([], "")
