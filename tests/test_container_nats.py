"""NATS from the compose file's image in a container, through testcontainers, and the services
on the host: the conductor, a worker and a frontend as processes (tests/support/stack.py)
reach the server through its published port, and a live `echo` call comes back whole. The
image is the one `docker compose up` runs (a local stand-in where no registry answers:
scripts/docker.sh nats); without an engine the test is skipped with the line saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.calls import EchoCall
from tests.support.containers import labelled, nats_container, nats_url, prepare, this_run
from tests.support.stack import running_stack

# The first test pays for the engine and the image on a new machine (scripts/docker.sh).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def nats_in_a_container() -> Iterator[str]:
    prepare("nats")
    with nats_container() as container:
        yield nats_url(container)


async def test_a_live_call_through_nats_in_a_container(nats_in_a_container: str) -> None:
    ours = labelled(str(this_run()))["container"]
    assert len(ours) == 1, ours  # the container, labelled with this run for a later run to clean up
    async with running_stack(nats_in_a_container, {"model": "echo"}) as stack:
        call = await EchoCall.open(stack.ws_url(), "in-a-container", frames=40)
        await call.send(40)
        await call.finish(logs=stack.logs())
