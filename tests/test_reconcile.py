"""Reconciliation of the conductor with the frontends, on hand-made events (pure, no NATS):
an open whose abort was read first is never placed, an open read again after its call ended
is not placed again, and a call its frontend's heartbeats no longer list is ended, its slot
given back (docs/design.md, "Reconciliation")."""

from __future__ import annotations

import pytest

from services.conductor import core
from services.conductor.observe import Observer
from services.frontend.heartbeat import Beats
from shared.bus import wire
from shared.runtime.config import parse_config
from shared.runtime.metrics import ConductorMetrics

PARTS = ["Encoder", "Talker"]
LIMIT = 2


def conductor() -> core.Conductor:
    c = core.Conductor(parse_config({"max_concurrent_requests": LIMIT, "max_queued_requests": 1}))
    c.handle(
        core.WorkerSeen(
            wire.WorkerHeartbeat(
                worker_id="w1", model="echo", partitions=PARTS, model_partitions=PARTS, capacity=10, load=0, ts=0.0
            )
        )
    )
    return c


def opened(cid: str, beat: int = 0, frontend: str = "fe1", live: bool = True) -> core.Opened:
    msg = wire.Open(
        cid=cid,
        request_id=f"r{cid}",
        model="echo",
        frontend_id=frontend,
        open_streams=["audio_in"] if live else [],
        live=live,
        frontend_beat=beat,
    )
    return core.Opened(msg, 0.0)


def beat(n: int, calls: list[str] | None, frontend: str = "fe1") -> core.FrontendSeen:
    return core.FrontendSeen(wire.FrontendHeartbeat(frontend_id=frontend, ts=0.0, beat=n, calls=calls))


def placed(actions: list[core.Action]) -> bool:
    return any(isinstance(a, core.SendAssign) for a in actions)


def fins(actions: list[core.Action]) -> list[wire.Fin]:
    return [a.msg for a in actions if isinstance(a, core.PublishFin)]


def aborts(actions: list[core.Action]) -> list[str]:
    return [a.cid for a in actions if isinstance(a, core.PublishAbort)]


def run(c: core.Conductor, cid: str, beat_: int = 0) -> None:
    """Open and place call `cid` (every assignment acknowledged)."""
    for a in c.handle(opened(cid, beat_)):
        if isinstance(a, core.SendAssign):
            c.handle(core.AssignResult(cid, a.worker_id, tuple(a.msg.partitions), True))
    assert c.calls[cid].state is core.CallState.RUNNING


# -- the order of an open and its abort ------------------------------------------
def test_an_open_read_after_its_abort_is_never_placed_and_gets_the_aborts_fin() -> None:
    c = conductor()
    assert c.handle(core.AbortRequested("a", "the client aborted", 499)) == []
    acts = c.handle(opened("a"))
    assert not placed(acts) and "a" not in c.calls and c.active == 0
    [fin] = fins(acts)
    assert (fin.status, fin.reason, fin.error) == (499, "aborted", "the client aborted")
    assert c.handle(opened("a")) == []  # read once more: answered already


def test_an_open_read_again_after_its_call_ended_is_not_placed_again() -> None:
    c = conductor()
    run(c, "a")
    assert fins(c.handle(core.AbortRequested("a", "the client aborted", 499)))
    assert c.handle(opened("a")) == []  # redelivered: its ack was lost while the conductor was deaf
    assert c.active == 0


def test_an_abort_of_a_call_that_ended_is_not_taken_for_an_early_one() -> None:
    c = conductor()
    run(c, "a")
    c.handle(core.PartitionDone("a", wire.Done(partition="Encoder", worker_id="w1", outputs=0)))
    assert fins(c.handle(core.PartitionDone("a", wire.Done(partition="Talker", worker_id="w1", outputs=0))))[0].status == 200
    assert c.handle(core.AbortRequested("a", "late", 499)) == []
    assert c.handle(opened("a")) == []


def test_the_calls_remembered_as_ended_are_bounded() -> None:
    c = conductor()
    for i in range(core.ENDED_MAX + 10):
        c.handle(core.AbortRequested(f"x{i}", "gone", 499))
    assert len(c.ended) == core.ENDED_MAX
    assert "x0" not in c.ended and f"x{core.ENDED_MAX + 9}" in c.ended


