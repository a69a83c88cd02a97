"""What crosses the bus boundary: services get duplexbus's own message types and BusErrors,
never nats-py's exceptions; a bug is not taken for a bus failure; a request handler's
internal error text does not reach whoever asked."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from nats import errors as nerr
from nats.aio.msg import Msg
from nats.js import errors as jerr

from services.conductor.service import ConductorService
from shared.bus.failures import Denials
from shared.bus.kv import Bucket
from shared.runtime.config import parse_config
from shared.runtime.errors import BusUnavailable, Overloaded
from tests.support.bus import bus_client, connected


class StandInAcks:
    """What Bucket's probe writes through: the connection's stored publishes (shared/bus/acks.py)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    async def publish(self, subject: str, body: bytes, **kw: Any) -> int:
        if self.error is not None:
            raise self.error
        return 1


class StandInKv:
    """nats-py's KeyValue as Bucket's writes use it: its key prefix."""

    _pre = "$KV.test."


def bucket(error: BaseException | None) -> Bucket:
    return Bucket(StandInKv(), "test", Denials(), StandInAcks(error))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "writable"),
    [
        (jerr.BadRequestError(code=400, err_code=10071, description="wrong last sequence: 0"), True),  # a leader refused
        (None, True),
        (nerr.TimeoutError(), False),
        (nerr.NoRespondersError(), False),
        (nerr.ConnectionClosedError(), False),
        (jerr.ServiceUnavailableError(), False),
    ],
)
async def test_a_bucket_is_writable_when_its_leader_answers(error: BaseException | None, writable: bool) -> None:
    assert await bucket(error).writable(timeout=1.0) is writable


async def test_a_bug_in_the_probe_is_raised_not_taken_for_not_writable() -> None:
    """Taken for "not writable", a bug would stop the conductor's liveness for good, silently."""
    with pytest.raises(RuntimeError, match="a bug"):
        await bucket(RuntimeError("a bug")).writable(timeout=1.0)


async def test_acking_and_answering_on_a_closed_connection_raise_bus_errors(nats_url: str) -> None:
    async with bus_client(nats_url, "test-boundary") as conn:
        nc = conn._nc
        request = Msg(_client=nc, subject="test.ask", reply="_INBOX.test", data=b"")
        consumed = Msg(_client=nc, subject="call.c1.open", reply="$JS.ACK.duplex.conductor.1.1.1.1.0", data=b"")
        await nc.close()
        with pytest.raises(BusUnavailable, match=r"answering test\.ask"):
            await conn.answer(request, b"")
        with pytest.raises(BusUnavailable, match=r"acknowledging call\.c1\.open"):
            await conn.ack(consumed)
        await conn.answer(Msg(_client=nc, subject="test.tell", reply="", data=b""), b"")  # no reply asked: nothing to do


async def test_the_conductor_logs_an_ack_that_failed_and_goes_on(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with bus_client(nats_url, "test-boundary-ack") as conn:
        conductor = ConductorService(parse_config({"nats_url": nats_url}))
        conductor._bus = conn
        consumed = Msg(_client=conn._nc, subject="call.c2.open", reply="$JS.ACK.duplex.conductor.1.1.1.1.0", data=b"")
        await conn._nc.close()
        await conductor._ack(consumed)  # a repeat comes of it, not a failure of the conductor
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("acknowledging call.c2.open" in m for m in said), said


async def test_unsubscribing_from_a_closed_connection_is_quiet(nats_url: str) -> None:
    async with bus_client(nats_url, "test-boundary-unsub") as conn:
        sub = await conn.subscribe("test.unsub", _ignore)
        await conn._nc.close()
        await conn.unsubscribe_all([sub])  # nats-py raises its own kinds here: mapped, and nothing left to undo


async def _ignore(msg: object) -> None:
    pass


async def test_a_request_handlers_internal_error_text_does_not_reach_the_asker(nats_url: str) -> None:
    async def buggy(body: bytes) -> bytes:
        raise RuntimeError("secret internal detail")

    async def refusing(body: bytes) -> bytes:
        raise Overloaded("no capacity now")

    async def failing_on_the_bus(body: bytes) -> bytes:
        raise BusUnavailable("asking nats://secret-host:4222", "no server")

    async with bus_client(nats_url, "test-boundary-micro") as conn, connected(nats_url) as nc:
        announced = await conn.announce(
            "boundary",
            "0.0.1",
            "a test",
            {},
            {
                "buggy": ("test.buggy", buggy),
                "refusing": ("test.refusing", refusing),
                "bus": ("test.bus", failing_on_the_bus),
            },
        )
        try:
            bug = await nc.request("test.buggy", b"", timeout=5)
            refusal = await nc.request("test.refusing", b"", timeout=5)
            bus_failure = await nc.request("test.bus", b"", timeout=5)
        finally:
            await announced.stop()
    assert bug.headers is not None and refusal.headers is not None
    assert "secret" not in str(bug.headers) and "internal error" in bug.headers["Nats-Service-Error"]
    assert refusal.headers["Nats-Service-Error"] == "no capacity now"  # written for whoever asked
    assert bus_failure.headers is not None and "secret-host" not in str(bus_failure.headers)
