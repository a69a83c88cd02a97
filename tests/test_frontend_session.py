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

from services.frontend.app import SocketSession
from services.frontend.calls import CallInput, InputState
from services.frontend.service import Call, FrontendService
from services.frontend.websocket import SEND_NOW
from shared.runtime.config import parse_config


class FakeWS:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.scope: dict[str, Any] = {"extensions": {SEND_NOW: self.sent.append}}


async def test_an_ended_call_is_forgotten_by_its_socket() -> None:
    cfg = parse_config({"model": "echo", "nats_url": "nats://127.0.0.1:1"})
    svc = FrontendService(cfg)
    ws = FakeWS()
    session = SocketSession(ws, svc)  # type: ignore[arg-type]
    model = svc.model(None)
    for i in range(3):
        rid = f"r{i}"
        inp = CallInput(model, {"audio_in": None}, cfg.max_call_input_bytes, time.monotonic())
        call = Call(f"cid{i}", rid, inp, session.send, session, True, on_end=session._forget)
        svc.calls[call.cid] = call
        session.calls[rid] = call
        await svc._cleanup(call, {"finish": {"reason": "completed"}})
        assert call.ended.is_set() and session.live(rid) is None
    assert session.calls == {} and svc.calls == {}
    assert len(ws.sent) == 3  # each call's last message still went out
    await svc.tasks.close()


class SlowOpens:
    """Stands in for the service: openings wait until let go; appends and aborts are recorded."""

    def __init__(self) -> None:
        self.config = parse_config({})
        self.calls: dict[str, Any] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.log: list[str] = []

    async def open_call(self, o: Any, sink: Any, owner: Any, on_end: Any = None) -> Any:
        self.log.append(f"open {o.request_id}")
        gate = self.gates.setdefault(o.request_id, asyncio.Event())
        await gate.wait()
        call = SimpleNamespace(cid=f"c-{o.request_id}", request_id=o.request_id, owner=owner, live=True)
        call.input = SimpleNamespace(state=InputState.OPEN)
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
    session = SocketSession(FakeWS(), svc)  # type: ignore[arg-type]
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
    session = SocketSession(FakeWS(), svc)  # type: ignore[arg-type]
    await asyncio.wait_for(session.handle(_msg(request_id="late")), 1)
    await asyncio.sleep(0)
    closing = asyncio.create_task(session.close())
    await asyncio.sleep(0)
    assert not closing.done()  # waits for the opening under way
    svc.gates["late"].set()
    await asyncio.wait_for(closing, 5)
    assert svc.log == ["open late", "opened late", "abort late 499"] and svc.calls == {}
