"""A model that fails never leaks: what the engine does when a partition's own code raises or
breaks the model API (docs/design.md, "A model that fails"). Pure: hand-made partitions
(tests/support/broken_models.py), no bus."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from services.worker.engine import Action, Engine, FailCall, PublishDone, PublishOutput
from shared.runtime.errors import ModelFailed, Overloaded
from shared.sdk.chunking import FixedChunkPolicy, Item
from shared.sdk.model import CallInfo, EdgeItem, Emission, Output
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology
from tests.support.audio import pcm_file
from tests.support.broken_models import SECRET, SlotPartition
from tests.support.client import WS
from tests.support.stack import running_stack

TOPO = PartitionTopology(
    ["P", "Q"],
    [
        Connection(CLIENT, "P", "in", lambda: FixedChunkPolicy(1), ClientStreamLimits(item_size=4)),
        Connection("P", "Q", "down", lambda: FixedChunkPolicy(1)),
    ],
)


def make(fault: str | None = None, slots: int = 4, only_asked: bool = False) -> tuple[Engine, SlotPartition]:
    part = SlotPartition(slots=slots, fault=fault, only_asked=only_asked)
    return Engine("P", TOPO, part), part


def feed(e: Engine, cid: str, n: int = 1, end: bool = True) -> None:
    for seq in range(n):
        assert e.push(cid, "in", seq, Item(None, {"n": seq})) == []
    if end:
        assert e.end(cid, "in", n) == []


def failed(actions: list[Action]) -> dict[str, ModelFailed]:
    out = {}
    for a in actions:
        if isinstance(a, FailCall):
            assert isinstance(a.error, ModelFailed), a.error
            out[a.cid] = a.error
    return out


def assert_generic(err: ModelFailed) -> None:
    """What reaches the client: a 500 naming the partition, none of the model's text."""
    assert (err.status, err.message) == (500, "partition P failed")
    assert SECRET not in err.message


def logged_secret(caplog: pytest.LogCaptureFixture) -> int:
    """Log records that carry the model's exception with its traceback."""
    return sum(1 for r in caplog.records if r.exc_info and str(r.exc_info[1]) == SECRET and r.exc_info[2] is not None)


# -- a step that raises ----------------------------------------------------------------------
def test_a_step_that_raises_fails_the_batch_and_drops_each_call_once(caplog: pytest.LogCaptureFixture) -> None:
    e, part = make("step")
    for c in ("a", "b"):
        e.add_call(c)
        feed(e, c)
    e.add_call("idle")  # not in the batch: untouched
    with caplog.at_level(logging.ERROR, logger="services.worker.engine"):
        actions = e.step()
    errors = failed(actions)
    assert sorted(errors) == ["a", "b"] and all(err.during == "step" for err in errors.values())
    assert_generic(errors["a"])
    assert logged_secret(caplog) == 1
    assert part.tally.dropped == {"a": 1, "b": 1} and not part.tally.closed
    assert "a" not in e and "b" not in e and "idle" in e
    assert sorted(part.held) == ["idle"] and len(part.free) == 3
    assert e.stats.model_errors == 1 and e.in_step_since is None


def test_a_call_failed_while_its_step_raised_is_dropped_once_after_it() -> None:
    """The shell runs a blocking step in a thread; input that fails a call of that batch meanwhile
    must not drop its state under the step, and the step's failure must not drop it twice."""
    e, part = make("step")
    e.add_call("a")
    feed(e, "a", end=False)
    batch = e.next_batch(now=5.0)
    assert e.in_step_since == 5.0
    assert [type(a) for a in e.push("a", "nope", 0, Item(None, {}))] == [FailCall]  # no such edge
    assert part.tally.dropped == {}  # not under the running step
    with pytest.raises(RuntimeError):
        part.step(batch)
    assert e.step_failed(batch, RuntimeError(SECRET)) == []  # already failed: no second FailCall
    assert part.tally.dropped == {"a": 1} and not part.tally.closed


def test_a_step_that_returns_what_is_not_an_emission_fails_its_batch() -> None:
    e, part = make("not_emission")
    e.add_call("a")
    feed(e, "a")
    assert list(failed(e.step())) == ["a"]
    assert part.tally.dropped == {"a": 1} and not part.tally.closed


def test_a_lazy_step_that_raises_while_its_emissions_are_read_fails_its_batch() -> None:
    e, part = make()
    e.add_call("a")
    feed(e, "a", end=False)
    batch = e.next_batch()

    def emissions() -> Iterator[Emission]:
        yield from part.step(batch)
        raise RuntimeError(SECRET)

    assert list(failed(e.complete(batch, emissions()))) == ["a"]
    assert part.tally.dropped == {"a": 1}