# -- the frontends' listings -------------------------------------------------------
def test_a_call_two_listings_leave_out_is_ended_and_its_slot_comes_back() -> None:
    c = conductor()
    run(c, "a", beat_=3)
    run(c, "b", beat_=3)
    assert c.active == LIMIT
    assert fins(c.handle(opened("c", 3)))[0].status == 503  # full
    assert c.handle(beat(4, ["b"])) == []  # one listing without it: the frontend's own abort may be on its way
    acts = c.handle(beat(5, ["b"]))
    assert aborts(acts) == ["a"]  # the workers are told
    [fin] = fins(acts)
    assert (fin.status, fin.error) == (499, core.LET_GO)
    assert c.active == 1 and "a" in c.ended
    assert placed(c.handle(opened("d", 5)))  # the slot is back


def test_a_listing_built_before_the_frontend_took_the_call_does_not_count() -> None:
    c = conductor()
    run(c, "a", beat_=7)
    for n in (5, 6, 7):  # built before it took the call: late, but they say nothing of it
        c.handle(beat(n, []))
    assert c.calls["a"].unheld == 0
    c.handle(beat(8, []))
    assert "a" in c.calls and c.calls["a"].unheld == 1


def test_a_call_listed_again_starts_its_count_again() -> None:
    c = conductor()
    run(c, "a", beat_=1)
    c.handle(beat(2, []))
    c.handle(beat(3, ["a"]))
    c.handle(beat(4, []))
    assert "a" in c.calls and c.calls["a"].unheld == 1


def test_an_older_listing_than_the_one_kept_counts_nothing() -> None:
    c = conductor()
    run(c, "a", beat_=1)
    c.handle(beat(3, []))
    assert c.handle(beat(2, [])) == [] and c.handle(beat(3, [])) == []  # a replay, or out of order
    assert "a" in c.calls and c.listings["fe1"] == core.Listing(3, frozenset())


def test_a_frontend_that_lists_nothing_has_nothing_ended() -> None:
    c = conductor()
    run(c, "a", beat_=0)
    for n in range(1, 5):  # a 1.1 frontend (no beats, no list), or one holding more than it lists
        assert c.handle(beat(n, None)) == []
    assert c.handle(core.FrontendSeen(wire.FrontendHeartbeat(frontend_id="fe1", ts=0.0))) == []
    assert "a" in c.calls


def test_another_frontends_listing_ends_nothing_of_this_ones() -> None:
    c = conductor()
    run(c, "a", beat_=1)
    c.handle(beat(2, [], frontend="fe2"))
    c.handle(beat(3, [], frontend="fe2"))
    assert "a" in c.calls


def test_an_open_its_frontend_let_go_before_it_was_read_is_never_placed() -> None:
    c = conductor()
    c.handle(beat(9, ["b"]))
    acts = c.handle(opened("a", beat=8))  # taken before beat 9, which no longer lists it
    assert not placed(acts) and "a" not in c.calls
    [fin] = fins(acts)
    assert (fin.status, fin.error) == (499, core.LET_GO)
    assert placed(c.handle(opened("b", beat=8)))  # listed: it is held
    assert placed(c.handle(opened("c", beat=9)))  # taken after beat 9 was built


def test_an_open_from_a_lost_frontend_is_not_placed_until_it_beats_again() -> None:
    c = conductor()
    c.handle(beat(4, []))
    c.handle(core.FrontendLost("fe1"))
    acts = c.handle(opened("a", beat=4))  # read after the loss: nobody holds it
    assert not placed(acts) and (fins(acts)[0].status, fins(acts)[0].error) == (499, core.LOST)
    c.handle(beat(6, ["b"]))  # it was frozen, not gone: it holds what it lists from now on
    assert placed(c.handle(opened("b", beat=5)))


def test_a_restored_call_keeps_its_frontends_beat() -> None:
    c = conductor()
    run(c, "a", beat_=7)
    fresh = conductor()
    fresh.restore([c.calls["a"].record()])
    fresh.handle(beat(6, []))  # the latest heartbeat a restarted conductor's watch replays: built before
    fresh.handle(beat(7, []))
    assert "a" in fresh.calls and fresh.calls["a"].unheld == 0


def test_the_frontends_listings_are_bounded() -> None:
    c = conductor()
    for i in range(core.FRONTENDS_MAX + 3):
        c.handle(core.FrontendLost(f"fe{i}"))
    assert len(c.listings) == core.FRONTENDS_MAX and "fe0" not in c.listings


