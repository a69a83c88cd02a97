"""A socket's bookkeeping of its calls, without NATS: an ended call leaves no trace on the
socket (a long-lived socket opening call after call under fresh request_ids would grow),
and one call's slow opening does not hold up the other calls on the socket."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from types import SimpleNamespace
from typing import Any

from services.frontend.calls import CallInput, InputState
from services.frontend.outbox import Outbox
from services.frontend.relayed_call import RelayedCall
from services.frontend.service import FrontendService
from services.frontend.socket_session import BUS_TROUBLE, SocketSession
from shared.bus import subjects
from shared.runtime.config import parse_config
from shared.runtime.errors import BusTimeout
from tests.support.poll import until


class FakeWS:
    """A socket's outbox that records what is written to it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.outbox = Outbox(self.sent.append)


async def test_an_ended_call_is_forgotten_by_its_socket() -> None:
    cfg = parse_config({"model": "echo", "nats_url": "nats://127.0.0.1:1"})
    svc = FrontendService(cfg)
    ws = FakeWS()
    session = SocketSession(ws.outbox, svc)
    model = svc.model(None)
    for i in range(3):
        rid = f"r{i}"
        inp = CallInput(model, {"audio_in": None}, cfg.max_call_input_bytes, time.monotonic())
        call = RelayedCall(f"cid{i}", rid, inp, session.outbox, True, on_end=session._forget)
        svc.calls[call.cid] = call
        session.calls[rid] = call
        await svc._cleanup(call, {"finish": {"reason": "completed"}})
        assert call.ended.is_set() and session.live(rid) is None
    assert session.calls == {} and svc.calls == {}
    assert len(ws.sent) == 3  # each call's last message still went out
    await svc.tasks.close()


class StubCall:
    def __init__(self, cid: str, request_id: str | None, live: bool) -> None:
        self.cid, self.request_id, self.live = cid, request_id, live
        self.input = SimpleNamespace(state=InputState.OPEN)
        self.ended = asyncio.Event()


class SlowOpens:
    """Stands in for the service: openings wait until let go; appends and aborts are recorded."""

    def __init__(self) -> None:
        self.config = parse_config({})
        self.calls: dict[str, Any] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.log: list[str] = []

    async def open_call(self, o: Any, sink: Any, on_end: Any = None) -> Any:
        self.log.append(f"open {o.request_id}")
        gate = self.gates.setdefault(o.request_id, asyncio.Event())
        await gate.wait()
        call = StubCall(f"c-{o.request_id}", o.request_id, live=o.end_input is None)
        self.calls[call.cid] = call
        self.log.append(f"opened {o.request_id}")
        return call

    async def append(self, call: Any, a: Any) -> None:
        self.log.append(f"append {call.request_id}")

    async def abort(self, call: Any, reason: str, status: int, tell_client: bool = False) -> None:
        self.log.append(f"abort {call.request_id} {status}")
        self.calls.pop(call.cid, None)


def _msg(**m: Any) -> str:
    return json.dumps(m)


APPEND = [{"name": "a.pcm", "data": base64.b64encode(bytes(2560)).decode()}]


async def test_a_slow_opening_holds_up_only_its_own_call() -> None:
    """Call b is opening (its round trips to the bus take a while); call a, live on the same
    socket, goes on appending meanwhile, and b's own append waits for b's opening."""
    svc = SlowOpens()
    session = SocketSession(FakeWS().outbox, svc)  # type: ignore[arg-type]
    svc.gates["a"] = asyncio.Event()
    svc.gates["a"].set()
    await session.handle(_msg(request_id="a"))
    await asyncio.sleep(0)
    assert session.live("a") is not None
    await asyncio.wait_for(session.handle(_msg(request_id="b")), 1)  # returns while b opens
    await asyncio.wait_for(session.handle(_msg(request_id="b", append=APPEND)), 1)
    await asyncio.wait_for(session.handle(_msg(request_id="a", append=APPEND)), 1)
    await asyncio.sleep(0)
    assert svc.log == ["open a", "opened a", "open b", "append a"]  # b's append waits for b
    svc.gates["b"].set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert svc.log[-2:] == ["opened b", "append b"] and not session.lanes
    await session.close()


async def test_a_call_that_opens_after_its_socket_closed_is_aborted() -> None:
    svc = SlowOpens()
    session = SocketSession(FakeWS().outbox, svc)  # type: ignore[arg-type]
    await asyncio.wait_for(session.handle(_msg(request_id="late")), 1)
    await asyncio.sleep(0)
    closing = asyncio.create_task(session.close())
    await asyncio.sleep(0)
    assert not closing.done()  # waits for the opening under way
    svc.gates["late"].set()
    await asyncio.wait_for(closing, 5)
    assert svc.log == ["open late", "opened late", "abort late 499"] and svc.calls == {}


async def test_a_closed_socket_aborts_its_own_calls_one_shots_first() -> None:
    """The session holds its calls, a one-shot without a request_id too; the service is not
    asked whose they are."""
    svc = SlowOpens()
    for rid in ("live", None):
        svc.gates.setdefault(rid, asyncio.Event()).set()  # type: ignore[arg-type]
    session = SocketSession(FakeWS().outbox, svc)  # type: ignore[arg-type]
    await session.handle(_msg(request_id="live"))
    await session.handle(_msg(files=APPEND, end_input=True))  # a one-shot, no request_id
    for _ in range(10):
        await asyncio.sleep(0)
    assert session.live("live") is not None and len(session.unnamed) == 1
    await session.close()
    assert svc.log[-2:] == ["abort None 499", "abort live 499"] and svc.calls == {}


