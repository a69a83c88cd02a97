"""The frontend's limits without a network: limits.Guard decides which connections end and why
(the cap, the timeouts, the memory budget, newest offenders first)."""

from __future__ import annotations

from services.frontend.limits import OFFENDER_MIN, Guard, Limits, Load, Shed

MB = 1024 * 1024


def limits(**kw: float) -> Limits:
    base: dict[str, float] = {
        "max_connections": 3,
        "memory_bytes": 10 * MB,
        "send_buffer_bytes": MB,
        "header_timeout_s": 1.0,
        "message_timeout_s": 2.0,
        "send_timeout_s": 3.0,
        "idle_timeout_s": 4.0,
    }
    base.update(kw)
    return Limits(**base)  # type: ignore[arg-type]


class FakeConn:
    def __init__(self, name: str, **load: float | None) -> None:
        self.name = name
        self.now = Load(**load)  # type: ignore[arg-type]
        self.shed_for: list[str] = []

    def load(self, now: float) -> Load:
        return self.now

    def shed(self, why: Shed) -> None:
        self.shed_for.append(why.key)

    def __repr__(self) -> str:
        return self.name


def test_connections_past_the_cap_are_refused() -> None:
    g = Guard(limits(max_connections=2))
    a, b, c = FakeConn("a"), FakeConn("b"), FakeConn("c")
    assert g.admit(a) and g.admit(b) and not g.admit(c)
    assert len(g) == 2 and g.shed_count == {"max_connections": 1}
    g.release(a)
    assert g.admit(c)
    g.adopt(FakeConn("one-shot"), counted=False)  # a holder of the app's: not a connection
    assert len(g) == 2


def test_over_the_budget_the_newest_offenders_end_until_the_rest_fit() -> None:
    g = Guard(limits(memory_bytes=10 * MB))
    conns = [FakeConn(f"c{i}", input=4 * MB) for i in range(3)] + [FakeConn("small", output=OFFENDER_MIN - 1)]
    for c in conns:
        g.adopt(c)
    assert g.report(conns[0], 4 * MB, 0.0) == [] and g.report(conns[1], 4 * MB, 0.0) == []
    assert g.report(conns[3], OFFENDER_MIN - 1, 0.0) == []
    # c2 puts it over: the newest offender is c2 itself (the small one is newer but holds too little).
    shed = g.report(conns[2], 4 * MB, 0.0)
    assert [(c, why.key, why.ws_code) for c, why in shed] == [(conns[2], "frontend_memory_mb", 1013)]
    assert g.total == 8 * MB + OFFENDER_MIN - 1 and g.shed_count == {"frontend_memory_mb": 1}
    assert g.report(conns[2], 4 * MB, 0.0) == []  # one that was ended is not counted or chosen again


def test_the_budget_counts_what_connections_hold_now_not_what_they_last_reported() -> None:
    """Output drains without a report (the client read it): the guard looks again before it
    ends anyone."""
    g = Guard(limits(memory_bytes=10 * MB))
    old, new = FakeConn("old", output=0), FakeConn("new", input=6 * MB)
    g.adopt(old)
    g.adopt(new)
    g.report(old, 8 * MB, 0.0)  # it held 8 MB once; it has drained since
    assert g.report(new, 6 * MB, 0.0) == []
    assert g.total == 6 * MB


def test_the_sweep_ends_connections_past_each_timeout() -> None:
    g = Guard(limits())
    fresh = FakeConn("fresh", headers_since=9.5, message_since=9.0, stalled_since=8.0, idle_since=7.0)
    headers = FakeConn("headers", headers_since=8.9)
    message = FakeConn("message", message_since=7.9)
    stalled = FakeConn("stalled", stalled_since=6.9, output=100)
    idle = FakeConn("idle", idle_since=5.9)
    for c in (fresh, headers, message, stalled, idle):
        g.adopt(c, counted=False)
    got = {c.name: why for c, why in g.sweep(10.0)}  # type: ignore[attr-defined]
    assert {k: (w.key, w.ws_code, w.http_status, w.drop) for k, w in got.items()} == {
        "headers": ("header_timeout_s", 1008, 408, False),
        "message": ("message_timeout_s", 1008, 408, False),
        "stalled": ("send_timeout_s", 1008, 503, True),  # not reading: dropped, no goodbye
        "idle": ("socket_idle_timeout_s", 1000, 408, False),
    }
    assert all(w.reason.startswith(w.key + ":") for w in got.values())  # the reason names the key
    assert g.sweep(10.0) == []  # each is ended once; `fresh` is within every bound


def test_a_sweep_also_brings_the_frontend_back_under_its_budget() -> None:
    g = Guard(limits(memory_bytes=5 * MB))
    a, b = FakeConn("a", output=3 * MB), FakeConn("b", output=3 * MB)
    g.adopt(a)
    g.adopt(b)
    assert [(c, w.key) for c, w in g.sweep(0.0)] == [(b, "frontend_memory_mb")]


def test_sweep_period_follows_the_shortest_timeout() -> None:
    assert limits().sweep_s == 0.25
    assert limits(header_timeout_s=10, message_timeout_s=30, idle_timeout_s=120).sweep_s == 1.0
