"""A frontend's stop as a gateway sees it (docs/operations.md, "Upgrading a running
deployment"): on SIGTERM it keeps listening for `shutdown_unlist_s`, answering 503 to
/healthz and to every new call before the handshake or the body (a gateway may retry those
on another frontend: nothing was taken or sent), and closes its listener after; and a
drain waits for an opening or an ending still under way: one that ended meanwhile would
close the socket (1012) under a call that then streams, or before a call's finish."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import numpy as np
import pytest
import uvicorn
import websockets
from websockets.exceptions import InvalidStatus

from services.frontend.calls import CallInput
from services.frontend.outbox import Outbox
from services.frontend.protocol import Opening, parse_message
from services.frontend.relayed_call import RelayedCall
from services.frontend.service import FrontendService
from shared.bus import subjects
from shared.runtime.config import parse_config
from shared.runtime.errors import Conflict, KeyTaken
from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, listening, running_stack

UNLIST_S = 3.0
CONFIG = {"model": "echo", "shutdown_drain_s": 6.0, "shutdown_unlist_s": UNLIST_S}


def frame() -> dict[str, str]:
    return pcm_file(np.ones(1280, dtype="<i2"))


def _status(port: int, path: str, method: str = "GET", body: bytes | None = None) -> int | None:
    """The HTTP status of a request; None where nothing listens."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def test_a_stopping_frontend_refuses_new_calls_before_the_handshake_then_unlistens(stack: Stack, ws: WS) -> None:
    port = stack.ports[0]
    await ws.send({"request_id": "live", "files": [frame()]})
    await ws.until(lambda m: m.get("request_id") == "live" and "output" in m)

    stack.procs["frontend-0"].p.terminate()  # SIGTERM
    stopped_at = time.monotonic()
    await until(lambda: _status(port, "/healthz") == 503, 5, "/healthz answers 503 once stopping")
    # Still listening: a new socket gets a plain HTTP 503 at its handshake, a POST its 503
    # before its body is read; neither took anything.
    with pytest.raises(InvalidStatus) as refused:
        await websockets.connect(stack.ws_url(0), open_timeout=5)
    assert refused.value.response.status_code == 503
    assert b"the frontend is stopping" in refused.value.response.body
    assert _status(port, "/generate", "POST", b'{"files": []}') == 503
    assert time.monotonic() - stopped_at < UNLIST_S  # all of it within the unlist window
    # The live call goes on meanwhile.
    await ws.send({"request_id": "live", "end_input": True})
    m = await ws.final("live", timeout=5)
    assert "finish" in m, m
    # Then the listener closes.
    await until(lambda: not listening(port), UNLIST_S + 5, "the listener closed after shutdown_unlist_s")
    assert time.monotonic() - stopped_at >= UNLIST_S * 0.8
    stack.procs["frontend-0"].p.wait(15)
    assert "without completing handshake" not in stack.procs["frontend-0"].tail(200)  # a refusal is no error


class GatedRequestIds:
    """The request_id bucket of a bus that answers a create only once let go, then says the
    id is taken (the opening ends there, refused with 409)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.kv = {subjects.KV_REQUEST_IDS: self}

    async def create(self, key: str, value: bytes) -> int:
        self.entered.set()
        await self.gate.wait()
        raise KeyTaken(f"creating {key}", "the key exists")


async def test_a_drain_waits_for_an_opening_under_way() -> None:
    svc = FrontendService(parse_config({"model": "echo", "nats_url": "nats://127.0.0.1:1", "shutdown_drain_s": 10.0}))
    bus = GatedRequestIds()
    svc._bus = bus  # type: ignore[assignment]
    svc.ready.set()
    opening = parse_message(json.dumps({"request_id": "r", "files": [frame()]}))
    assert isinstance(opening, Opening)
    task = asyncio.create_task(svc.open_call(opening, Outbox(lambda b: None)))
    await asyncio.wait_for(bus.entered.wait(), 5)  # past the readiness check, in the round trip
    drain = svc.drain()
    # The opening is under way: the drain (and with it the sockets' close) waits for it.
    done, _ = await asyncio.wait([drain], timeout=0.5)
    assert not done, "the drain ended while an opening was under way"
    bus.gate.set()
    with pytest.raises(Conflict):
        await task
    await asyncio.wait_for(drain, 5)  # and ends once the opening is over
    await svc.tasks.close()


class GatedRelease:
    """The request_id bucket of a bus whose release of a key answers only once let go."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.kv = {subjects.KV_REQUEST_IDS: self}

    async def release(self, key: str, owner: bytes, revision: int = 0) -> None:
        self.entered.set()
        await self.gate.wait()


async def test_a_drain_waits_for_a_call_whose_end_is_under_way() -> None:
    """A call leaves `calls` before its request_id's release, and its finish goes to the
    client after: a drain that ended in between closed the socket (1012) before the finish."""
    svc = FrontendService(parse_config({"model": "echo", "nats_url": "nats://127.0.0.1:1", "shutdown_drain_s": 10.0}))
    bus = GatedRelease()
    svc._bus = bus  # type: ignore[assignment]
    sent: list[bytes] = []
    inp = CallInput(svc.model(None), {"audio_in": None}, svc.config.max_call_input_bytes, time.monotonic())
    call = RelayedCall("cid-e", "r", inp, Outbox(sent.append), True)
    svc.calls[call.cid] = call
    ending = asyncio.create_task(svc._end(call, "finished", 200, {"request_id": "r", "finish": {"reason": "completed"}}))
    await asyncio.wait_for(bus.entered.wait(), 5)  # out of `calls`, its finish not sent yet
    drain = svc.drain()
    done, _ = await asyncio.wait([drain], timeout=0.5)
    assert not done, "the drain ended before the call's finish was sent"
    bus.gate.set()
    await asyncio.wait_for(ending, 5)
    await asyncio.wait_for(drain, 5)
    assert sent and b"finish" in sent[-1]
    await svc.tasks.close()


def test_uvicorn_still_ticks_its_main_loop_through_on_tick() -> None:
    """`server.FrontendServer` delays uvicorn's stop from `on_tick`, which uvicorn's main
    loop calls every 0.1 s: a uvicorn that no longer did would stop the frontend at once."""
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick)
    assert "self.on_tick(" in inspect.getsource(uvicorn.Server.main_loop)
