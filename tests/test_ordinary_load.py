"""bench/ordinary_load.py: its figures (pure), its baseline's checkout, and a smoke run of every
client and opening on a real stack, tiny."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ordinary_load as ol
from tests.support.stack import from_source


def test_calls_open_within_their_window_and_spread_over_the_sockets() -> None:
    offsets = ol.open_offsets(200, 0.08, random.Random(1))
    assert len(offsets) == 200 and all(0 <= x <= 0.08 for x in offsets)
    assert ol.socket_sizes(300, 20) == [15] * 20
    assert ol.socket_sizes(7, 3) == [3, 2, 2]
    assert ol.socket_sizes(2, 20) == [1, 1]  # no empty socket
    assert (ol.frames_of(10), ol.frames_of(1), ol.frames_of(0.3)) == (125, 13, 4)


def test_the_steady_state_starts_once_every_call_is_warm_and_ends_with_the_first_call() -> None:
    t = ol.Tally()
    # a: opens at 0, sends to 3.0, its frame 2 (an opening's delay) late; b: opens at 1.0, sends
    # to 2.0. Steady: from 1.0 + 0.5 to 2.0.
    for k in range(31):
        t.record("a", k, k * 0.1, 0.500 if k == 2 else 0.010)
    for k in range(11):
        t.record("b", k, 1.0 + k * 0.1, 0.030)
    t.finished = 1
    s = t.summary(calls=3, frames_per_call=31, warmup_s=0.5)
    assert s["steady_frames"] == 6 + 6  # a's 15..20, b's 5..10
    assert s["lag_p50_ms"] == pytest.approx(30)
    assert s["lag_p99_ms"] == pytest.approx(30)
    assert s["lag_p99_all_ms"] == pytest.approx(500)  # the opening counts there
    assert (s["call_p99_median_ms"], s["call_p99_worst_ms"]) == (pytest.approx(10), pytest.approx(30))
    assert (s["frames"], s["expected_frames"]) == (42, 93)
    assert s["errors"] == 2  # of three calls one finished


def test_a_steady_state_too_short_for_any_frame_counts_each_call_past_its_own_warmup() -> None:
    t = ol.Tally()
    t.record("a", 0, 0.0, 0.001)
    t.record("a", 1, 0.08, 0.002)
    t.record("b", 0, 0.5, 0.003)
    assert t.summary(calls=2, frames_per_call=2, warmup_s=0.05)["steady_frames"] == 1


def test_rounds_alternate_which_stack_goes_first_and_ratios_pair_rounds() -> None:
    cases = [ol.Case(200, "tuned", "ramp"), ol.Case(300, "tuned", "ramp")]
    order = [(r, c.calls, s) for r, c, s in ol.rounds_order(cases, ["A", "B"], 2)]
    assert order == [
        (0, 200, "A"),
        (0, 200, "B"),
        (0, 300, "A"),
        (0, 300, "B"),
        (1, 200, "B"),
        (1, 200, "A"),
        (1, 300, "B"),
        (1, 300, "A"),
    ]
    results = [
        {"case": "x", "round": 0, "stack": "A", "lag_p99_ms": 10.0, "us_per_frame": {"frontend": 90.0}},
        {"case": "x", "round": 0, "stack": "B", "lag_p99_ms": 20.0, "us_per_frame": {"frontend": 100.0}},
        {"case": "x", "round": 1, "stack": "A", "lag_p99_ms": 40.0, "us_per_frame": {"frontend": 80.0}},
        {"case": "x", "round": 1, "stack": "B", "lag_p99_ms": 10.0, "us_per_frame": {"frontend": 100.0}},
        {"case": "x", "round": 2, "stack": "A", "lag_p99_ms": 30.0},  # its pair is missing: left out
    ]
    rs = ol.ratios(results, "A", "B")["x"]
    assert rs["lag_p99_ms"] == pytest.approx(2.25)  # the median of 0.5 and 4.0
    assert rs["frontend"] == pytest.approx(0.85)
    assert rs["lag_p50_ms"] is None


def test_a_py_spy_profile_is_read_by_self_and_inclusive_share(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (/x/cli.py:3);run (/x/loop.py:9);parse (/x/protocol.py:12) 3\n"
        "main (/x/cli.py:3);run (/x/loop.py:9) 1\n"
        "main (/x/cli.py:3);publish (/y/bus.py:40) 4\n"
    )
    top = ol.hot(raw)
    assert top[0] == ("publish (bus.py)", 0.5, 0.5)
    assert top[1] == ("parse (protocol.py)", 0.375, 0.375)
    assert ("run (loop.py)", 0.125, 0.5) in top


def test_the_baseline_is_a_checkout_removed_afterwards_whose_code_a_process_imports() -> None:
    with ol.worktree("HEAD") as tree:
        assert (tree / "services" / "frontend" / "protocol.py").is_file()
        where = subprocess.run(
            [sys.executable, "-c", "import services, shared; print(services.__file__, shared.__file__)"],
            env=from_source({"PATH": "/usr/bin:/bin"}, tree),
            cwd=tree,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert all(Path(w).is_relative_to(tree) for w in where), where
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(ol.REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed


def test_smoke_every_client_and_opening_on_a_stack() -> None:
    args = ol.parse_args(["--calls", "2", "--seconds", "0.3", "--sockets", "2", "--ramp", "0.1", "--warmup", "0.05"])
    results = ol.run(args)
    assert {r["case"] for r in results} == {f"2 {c} {o}" for c in ol.CLIENTS for o in ol.OPENS}
    for r in results:
        assert (r["frames"], r["errors"], r["finished"]) == (8, 0, 2), r
        assert r["steady_frames"] > 0 and r["lag_p99_ms"] is not None
        assert r["client_cpu_pct"] > 0
        assert {"frontend", "workers", "nats-server"} <= r["us_per_frame"].keys()
