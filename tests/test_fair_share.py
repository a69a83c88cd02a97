"""Fair share: one client cannot take every slot (services/frontend/shares.py).

The counting without sockets (taken before an opening, given back once however the call
ends), then a stack with two tokens: a socket past `max_calls_per_socket` and a token past
`max_calls_per_token` (over its sockets, `POST /generate` and `/v1/realtime`) get 429 naming
the key while the other token's calls are admitted; `/metrics` wants the token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from services.frontend.protocol import Opening
from services.frontend.shares import Shares, open_shared
from shared.runtime.config import parse_config
from shared.runtime.errors import Overloaded, TooManyCalls
from shared.sdk.model import ClientInput
from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, running_stack

A, B = "token-a_1", "token-b_2"
FRAME = np.arange(1280, dtype="<i2")


# -- the counting ----------------------------------------------------------------------
def test_the_defaults_leave_other_clients_room() -> None:
    cfg = parse_config({})
    assert (cfg.calls_per_socket, cfg.calls_per_token) == (128, 256)  # of 512 slots
    small = parse_config({"max_concurrent_requests": 2})
    assert (small.calls_per_socket, small.calls_per_token) == (1, 1)
    assert parse_config({"max_calls_per_socket": 9, "max_calls_per_token": 20}).calls_per_socket == 9
    with pytest.raises(Exception, match="max_calls_per_token"):
        parse_config({"max_calls_per_token": 0})


def test_a_socket_and_a_token_are_held_to_their_caps() -> None:
    refused: list[TooManyCalls] = []
    shares = Shares(per_socket=2, per_token=3, on_refused=refused.append)
    s1, s2, post = shares.client("token 1", socket=True), shares.client("token 1", socket=True), shares.client("token 1", False)
    s1.take()
    s1.take()
    with pytest.raises(TooManyCalls) as e:
        s1.take()
    assert e.value.status == 429 and e.value.limit == "max_calls_per_socket" and s1.held == 2
    s2.take()  # the token's third
    for share in (s2, post):
        with pytest.raises(TooManyCalls) as e:
            share.take()
        assert e.value.limit == "max_calls_per_token" and e.value.message.startswith("max_calls_per_token: ")
    assert len(refused) == 3
    other = shares.client("token 2", socket=True)
    other.take()  # another token is not held to the first's count
    anonymous = [shares.client(None, socket=True) for _ in range(3)]
    for share in anonymous:  # no token: only each socket's own cap
        share.take()
        share.take()
    s1.give()
    post.take()  # a call of the token ended: room for one more
    for share in (s1, s2, post, other):
        share.give()
    assert shares.by_token == {}  # a token with no call leaves no entry


class FakeService:
    """open_call as the service does it: `on_end` runs when the call ends, also when its
    opening fails after the call was made (the service's cleanup)."""

    def __init__(self, fail: BaseException | None = None, end_first: bool = False) -> None:
        self.fail, self.end_first = fail, end_first
        self.ends: list[Any] = []

    async def open_call(self, o: Opening, sink: Any, on_end: Any = None) -> Any:
        call = object()
        self.ends.append(on_end)
        if self.end_first and on_end is not None:
            on_end(call)
        if self.fail is not None:
            raise self.fail
        return call


async def test_a_share_is_given_back_once_however_the_call_ends() -> None:
    shares = Shares(per_socket=1, per_token=1)
    share = shares.client("token 1", socket=True)
    opening = Opening("r", None, ClientInput())
    ended: list[Any] = []
    svc = FakeService()
    call = await open_shared(share, svc.open_call, opening, None, ended.append)  # type: ignore[arg-type]
    assert share.held == 1 and shares.by_token == {"token 1": 1}
    svc.ends[0](call)
    svc.ends[0](call)  # told twice: given back once
    assert share.held == 0 and ended == [call, call] and shares.by_token == {}
    # A refused opening (no room at the conductor) gives its share back.
    with pytest.raises(Overloaded):
        await open_shared(share, FakeService(Overloaded("full")).open_call, opening, None)  # type: ignore[arg-type]
    assert share.held == 0
    # One the service ended, and then raised for: given back once, not twice.
    with pytest.raises(Overloaded):
        await open_shared(share, FakeService(Overloaded("x"), end_first=True).open_call, opening, None)  # type: ignore[arg-type]
    assert share.held == 0 and shares.by_token == {}
    # Refused by the share itself: the service is never asked.
    share.take()
    untouched = FakeService()
    with pytest.raises(TooManyCalls):
        await open_shared(share, untouched.open_call, opening, None)  # type: ignore[arg-type]
    assert untouched.ends == [] and share.held == 1


# -- through a real stack -----------------------------------------------------------------
CONFIG = {
    "model": "echo",
    "max_concurrent_requests": 16,
    "max_calls_per_socket": 2,
    "max_calls_per_token": 3,
    "auth": {"tokens": [A, B]},
}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def socket(stack: Stack, token: str) -> WS:
    return WS(await websockets.connect(stack.ws_url(), additional_headers={"Authorization": f"Bearer {token}"}, max_size=None))


async def test_a_token_past_its_share_gets_429_and_another_token_is_admitted(stack: Stack) -> None:
    a1, a2, b = await socket(stack, A), await socket(stack, A), await socket(stack, B)
    auth_a = {"Authorization": f"Bearer {A}"}
    try:
        for rid in ("a1", "a2", "a3"):
            await a1.send({"request_id": rid})
        m = await a1.final("a3")
        assert m["status"] == 429 and m["error"].startswith("max_calls_per_socket: "), m
        await a2.send({"request_id": "a4"})
        await a2.send({"request_id": "a5"})
        m = await a2.final("a5")
        assert m["status"] == 429 and m["error"].startswith("max_calls_per_token: "), m
        one_shot = {"files": [pcm_file(FRAME)], "end_input": True}
        async with httpx.AsyncClient(base_url=stack.http_url(), timeout=30) as http:
            r = await http.post("/generate", json=one_shot, headers=auth_a)
            assert r.status_code == 429 and r.json()["error"].startswith("max_calls_per_token: "), r.text
            # /v1/realtime: the session's call is the token's fourth.
            rt = stack.ws_url().replace("/generate/ws", "/v1/realtime?model=echo")
            async with websockets.connect(rt, additional_headers=auth_a) as conn:
                event = json.loads(await conn.recv())
                assert event["type"] == "error" and event["error"]["code"] == "too_many_calls", event
                assert "max_calls_per_token" in event["error"]["message"]
            # The other token's calls are admitted all the while.
            await b.send({"request_id": "b1", "files": [pcm_file(FRAME)], "end_input": True})
            assert "finish" in await b.final("b1")
            # The token's calls end with its socket: its share comes back.
            await a1.close()
            await a2.close()

            async def admitted() -> httpx.Response | None:
                r = await http.post("/generate", json=one_shot, headers=auth_a)
                assert r.status_code in (200, 429), r.text  # 429: the frontend has not seen the sockets close yet
                return r if r.status_code == 200 else None

            done = await until(admitted, 10, "the token's share back once its sockets closed")
            assert done is not None
            assert "finish" in done.text.splitlines()[-1], done.text
    finally:
        for ws in (a1, a2, b):
            await ws.close()


async def test_metrics_want_the_token(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.http_url(), timeout=10) as http:
        r = await http.get("/metrics")
        assert r.status_code == 401 and "auth.tokens" in r.json()["error"], r.text
        assert (await http.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        r = await http.get("/metrics", headers={"Authorization": f"Bearer {B}"})
        assert r.status_code == 200 and "duplexbus_frontend_admission_refusals" in r.text
        assert (await http.get("/healthz")).status_code == 200  # the probes need none