async def test_a_call_that_ended_while_it_opened_is_not_kept() -> None:
    svc = SlowOpens()
    svc.gates["gone"] = asyncio.Event()
    svc.gates["gone"].set()
    real = svc.open_call

    async def ends_at_once(o: Any, sink: Any, on_end: Any = None) -> Any:
        call = await real(o, sink, on_end)
        call.ended.set()
        on_end(call)  # as the service does when a call ends: the session forgets it
        return call

    svc.open_call = ends_at_once  # type: ignore[method-assign]
    session = SocketSession(FakeWS().outbox, svc)  # type: ignore[arg-type]
    await session.handle(_msg(request_id="gone"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert session.live("gone") is None and not session.has_calls


class FakeBus:
    """The bus as the service uses it to end a call: a store that fails, a request_id bucket
    that records what it frees."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.kv = {subjects.KV_REQUEST_IDS: self}

    async def store(self, subject: str, body: bytes) -> None:
        raise BusTimeout(f"storing {subject}", "no answer in time")

    async def release(self, key: str, owner: bytes, revision: int = 0) -> None:
        self.released.append(key)


def _service_on(bus: FakeBus) -> FrontendService:
    svc = FrontendService(parse_config({"model": "echo", "nats_url": "nats://127.0.0.1:1"}))
    svc._bus = bus  # type: ignore[assignment]
    return svc


async def test_an_abort_that_is_not_published_is_logged(caplog: Any) -> None:
    svc = _service_on(FakeBus())
    inp = CallInput(svc.model(None), {"audio_in": None}, svc.config.max_call_input_bytes, time.monotonic())
    call = RelayedCall("cid-x", "r", inp, FakeWS().outbox, True)
    svc.calls[call.cid] = call
    with caplog.at_level("WARNING"):
        await svc.abort(call, "socket closed", 499)
    assert call.ended.is_set() and not svc.calls
    assert "call cid-x: its abort (socket closed) was not published: storing call.cid-x.abort" in caplog.text
    await svc.tasks.close()


async def test_only_a_call_with_a_request_id_frees_one() -> None:
    bus = FakeBus()
    svc = _service_on(bus)
    model = svc.model(None)
    for cid, rid in (("cid-r", "r"), ("cid-none", None)):
        call = RelayedCall(
            cid, rid, CallInput(model, {"audio_in": None}, 1 << 20, time.monotonic()), FakeWS().outbox, rid is not None
        )
        svc.calls[cid] = call
        await svc._cleanup(call)
    assert bus.released == ["r"]  # no attempt on key "" (or None) for the one-shot without one
    await svc.tasks.close()


class OpeningBus:
    """The bus as the service opens a call on it: a request_id bucket, subscriptions, items
    published; the open's store waits until `stored` is set (then fails where `fails`)."""

    def __init__(self, fails: bool = False) -> None:
        self.kv = {subjects.KV_REQUEST_IDS: self}
        self.log: list[str] = []
        self.stored = asyncio.Event()
        self.fails = fails

    async def create(self, key: str, value: bytes) -> int:
        return 1

    def stored_to(self) -> int:
        return 0  # no store acknowledged yet: the call's open says its floor is not known

    async def release(self, key: str, owner: bytes, revision: int = 0) -> None:
        self.log.append(f"release {key}")

    async def subscribe_direct(self, subject: str, handler: Any) -> Any:
        return SimpleNamespace(subject=subject)

    async def publish(self, subject: str, body: bytes) -> None:
        self.log.append(subject)

    async def store_once(self, subject: str, body: bytes, patience_s: float = 0.0) -> None:
        if subject.endswith(".open"):
            await self.stored.wait()
            if self.fails:
                raise BusTimeout(f"storing {subject}", "no answer in time")
        self.log.append(subject)


async def test_a_live_calls_input_flows_while_its_open_is_stored_and_its_end_waits_for_it() -> None:
    """In an open storm the open's store waits behind hundreds of others: the call's appends
    go to the stream meanwhile (a worker reads them at placement), its end of input only once
    the open is stored (the conductor reads a call's open first)."""
    bus = OpeningBus()
    svc = _service_on(bus)  # type: ignore[arg-type]
    svc.ready.set()
    ws = FakeWS()
    session = SocketSession(ws.outbox, svc)
    await session.handle(_msg(request_id="r"))
    await until(lambda: session.live("r") is not None, 5, "the call held by its socket")
    cid = session.calls["r"].cid
    await session.handle(_msg(request_id="r", append=APPEND))
    await until(lambda: subjects.input_(cid, "audio_in") in bus.log, 5, "the append published")
    end = asyncio.create_task(session.handle(_msg(request_id="r", end_input=True)))
    await asyncio.sleep(0.05)
    assert subjects.open_(cid) not in bus.log and subjects.eoi(cid, "audio_in") not in bus.log
    bus.stored.set()
    await end
    await until(lambda: subjects.eoi(cid, "audio_in") in bus.log, 5, "the end of input stored")
    assert bus.log.index(subjects.open_(cid)) < bus.log.index(subjects.eoi(cid, "audio_in"))
    await svc.tasks.close()


async def test_a_live_call_whose_open_cannot_be_stored_ends_with_its_error() -> None:
    bus = OpeningBus(fails=True)
    svc = _service_on(bus)  # type: ignore[arg-type]
    svc.ready.set()
    ws = FakeWS()
    session = SocketSession(ws.outbox, svc)
    await session.handle(_msg(request_id="r"))
    await until(lambda: session.live("r") is not None, 5, "the call held by its socket")
    bus.stored.set()
    await until(lambda: session.live("r") is None, 5, "the call ended")
    assert not svc.calls and "release r" in bus.log
    replies = [json.loads(m) for m in ws.sent]
    assert replies == [{"request_id": "r", "error": BUS_TROUBLE, "status": 503}]
    await svc.tasks.close()