# -- the frontend's side: its heartbeats ---------------------------------------------
def test_the_frontends_heartbeats_are_numbered_and_list_the_calls_it_holds() -> None:
    held: dict[str, object] = {}
    beats = Beats("fe1", held, limit=3)
    assert beats.taken() == 0  # a call taken now is listed from heartbeat 1 on
    held["a"] = object()
    first = wire.decode_as(beats.next(), wire.FrontendHeartbeat)
    assert (first.frontend_id, first.beat, first.calls) == ("fe1", 1, ["a"])
    assert beats.taken() == 1
    held.update({"b": 1, "c": 1})
    assert wire.decode_as(beats.next(), wire.FrontendHeartbeat).calls == ["a", "b", "c"]
    held["d"] = 1
    over = wire.decode_as(beats.next(), wire.FrontendHeartbeat)
    assert (over.beat, over.calls) == (3, None)  # more than it lists: none listed, none ended for it


def test_a_call_ended_for_its_frontend_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    c = conductor()
    observer = Observer(c, ConductorMetrics())
    run(c, "a", beat_=1)
    for n in (2, 3):
        ev = beat(n, [])
        observer.after(ev, c.handle(ev), 0.0)
    assert "call a ended: its frontend no longer holds it" in caplog.text


# -- calls that move to another frontend (a realtime session resumed there) -------------
def adopting(n: int, calls: list[str], adopted: dict[str, int], frontend: str = "fe2") -> core.FrontendSeen:
    hb = wire.FrontendHeartbeat(frontend_id=frontend, ts=0.0, beat=n, calls=calls, adopted=adopted)
    return core.FrontendSeen(hb)


def test_a_call_another_frontend_lists_as_adopted_is_its_from_then_on() -> None:
    """fe1 lends the call (lists it) until fe2's heartbeat lists it as adopted: from then on
    fe1's listings, and fe1's loss, say nothing of it; fe2's do."""
    c = conductor()
    run(c, "a", beat_=1)
    assert c.handle(beat(2, ["a"])) == []  # lent: still listed by fe1
    acts = c.handle(adopting(7, ["a"], {"a": 1}))
    [saved] = [a.record for a in acts if isinstance(a, core.SaveRecord)]
    assert (saved.frontend_id, saved.moves, saved.frontend_beat) == ("fe2", 1, 6)
    assert core.Call.from_record(saved).moves == 1  # a restarted conductor knows it too
    for n in (3, 4, 5):
        assert aborts(c.handle(beat(n, []))) == []  # fe1 let it go: nothing ends
    assert c.handle(core.FrontendLost("fe1")) == [] and "a" in c.calls
    assert c.handle(adopting(8, ["a"], {"a": 1})) == []  # the same move again: nothing new
    assert aborts(c.handle(adopting(9, [], {}))) == []
    assert aborts(c.handle(adopting(10, [], {}))) == ["a"]  # fe2 let it go in turn: ended


def test_a_late_or_unlisted_adoption_does_not_take_a_call() -> None:
    """Moves only go forward: fe2's heartbeat naming an older move (delivered late, or built
    before fe2 let the call go to fe3) leaves it with fe3; an adoption not among the calls
    listed, or of a call the conductor does not know, moves nothing."""
    c = conductor()
    run(c, "a", beat_=1)
    c.handle(adopting(5, ["a"], {"a": 1}))
    c.handle(adopting(3, ["a"], {"a": 2}, frontend="fe3"))
    assert (c.calls["a"].frontend_id, c.calls["a"].moves) == ("fe3", 2)
    assert c.handle(adopting(6, ["a"], {"a": 1})) == []
    assert c.calls["a"].frontend_id == "fe3"
    assert c.handle(adopting(4, [], {"a": 3}, frontend="fe4")) == []
    assert c.handle(adopting(5, ["zz"], {"zz": 1}, frontend="fe4")) == []
    assert c.calls["a"].frontend_id == "fe3"


def test_a_frontend_lists_a_lent_call_until_it_is_returned_and_names_its_adopted_ones() -> None:
    from types import SimpleNamespace

    held: dict[str, object] = {"a": SimpleNamespace(moves=0), "b": SimpleNamespace(moves=2), "c": object()}
    beats = Beats("fe1", held)
    beats.lend("d")
    hb = wire.decode_as(beats.next(), wire.FrontendHeartbeat)
    assert (hb.calls, hb.adopted) == (["a", "b", "c", "d"], {"b": 2})
    assert beats.returned("d") and not beats.returned("d")
    assert wire.decode_as(beats.next(), wire.FrontendHeartbeat).calls == ["a", "b", "c"]
