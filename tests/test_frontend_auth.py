"""Who may start work on a frontend: bearer tokens and the Origin allow-list.

The rules (services/frontend/auth.py) without sockets; then a stack with tokens, through
POST /generate, WS /generate/ws and WS /v1/realtime (the official openai SDK, whose api_key
is the bearer token), and a stack without tokens, where a foreign page is still refused."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from websockets.typing import Origin, Subprotocol

from models.echo import FRAME
from services.frontend.auth import Access, Grant
from services.frontend.exposure import is_loopback, warn_if_open
from shared.runtime.config import parse_config
from shared.runtime.errors import Forbidden, Unauthorized
from tests.support.audio import pcm_file
from tests.support.realtime import sdk_client
from tests.support.stack import Stack, running_stack

TOKEN = "s3cret-token_1"


# -- the rules -------------------------------------------------------------------
def test_origins_own_page_listed_or_none() -> None:
    a = Access(allowed_origins=["https://app.example.com"])
    assert a.check({"host": "127.0.0.1:8000"}, "ws") == Grant()  # no Origin: not a browser
    assert a.check({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000"}, "ws") == Grant()  # its own page
    assert a.check({"host": "h:443", "origin": "https://h"}, "wss") == Grant()  # default ports compared as such
    assert a.check({"host": "127.0.0.1:8000", "origin": "https://APP.example.com"}, "http") == Grant()
    refused = a.check({"host": "127.0.0.1:8000", "origin": "http://evil.test"}, "ws")
    assert isinstance(refused, Forbidden) and refused.status == 403 and "evil.test" in refused.message
    # The same host under the other scheme is another origin.
    assert isinstance(a.check({"host": "h:8000", "origin": "https://h:8000"}, "ws"), Forbidden)


def test_tokens_by_header_or_subprotocol() -> None:
    a = Access(tokens=[TOKEN, "other"])
    assert isinstance(a.check({"host": "h"}, "http"), Unauthorized)
    assert isinstance(a.check({"host": "h", "authorization": "Bearer nope"}, "http"), Unauthorized)
    assert a.check({"host": "h", "authorization": f"Bearer {TOKEN}"}, "http") == Grant()
    assert a.check({"host": "h", "authorization": "bearer other"}, "http") == Grant()
    protos = ["something", f"duplexbus.bearer.{TOKEN}"]
    assert a.check({"host": "h"}, "ws", protos) == Grant(subprotocol=f"duplexbus.bearer.{TOKEN}")
    assert a.check({"host": "h"}, "ws", ["openai-insecure-api-key.other"]) == Grant("openai-insecure-api-key.other")
    assert isinstance(a.check({"host": "h"}, "ws", ["duplexbus.bearer.wrong"]), Unauthorized)
    # A foreign page is refused before its token is even looked at.
    foreign = {"host": "h", "origin": "http://evil.test", "authorization": f"Bearer {TOKEN}"}
    assert isinstance(a.check(foreign, "http"), Forbidden)


def test_an_open_frontend_says_so_loudly(caplog: pytest.LogCaptureFixture) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    with caplog.at_level(logging.WARNING):
        warn_if_open("127.0.0.1", parse_config({}))
        warn_if_open("0.0.0.0", parse_config({"auth": {"tokens": [TOKEN]}}))
        assert caplog.records == []
        warn_if_open("0.0.0.0", parse_config({}))
    assert "no bearer token is set" in caplog.text and "anyone who reaches it" in caplog.text


def test_tokens_from_the_environment_add_to_the_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from shared.runtime.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("auth:\n  tokens: [a]\n")
    monkeypatch.setenv("DUPLEXBUS_TOKENS", " b , c ")
    assert load_config(str(cfg)).auth.tokens == ["a", "b", "c"]


# -- through the services ------------------------------------------------------------
@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "auth": {"tokens": [TOKEN]}}) as s:
        yield s


def samples() -> np.ndarray:
    return (np.arange(3 * FRAME) % 5000).astype("<i2")


async def test_post_needs_a_token(stack: Stack) -> None:
    body = {"files": [pcm_file(samples())], "end_input": True}
    async with httpx.AsyncClient(base_url=stack.http_url(), timeout=30) as http:
        r = await http.post("/generate", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["status"] == 401
        r = await http.post("/generate", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await http.post("/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert "finish" in lines[-1] and sum("output" in x for x in lines) == 3
        # A page of another origin is refused, token or not (the browser would send it along).
        r = await http.post("/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.test"})
        assert r.status_code == 403
        health = (await http.get("/healthz")).json()
        assert "pid" not in health and health["ready"] is True


async def test_sockets_need_a_token_by_header_or_subprotocol(stack: Stack) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(stack.ws_url(0))
    assert refused.value.response.status_code == 403
    with pytest.raises(websockets.InvalidStatus) as foreign:  # a page of another origin, with a token
        await websockets.connect(
            stack.ws_url(0), origin=Origin("http://evil.test"), additional_headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert foreign.value.response.status_code == 403
    own = Origin(stack.http_url())  # the page at / talks to its own frontend
    async with websockets.connect(stack.ws_url(0), origin=own, subprotocols=[Subprotocol(f"duplexbus.bearer.{TOKEN}")]):
        pass
    for kwargs in ({"additional_headers": {"Authorization": f"Bearer {TOKEN}"}}, {"subprotocols": [f"duplexbus.bearer.{TOKEN}"]}):
        async with websockets.connect(stack.ws_url(0), **kwargs) as ws:
            if "subprotocols" in kwargs:
                assert ws.subprotocol == f"duplexbus.bearer.{TOKEN}"  # accepted with it, as browsers require
            await ws.send(json.dumps({"request_id": "t1", "files": [pcm_file(samples())], "end_input": True}))
            while "finish" not in (m := json.loads(await ws.recv())) and "error" not in m:
                pass
            assert "finish" in m, m


async def test_realtime_takes_the_sdks_api_key_as_the_token(stack: Stack) -> None:
    async with sdk_client(stack.ports[0], TOKEN).realtime.connect(model="echo") as conn:
        first = await conn.recv()
        assert first.type == "session.created"
    with pytest.raises(websockets.InvalidStatus):
        async with sdk_client(stack.ports[0], "wrong").realtime.connect(model="echo") as conn:
            await conn.recv()
