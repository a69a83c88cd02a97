"""The frontend holds client input while its bus connection is backed up (pressure.BusPressure):
a round trip past slow_s holds it, one under fast_s takes it again, and one that settles under
slow_s does too after settle_s, so a far server never holds input for ever."""

from __future__ import annotations

from services.frontend.pressure import BusPressure


def test_a_slow_round_trip_holds_input_and_a_fast_one_takes_it_again() -> None:
    p = BusPressure(slow_s=0.25, fast_s=0.05, settle_s=1.0)
    assert p.observed(0.002, now=0.0) and p.observed(0.2, now=0.1)  # under slow_s: taken
    assert not p.observed(0.3, now=0.2) and p.holds == 1
    assert not p.observed(0.1, now=0.4)  # better, not caught up: still held
    assert p.observed(0.01, now=0.5) and p.held_since is None
    assert p.holds == 1


def test_a_probe_not_back_in_slow_s_holds_input_at_once() -> None:
    p = BusPressure(slow_s=0.25)
    assert not p.observed(None, now=0.0)
    assert not p.observed(None, now=0.3) and p.holds == 1  # one hold, however long
    assert p.observed(0.001, now=2.0)


def test_a_round_trip_that_never_gets_short_does_not_hold_input_for_ever() -> None:
    p = BusPressure(slow_s=0.25, fast_s=0.05, settle_s=1.0)
    assert not p.observed(0.4, now=0.0)
    assert not p.observed(0.12, now=0.5)
    assert p.observed(0.12, now=1.0)  # under slow_s a second after the hold: taken again
    assert not p.observed(0.5, now=1.2) and p.holds == 2
