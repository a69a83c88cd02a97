"""A socket's bookkeeping of its calls, without NATS: an ended call leaves no trace on the
socket (a long-lived socket opening call after call under fresh request_ids would grow)."""

from __future__ import annotations

import time
from typing import Any

from duplexbus.services.frontend.app import SocketSession
from duplexbus.services.frontend.calls import CallInput
from duplexbus.services.frontend.service import Call, FrontendService
from duplexbus.services.frontend.websocket import SEND_NOW
from duplexbus.shared.config import parse_config


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
