"""LinkWatch (shared/bus/link.py), pure: a deaf connection gets reconnects forced, and past its
bound it is lost for good; a connection nats-py is mending is never lost for that."""

from __future__ import annotations

import pytest

from shared.bus.link import Link, LinkSample, LinkWatch

UP = LinkSample(connected=True, reading=True, closed=False)
DEAF = LinkSample(connected=True, reading=False, closed=False)
DOWN = LinkSample(connected=False, reading=False, closed=False)
CLOSED = LinkSample(connected=False, reading=False, closed=True)


def seen(w: LinkWatch, sample: LinkSample, now: float) -> tuple[bool, Link]:
    """What `observe` returns, and the state it leaves."""
    return w.observe(sample, now), w.state


def test_a_deaf_connection_gets_a_reconnect_forced_at_once_and_again_every_retry() -> None:
    w = LinkWatch(deaf_bound_s=10.0, retry_s=2.0)
    assert seen(w, UP, 0.0) == (False, Link.UP)
    forced = [t for t in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5) if w.observe(DEAF, t)]
    assert forced == [1.0, 3.0] and w.state is Link.DEAF


def test_a_reconnect_that_mends_it_makes_it_up_and_a_new_deafness_starts_its_own_clock() -> None:
    w = LinkWatch(deaf_bound_s=10.0, retry_s=2.0)
    assert seen(w, DEAF, 0.0) == (True, Link.DEAF)
    assert seen(w, DOWN, 0.5) == (False, Link.DOWN)  # nats-py reconnecting
    assert seen(w, UP, 1.0) == (False, Link.UP)
    assert seen(w, DEAF, 9.0) == (True, Link.DEAF)  # deaf again: forced at once, and not lost at 10 s from the first
    assert seen(w, DEAF, 10.5) == (False, Link.DEAF)


def test_deaf_past_its_bound_whatever_was_forced_is_lost_and_stays_lost() -> None:
    w = LinkWatch(deaf_bound_s=10.0, retry_s=2.0)
    for t in range(0, 10):
        w.observe(DEAF, float(t))
    assert w.state is Link.DEAF and not w.lost
    assert not w.observe(DEAF, 10.0)
    assert w.lost and "reading nothing for 10.0 s" in w.why
    assert not w.observe(UP, 11.0) and w.lost  # nothing leaves it: the process is to be replaced


def test_a_connection_nats_py_is_mending_is_never_lost_however_long_it_takes() -> None:
    w = LinkWatch(deaf_bound_s=10.0, retry_s=2.0)
    assert not any(w.observe(DOWN, float(t)) for t in range(0, 600))
    assert w.state is Link.DOWN and not w.lost
    assert seen(w, UP, 600.0) == (False, Link.UP)


@pytest.mark.parametrize("before", [UP, DEAF, DOWN], ids=["up", "deaf", "down"])
def test_a_connection_closed_under_it_is_lost_at_once(before: LinkSample) -> None:
    w = LinkWatch()
    w.observe(before, 0.0)
    assert not w.observe(CLOSED, 0.5)
    assert w.lost and "closed" in w.why
