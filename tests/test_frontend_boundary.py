"""The frontend's side of the bus boundary, without NATS: a bus failure is retried or logged
as one (`BusError`), a bug is not taken for one, and neither's text reaches a client: a
client is told a generic line with the status, the log has the rest."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from starlette.websockets import WebSocket

from services.frontend import service as frontend_service
from services.frontend.app import error_response
from services.frontend.calls import CallInput
from services.frontend.outbox import Outbox
from services.frontend.outputs import Outputs
from services.frontend.realtime import events as ev
from services.frontend.realtime.endpoint import EventLog, EventSender, RealtimeHub
from services.frontend.realtime.session import Out, SendText
from services.frontend.relayed_call import RelayedCall
from services.frontend.service import FrontendService
from services.frontend.socket_session import BUS_TROUBLE, SocketSession, error_body
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BadRequest, BusDenied, BusError, BusTimeout, BusUnavailable
from shared.runtime.metrics import FrontendMetrics
from shared.sdk.model import ClientInput
from tests.support.poll import until

SECRET = "nats://10.1.2.3:4222"  # what a bus failure's text may hold and a client must not see


def bus_failure() -> BusUnavailable:
    return BusUnavailable(f"storing call.c1.open on {SECRET}", "nats: no servers available for connection")


def discard(message: bytes) -> None:
    pass


def texts(sent: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(m) for m in sent]


class FailingCalls:
    """Stands in for the service: an opening or an append fails on the bus."""

    def __init__(self, open_fails: bool) -> None:
        self.config = ServingConfig(model="echo")
        self.open_fails = open_fails
        self.aborts: list[tuple[str, int]] = []

    async def open_call(self, o: Any, sink: Any, on_end: Any = None) -> Any:
        if self.open_fails:
            raise bus_failure()
        svc = FrontendService(self.config)
        inp = CallInput(svc.model(None), {"audio_in": None}, self.config.max_call_input_bytes, time.monotonic())
        return RelayedCall("c1", o.request_id, inp, sink, True)

    async def append(self, call: Any, a: Any) -> None:
        raise bus_failure()

    async def abort(self, call: Any, reason: str, status: int, tell_client: bool = False) -> None:
        self.aborts.append((reason, status))


async def test_an_opening_that_fails_on_the_bus_tells_the_client_a_generic_503(caplog: pytest.LogCaptureFixture) -> None:
    sent: list[bytes] = []
    session = SocketSession(Outbox(sent.append), FailingCalls(open_fails=True))  # type: ignore[arg-type]
    await session.handle(json.dumps({"request_id": "r1"}))
    await until(lambda: sent, 5, "the opening's reply")
    assert texts(sent) == [{"request_id": "r1", "error": BUS_TROUBLE, "status": 503}]
    assert any(SECRET in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)  # the log has it
    await session.close()


async def test_an_append_that_fails_on_the_bus_ends_the_call_with_a_generic_reason() -> None:
    calls = FailingCalls(open_fails=False)
    session = SocketSession(Outbox(discard), calls)  # type: ignore[arg-type]
    await session.handle(json.dumps({"request_id": "r1"}))
    await until(lambda: session.live("r1"), 5, "the call opened")
    await session.handle(json.dumps({"request_id": "r1", "append": {"text": "hi"}}))
    assert calls.aborts == [(BUS_TROUBLE, 503)]  # the abort's reason is what the client is told


def test_an_http_error_body_of_a_bus_failure_is_generic() -> None:
    response = error_response("r1", BusTimeout(f"asking {SECRET}", "nats: timeout"))
    assert response.status_code == 503 and json.loads(bytes(response.body))["error"] == BUS_TROUBLE


class StandInSocket:
    """What the realtime endpoint uses of a Starlette WebSocket (no send_now: a writer task)."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"type": "websocket", "extensions": {}}
        self.sent: list[str] = []
        self.closed: list[tuple[int, str]] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed.append((code, reason))