# -- what a step emits --------------------------------------------------------------------
def test_an_emission_on_an_edge_not_the_partitions_fails_that_call_only() -> None:
    e, part = make("edge", only_asked=True)
    e.add_call("bad", {"fail": True})
    e.add_call("good")
    for c in ("bad", "good"):
        feed(e, c)
    actions = e.step()
    assert list(failed(actions)) == ["bad"]
    assert failed(actions)["bad"].during == "step"
    outs = [a for a in actions if isinstance(a, PublishOutput)]
    assert [a.cid for a in outs] == ["good"]  # none of the failed call's outputs go out
    assert [a.cid for a in actions if isinstance(a, PublishDone)] == ["good"]
    assert part.tally.dropped == {"bad": 1} and part.tally.closed == {"good": 1}


@pytest.mark.parametrize(
    ("emit", "says"),
    [
        (lambda cid: EdgeItem(cid, "down", np.zeros(2)), "an EdgeItem on 'down' holding a ndarray, not an Item"),  # type: ignore[arg-type]
        (lambda cid: Output(cid, "text"), "an Output whose data is a str, not a dict"),  # type: ignore[arg-type]
    ],
    ids=["array-for-item", "str-for-dict"],
)
def test_an_emission_of_the_wrong_shape_fails_that_call_only(
    emit: Callable[[str], Emission], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the worker found it only where it encoded it, and ended there."""
    e, part = make()
    for c in ("bad", "good"):
        e.add_call(c)
        feed(e, c)
    batch = e.next_batch()
    actions = e.complete(batch, [*part.step(batch), emit("bad")])
    assert list(failed(actions)) == ["bad"]
    assert [a.cid for a in actions if isinstance(a, PublishDone)] == ["good"]
    assert f"partition P emitted {says}, for bad" in caplog.text


def test_an_emission_for_a_call_the_step_was_not_given_is_dropped_and_fails_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The call it names may be healthy: it goes on, and so does the batch."""
    e, _ = make("stray", only_asked=True)
    e.add_call("other")
    e.add_call("a", {"fail": True})
    feed(e, "a")
    with caplog.at_level(logging.ERROR, logger="services.worker.engine"):
        actions = e.step()
    assert failed(actions) == {}
    assert [(a.cid, a.seq) for a in actions if isinstance(a, PublishOutput)] == [("a", 0)]
    assert [a.cid for a in actions if isinstance(a, PublishDone)] == ["a"]
    assert e.stats.stray_emissions == 1 and any("not given" in r.getMessage() for r in caplog.records)
    feed(e, "other")
    assert [(a.cid, a.seq) for a in e.step() if isinstance(a, PublishOutput)] == [("other", 0)]  # its seqs untouched


# -- the lifecycle calls ----------------------------------------------------------------
def test_an_open_call_that_raises_is_raised_to_the_caller_and_leaves_no_slot() -> None:
    """open_call took its slot and then raised: drop_call gives it back, once; the engine has no call."""
    e, part = make("open_call_late")
    with pytest.raises(RuntimeError, match=SECRET):
        e.add_call("a")
    assert "a" not in e and part.tally.dropped == {"a": 1} and not part.tally.closed
    assert len(part.free) == 4


def test_a_partition_refusing_a_call_is_its_callers_to_report_and_keeps_nothing() -> None:
    e, part = make(slots=1)
    e.add_call("a")
    with pytest.raises(Overloaded):
        e.add_call("b")
    assert "b" not in e and part.tally.dropped == {"b": 1} and part.held == {"a": 0}


def test_a_close_call_that_raises_fails_the_call_without_a_drop(caplog: pytest.LogCaptureFixture) -> None:
    e, part = make("close_call")
    e.add_call("a")
    feed(e, "a")
    with caplog.at_level(logging.ERROR, logger="services.worker.engine"):
        actions = e.step()
    errors = failed(actions)
    assert list(errors) == ["a"] and errors["a"].during == "close_call"
    assert_generic(errors["a"])
    assert not [a for a in actions if isinstance(a, PublishDone)]  # no done: the call failed
    assert part.tally.closed == {"a": 1} and not part.tally.dropped  # close_call had its one try
    assert "a" not in e and logged_secret(caplog) == 1


def test_a_drop_call_that_raises_is_logged_and_the_abort_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    e, part = make("drop_call")
    e.add_call("a")
    e.add_call("b")
    with caplog.at_level(logging.ERROR, logger="services.worker.engine"):
        e.drop_call("a")
    assert "a" not in e and part.tally.dropped == {"a": 1} and logged_secret(caplog) == 1
    e.drop_call("a")  # a repeated abort: nothing more
    assert part.tally.dropped == {"a": 1}
    assert "b" in e


def test_a_wants_step_that_raises_fails_the_call_at_its_next_step(caplog: pytest.LogCaptureFixture) -> None:
    e, part = make("wants_step", only_asked=True)
    e.add_call("a", {"fail": True})
    e.add_call("b")
    for c in ("a", "b"):
        feed(e, c)
    with caplog.at_level(logging.ERROR, logger="services.worker.engine"):
        actions = e.step()
        assert e.has_work() is False  # asked again: not raised, not logged again
    assert list(failed(actions)) == ["a"] and failed(actions)["a"].during == "wants_step"
    assert part.tally.dropped == {"a": 1} and part.tally.closed == {"b": 1}
    assert logged_secret(caplog) == 1


def test_a_paced_call_whose_wants_step_raises_is_stepped_and_failed() -> None:
    """Asked while the call waits for a step without input (its inputs still open)."""
    e, part = make("wants_step", only_asked=True)
    e.add_call("a", {"fail": True})
    assert e.has_work()  # the question raised: the call is due a step, where it fails
    assert list(failed(e.step())) == ["a"]
    assert part.tally.dropped == {"a": 1} and len(e) == 0


# -- a fixed pool of slots ------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["step", "close_call", "edge", "wants_step", "open_call_late", "not_emission"])
def test_a_partition_with_few_slots_still_takes_calls_after_many_failures(fault: str) -> None:
    """Three times as many failing calls as slots, one after the other: every slot comes back,
    and a healthy call is served after them."""
    e, part = make(fault, slots=4, only_asked=True)
    for i in range(12):
        cid = f"bad{i}"
        try:
            e.add_call(cid, {"fail": True})
        except RuntimeError:
            continue
        feed(e, cid)
        actions: list[Action] = []
        while e.has_work():
            actions += e.step()
        assert list(failed(actions)) == [cid]
        assert part.tally.closed[cid] + part.tally.dropped[cid] == 1  # one of the two, once
    assert len(part.free) == 4 and part.held == {} and len(e) == 0
    e.add_call("good")
    feed(e, "good", 3)
    done: list[Action] = []
    while e.has_work():
        done += e.step()
    assert [a.seq for a in done if isinstance(a, PublishOutput)] == [0, 1, 2]
    assert [a.cid for a in done if isinstance(a, PublishDone)] == ["good"]


def test_an_abort_during_a_step_drops_the_call_after_the_step_once() -> None:
    e, part = make()
    e.add_call("a")
    feed(e, "a", end=False)
    batch = e.next_batch()
    e.drop_call("a")  # its abort, while the step runs
    assert part.tally.dropped == {}
    e.complete(batch, part.step(batch))
    assert part.tally.dropped == {"a": 1} and not part.tally.closed


def test_the_partition_counts_opens_and_ends() -> None:
    """Engine.stats.opened and .ended: what the worker's stuck-capacity watch reads as calls
    moving through it."""
    e, _ = make("step", only_asked=True)
    e.add_call("a", {"fail": True})
    e.add_call("b")
    feed(e, "a")
    e.step()
    e.drop_call("b")
    assert (e.stats.opened, e.stats.ended) == (2, 2)


def test_a_slot_partition_refuses_past_its_slots() -> None:
    """The stand-in's own rule, which the tests above lean on."""
    part = SlotPartition(slots=1)
    part.open_call(CallInfo("a"))
    with pytest.raises(Overloaded):
        part.open_call(CallInfo("b"))


# -- through a real stack ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "logged"),
    [
        ("StepRaisesWhenAsked", [SECRET, "Traceback"]),
        (
            "UnsendableOutputWhenAsked",
            ["partition P emitted an output for", "that cannot be sent: Encoding objects of type numpy.float32"],
        ),
    ],
    ids=["step-raises", "unsendable-output"],
)
async def test_a_served_model_whose_step_raises_fails_those_calls_generically_and_serves_the_next(
    nats_url: str, model: str, logged: list[str]
) -> None:
    """A worker serving a model loaded by path, with 8 slots, whose step raises (or emits an
    output no client encoding carries) for the calls that ask it to: nine such calls one
    after the other each get a 500 naming the partition only, and the same worker process
    then serves a call to its end (before, the nine had taken every slot for good, and the
    last call was refused; an output that could not be sent ended the worker)."""
    samples = np.zeros(640, dtype=np.int16)  # two items of the model's 320 samples
    async with running_stack(nats_url, {"model": f"tests.support.broken_models:{model}"}) as stack:
        worker = stack.procs["worker-0"]
        ws = await WS.connect(stack.ws_url())
        try:
            for rid, kwargs in [*((f"bad{i}", {"fail": True}) for i in range(9)), ("good", {})]:
                await ws.send({"request_id": rid, "model_kwargs": kwargs, "files": [pcm_file(samples)], "end_input": True})
                final = await ws.final(rid, timeout=30)
                if rid != "good":
                    assert (final.get("status"), final.get("error")) == (500, "partition P failed"), final
                else:
                    assert "finish" in final and len(ws.outputs(rid)) == 2, (final, stack.logs())
        finally:
            await ws.close()
        assert stack.procs["worker-0"] is worker and worker.alive()
        log = worker.log.read_text()
        assert all(words in log for words in logged), log  # what the model did: in the worker's log, not the client's
