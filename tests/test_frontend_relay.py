"""The frontend's output side without NATS: relay.OutputRelay (order, repeats, the hold,
when to read the stream, the fin's counts) and outbox.Outbox (the bounded sink)."""

from __future__ import annotations

import asyncio

from services.frontend.outbox import MESSAGE_COST, Outbox
from services.frontend.relay import GRACE_S, RECOVER_S, OutputRelay


def ev(p: str, seq: int) -> bytes:
    return f'{{"{p}":{seq}}}'.encode()


def test_in_order_outputs_go_at_once() -> None:
    r = OutputRelay()
    assert r.accept("a", 0, ev("a", 0), 0.0) == [ev("a", 0)]
    assert r.accept("b", 0, ev("b", 0), 0.0) == [ev("b", 0)]  # partitions are numbered apart
    assert r.accept("a", 1, ev("a", 1), 0.0) == [ev("a", 1)]
    assert r.next_out == {"a": 2, "b": 1} and not r.held and r.gap_since is None


def test_an_output_ahead_of_a_gap_waits_for_it() -> None:
    r = OutputRelay()
    r.accept("a", 0, ev("a", 0), 0.0)
    assert r.accept("a", 2, ev("a", 2), 1.0) == []
    assert r.accept("a", 3, ev("a", 3), 1.1) == []
    assert r.gap_since == 1.0 and not r.recovery_due(1.0 + RECOVER_S / 2)
    assert r.recovery_due(1.0 + RECOVER_S + 0.01)  # missing long enough: read the stream
    assert r.accept("a", 1, ev("a", 1), 1.5) == [ev("a", 1), ev("a", 2), ev("a", 3)]
    assert r.gap_since is None and not r.held and not r.recovery_due(10.0)


def test_repeats_are_dropped() -> None:
    """After a worker is replaced, or when a read of the stream brings what came live."""
    r = OutputRelay()
    for seq in range(3):
        r.accept("a", seq, ev("a", seq), 0.0)
    assert r.accept("a", 1, ev("a", 1), 0.0) == []
    assert r.accept("a", 0, ev("a", 0), 0.0) == []
    r.accept("a", 5, ev("a", 5), 0.0)
    assert r.accept("a", 5, ev("a", 5), 0.0) == [] and len(r.held) == 1  # held once


def test_the_hold_is_bounded_and_what_it_drops_is_read_again_from_the_start() -> None:
    r = OutputRelay(max_held=3)
    r.read(40)
    for seq in range(1, 6):
        r.accept("a", seq, ev("a", seq), 0.0)
    assert sorted(r.held) == [("a", 1), ("a", 2), ("a", 3)]
    assert r.read_to == 0  # outputs 4 and 5 were dropped: the next read starts at the call's start
    assert r.accept("a", 0, ev("a", 0), 0.0) == [ev("a", s) for s in range(4)]
    assert r.accept("a", 4, ev("a", 4), 0.0) == [ev("a", 4)]


def test_the_fin_counts_outputs_per_partition() -> None:
    r = OutputRelay()
    r.accept("a", 0, ev("a", 0), 0.0)
    assert not r.complete  # no fin yet
    r.fin({"a": 2, "b": 1}, 5.0)
    assert not r.complete and not r.recovery_due(5.0 + RECOVER_S / 2)
    assert r.recovery_due(5.0 + RECOVER_S + 0.01)  # the fin counts outputs that have not come
    r.accept("a", 1, ev("a", 1), 5.1)
    assert not r.complete
    r.accept("b", 0, ev("b", 0), 5.2)
    assert r.complete and not r.recovery_due(100.0) and not r.give_up_due(100.0)
    empty = OutputRelay()
    empty.fin({}, 0.0)
    assert empty.complete  # a call with no outputs


def test_a_fin_gives_up_on_missing_outputs_only_after_a_while_without_progress() -> None:
    r = OutputRelay()
    r.fin({"a": 3}, 10.0)
    assert not r.give_up_due(10.0 + GRACE_S - 0.1)
    r.accept("a", 0, ev("a", 0), 10.0 + GRACE_S - 0.1)  # a read of the stream brought one
    assert not r.give_up_due(10.0 + GRACE_S + 0.1)  # progress: the wait starts again
    assert r.give_up_due(10.0 + 2 * GRACE_S)


def test_a_fin_does_not_give_up_while_a_read_of_the_stream_is_under_way() -> None:
    """A server busy with twenty uploads answered a read later than GRACE_S: before, the
    call finished with outputs missing that the read was bringing."""
    r = OutputRelay()
    r.fin({"a": 1}, 10.0)
    assert not r.give_up_due(10.0 + 5 * GRACE_S, reading=True)
    r.accept("a", 0, ev("a", 0), 10.0 + 5 * GRACE_S)  # the read brought it
    assert r.complete


async def test_a_direct_outbox_writes_json_at_once_and_ignores_a_gone_connection() -> None:
    written: list[bytes] = []
    box = Outbox(written.append)
    box.send({"request_id": "r", "x": 1})
    box.send(b'{"raw":true}')
    assert written == [b'{"request_id":"r","x":1}', b'{"raw":true}']

    def gone(_: bytes) -> None:
        raise ConnectionResetError

    Outbox(gone).send({"x": 1})  # no exception: the connection's calls are being aborted


async def test_a_queued_outbox_is_bounded_and_says_so_once() -> None:
    overflows: list[int] = []
    one = len(b'{"i":0}') + MESSAGE_COST
    box = Outbox(pause_at=(3 * one + 1) // 2, on_overflow=lambda: overflows.append(len(box)))
    for i in range(5):
        box.send({"i": i})
    assert overflows == [3] and box.overflowed and len(box) == 3  # past twice pause_at nothing is taken
    box.last({"error": "not reading"})  # the overflow's own last line
    got = [await box.get() for _ in range(5)]
    assert got == [{"i": 0}, {"i": 1}, {"i": 2}, {"error": "not reading"}, None]


async def test_a_closed_outbox_gives_what_waits_then_none() -> None:
    box = Outbox()
    box.send({"i": 0})
    waiter = asyncio.create_task(box.get())
    assert await waiter == {"i": 0}
    waiter = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    assert not waiter.done()  # waits for more
    box.close()
    assert await asyncio.wait_for(waiter, 1) is None
    box.send({"late": True})
    assert len(box) == 0