@pytest.fixture
async def hub() -> AsyncIterator[RealtimeHub]:
    h = RealtimeHub(FrontendService(ServingConfig(model="echo")))
    yield h
    await h.close()


async def test_a_realtime_append_that_fails_on_the_bus_is_a_server_error_with_a_generic_message(
    hub: RealtimeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = hub._session("echo", hub.svc.model("echo"))
    session.call = cast(RelayedCall, object())  # open: the append goes to the (failing) service

    async def append(call: Any, a: Any) -> None:
        raise bus_failure()

    delivered: list[Out] = []
    monkeypatch.setattr(hub.svc, "append", append)
    monkeypatch.setattr(session, "deliver", delivered.append)
    await session.act(Out(actions=[SendText("hi", "e1")]))
    errors = [e["error"] for out in delivered for e in out.events if e["type"] == "error"]
    assert errors == [{"type": "server_error", "code": "server_error", "message": BUS_TROUBLE, "param": None, "event_id": "e1"}]


async def test_a_failed_resume_tells_the_client_no_internal_text(
    hub: RealtimeHub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    old = hub._session("echo", hub.svc.model("echo"))
    hub.detached[old.core.resume_token] = old

    async def replay(outbox: Any, last_seen: int) -> None:
        raise RuntimeError(f"a bug that knows {SECRET}")

    monkeypatch.setattr(old, "replay", replay)
    sock = StandInSocket()
    outbox = EventSender(cast(WebSocket, sock), 10_000)
    event = ev.ClientEvent("e1", ev.Resume(old.core.resume_token, None))
    assert await hub.resume(outbox, event, None) is None
    assert sock.closed == [(1011, "resume failed")]
    [said] = [json.loads(t) for t in sock.sent]
    assert said["error"]["message"] == "resume failed" and SECRET not in json.dumps(said)
    assert any(r.exc_info is not None and SECRET in str(r.exc_info[1]) for r in caplog.records)  # logged, whole
    if old.expiry is not None:
        old.expiry.cancel()


class PublishingBus:
    """A bus whose publish fails with `errors`, one per publish, then works."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.published: list[str] = []

    async def publish(self, subject: str, body: bytes) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.published.append(subject)


class HasBus:
    def __init__(self, bus: Any) -> None:
        self.bus = bus


async def test_a_realtime_event_lost_to_the_bus_is_logged_and_the_log_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    bus = PublishingBus(bus_failure())
    log = EventLog(HasBus(bus), "c1")  # type: ignore[arg-type]
    task = asyncio.create_task(log.run())
    log.put(1, b"{}")
    log.put(2, b"{}")
    await asyncio.wait_for(log.drain(), 5)
    assert bus.published == ["call.c1.rt"] and not task.done()
    assert any("storing a realtime event failed" in r.getMessage() for r in caplog.records)
    task.cancel()


async def test_a_bug_under_the_realtime_event_log_is_raised_not_taken_for_a_bus_failure() -> None:
    log = EventLog(HasBus(PublishingBus(RuntimeError("a bug"))), "c1")  # type: ignore[arg-type]
    task = asyncio.create_task(log.run())
    log.put(1, b"{}")
    with pytest.raises(RuntimeError, match="a bug"):
        await asyncio.wait_for(task, 5)


class ReadingBus:
    """A bus whose stored reads fail with `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def read_stored(self, filters: list[str], after: int = 0) -> AsyncIterator[tuple[str, bytes, int]]:
        raise self.error
        yield  # an async generator, as BusConnection.read_stored is


def recovering_outputs(error: BaseException) -> tuple[Outputs, RelayedCall]:
    config = ServingConfig(model="echo")
    model = FrontendService(config).model(None)
    inp = CallInput(model, {"audio_in": None}, config.max_call_input_bytes, time.monotonic())
    call = RelayedCall("c1", "r1", inp, Outbox(discard), True)

    async def end(*_: Any) -> None:
        pass

    outputs = Outputs({"c1": call}, lambda: ReadingBus(error), FrontendMetrics(), end)  # type: ignore[arg-type,return-value]
    call.recovering = True
    return outputs, call


async def test_a_recovery_read_that_fails_on_the_bus_is_logged_and_read_again_later(caplog: pytest.LogCaptureFixture) -> None:
    outputs, call = recovering_outputs(bus_failure())
    await outputs._recover(call)
    assert not call.recovering  # `check` starts the next read when it is due
    assert any("recovering the outputs of c1 failed" in r.getMessage() for r in caplog.records)


async def test_a_bug_in_a_recovery_read_is_raised_for_its_task_set_to_log() -> None:
    outputs, call = recovering_outputs(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        await outputs._recover(call)
    assert not call.recovering


class LookingBus:
    """has_consumer answers from `answers` in turn: an exception is raised."""

    def __init__(self, *answers: bool | BusError) -> None:
        self.answers = list(answers)

    async def has_consumer(self, durable: str) -> bool:
        answer = self.answers.pop(0)
        if isinstance(answer, BusError):
            raise answer
        return answer

    async def note_tail(self) -> None:
        """Where the stream ends, read once ready (nothing to read here)."""


@pytest.fixture
def frontend(monkeypatch: pytest.MonkeyPatch) -> FrontendService:
    monkeypatch.setattr(frontend_service, "CONDUCTOR_POLL_S", 0.001)
    return FrontendService(ServingConfig(model="echo"))


async def test_waiting_for_the_conductor_logs_a_bus_outage_once_and_its_end(
    frontend: FrontendService, caplog: pytest.LogCaptureFixture
) -> None:
    """Failures, then no conductor yet (no fault: polled quietly), then one: ready."""
    timeout = BusTimeout("looking up consumer conductor", "nats: timeout")
    frontend._bus = LookingBus(timeout, timeout, timeout, False, False, True)  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="services.frontend.service"):
        await asyncio.wait_for(frontend._wait_for_conductor(), 5)
    assert frontend.ready.is_set()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "services.frontend.service"]
    assert [m for level, m in said if level == logging.WARNING] == [
        "looking for the conductor's consumer failed: looking up consumer conductor: nats: timeout; trying again"
    ]
    assert any(m.startswith("looking for the conductor's consumer works again after") for _, m in said)


async def test_waiting_for_the_conductor_stops_at_once_on_a_refusal(
    frontend: FrontendService, caplog: pytest.LogCaptureFixture
) -> None:
    frontend._bus = LookingBus(BusDenied("looking up consumer conductor", "permissions violation"))  # type: ignore[assignment]
    with pytest.raises(BusDenied):
        await asyncio.wait_for(frontend._wait_for_conductor(), 5)
    assert not frontend.ready.is_set()
    assert any(r.levelno == logging.ERROR and "cannot start serving" in r.getMessage() for r in caplog.records)


def test_a_models_decoding_failure_tells_the_client_no_internal_text(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a model's decoding raises is a 400 (I-4), but in words of the frontend's own:
    the exception's text (a library's internals, a bug's details) goes to the log."""
    config = ServingConfig(model="echo")
    model = FrontendService(config).model(None)

    def decode(inp: Any) -> Any:
        raise ValueError(f"a decoder that knows {SECRET}")

    monkeypatch.setattr(model, "process_prompt", decode)
    inp = CallInput(model, {"audio_in": None}, config.max_call_input_bytes, time.monotonic())
    with pytest.raises(BadRequest) as refused:
        inp.accept(ClientInput(text="hi"), opening=True, end=None, now=time.monotonic())
    assert SECRET not in refused.value.message
    with caplog.at_level(logging.INFO, logger="services.frontend.socket_session"):
        body = error_body("r1", refused.value)
    assert body == {"request_id": "r1", "error": "the input could not be decoded by model 'echo'", "status": 400}
    assert any(SECRET in r.getMessage() for r in caplog.records)
