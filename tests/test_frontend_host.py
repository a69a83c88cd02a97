"""DNS rebinding: a frontend answers only the Host names it should (services/frontend/hosts.py).

The rule without sockets, the ASGI check (`app.HostCheck`) on hand-made scopes, then a stack
without tokens on loopback (the `make up` default): a request whose Host and Origin are both
`evil.example` gets 421 on `POST /generate`, `WS /generate/ws`, `WS /v1/realtime` and the
health routes, while `localhost` and `127.0.0.1` are served. The same stack holds the small
rules of issue 25: a POST announcing a body over `max_message_mb` is refused (413) before it
is read, and one socket cannot take every slot (`max_calls_per_socket`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import numpy as np
import pytest

from services.frontend.app import HostCheck, announced_too_large
from services.frontend.hosts import HostRule, host_name, is_loopback_address
from shared.runtime.config import parse_config
from shared.runtime.errors import BodyTooLarge, MisdirectedHost
from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack

LOOPBACK = "127.0.0.1"
FRAME = np.arange(1280, dtype="<i2")  # one echo item


# -- the rule ----------------------------------------------------------------------
def test_a_loopback_frontend_without_tokens_answers_loopback_names_and_addresses() -> None:
    rule = HostRule()
    for host in ("localhost", "localhost:8000", "LOCALHOST:8000", "localhost.", "127.0.0.1", "127.0.0.1:8000",
                 "[::1]", "[::1]:8000", "::1", "192.0.2.7:8000", "[2001:db8::1]:443"):  # fmt: skip
        assert rule.refusal(host, LOOPBACK) is None, host
    assert rule.refusal(None, LOOPBACK) is None  # no Host: no browser sent it
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
        err = rule.refusal(host, LOOPBACK)
        assert isinstance(err, MisdirectedHost) and err.status == 421, host
        assert "auth.allowed_hosts" in err.message and "\n" not in err.message, err.message
    err = rule.refusal("Evil.Example:8000", LOOPBACK)
    assert err is not None and err.host == "evil.example"


def test_a_malformed_host_is_refused() -> None:
    for host in ("", "a b", "evil.example:80x", "[::1", "[::1]x", "[evil]:80", "user@localhost", "local_host\x00"):
        assert isinstance(HostRule().refusal(host, LOOPBACK), MisdirectedHost), repr(host)


def test_allowed_hosts_names_domains_and_any() -> None:
    cfg = parse_config({"auth": {"allowed_hosts": ["API.example.com", ".corp.example", " "]}})
    rule = HostRule.from_config(cfg)
    assert rule.allowed == ("api.example.com", ".corp.example")
    for host in ("api.example.com:443", "corp.example", "a.b.corp.example:8000", "localhost", "10.0.0.2"):
        assert rule.refusal(host, LOOPBACK) is None, host
    for host in ("example.com", "xapi.example.com", "evilcorp.example", "corp.example.evil"):
        assert rule.refusal(host, LOOPBACK) is not None, host
    assert HostRule(allowed=("*",)).refusal("anything.example", LOOPBACK) is None


def test_which_connections_are_checked() -> None:
    evil = "evil.example"
    assert HostRule().refusal(evil, "::ffff:127.0.0.1") is not None  # loopback through a dual-stack socket
    assert HostRule().refusal(evil, None) is not None  # where the connection came from is not known: checked
    assert HostRule().refusal(evil, "192.0.2.7") is None  # reached over another interface, by a name of the operator's
    assert HostRule(tokens=True).refusal(evil, LOOPBACK) is None  # a rebinding page cannot know a token
    # Listed names hold everywhere, tokens or not.
    assert HostRule(allowed=("api.example.com",), tokens=True).refusal(evil, "192.0.2.7") is not None
    assert HostRule(allowed=("api.example.com",), tokens=True).refusal("api.example.com", "192.0.2.7") is None
    assert is_loopback_address("127.8.9.10") and is_loopback_address("[::1]") and not is_loopback_address("::ffff:10.0.0.1")
    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM.:80") == "example.com" and host_name("x:") == "x"


def test_a_content_length_over_the_limit_is_refused_unread() -> None:
    class Req:
        def __init__(self, length: str | None) -> None:
            self.headers = {"content-length": length} if length is not None else {}

    err = announced_too_large(Req("1025"), 1024)  # type: ignore[arg-type]
    assert isinstance(err, BodyTooLarge) and err.status == 413 and err.message.startswith("max_message_mb: ")
    for length in ("1024", "0", None, "nonsense"):  # at the limit, none (chunked: counted as read), not a number
        assert announced_too_large(Req(length), 1024) is None  # type: ignore[arg-type]


# -- the ASGI check ------------------------------------------------------------------
async def through_check(scope_type: str, host: str, extensions: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """What HostCheck sends for one request (on a loopback connection); `passed` when it let it through."""
    sent: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        sent.append({"type": "passed"})

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"} if scope_type == "websocket" else {"type": "http.request", "body": b""}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": scope_type,
        "headers": [(b"host", host.encode()), (b"origin", f"http://{host}".encode())],
        "server": (LOOPBACK, 8000),
        "path": "/generate/ws",
        "query_string": b"",
        "extensions": extensions or {},
    }
    await HostCheck(inner, HostRule())(scope, receive, send)
    return sent


async def test_the_check_answers_421_before_any_route() -> None:
    assert await through_check("http", "localhost:8000") == [{"type": "passed"}]
    sent = await through_check("http", "evil.example:8000")
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 421
    body = json.loads(sent[1]["body"])
    assert body["status"] == 421 and "auth.allowed_hosts" in body["error"]
    # A socket: the denial as an HTTP response where the server can send one, a close otherwise.
    sent = await through_check("websocket", "evil.example", {"websocket.http.response": {}})
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 421
    assert [m["type"] for m in await through_check("websocket", "evil.example")] == ["websocket.close"]
    assert await through_check("websocket", "[::1]:8000") == [{"type": "passed"}]


# -- through a real stack ----------------------------------------------------------------
CONFIG = {"model": "echo", "max_concurrent_requests": 8, "max_calls_per_socket": 3, "max_message_mb": 0.25}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def handshake(port: int, path: str, host: str, origin: str | None = None) -> tuple[int, str]:
    """A WebSocket handshake with the Host (and Origin) a browser on a rebinding name sends: (status, body)."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"]  # fmt: skip
    if origin is not None:
        lines.append(f"Origin: {origin}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        length = [int(h.split(b":")[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")]
        body = await asyncio.wait_for(reader.readexactly(length[0]), 10) if length else b""
        return status, body.decode()
    finally:
        writer.close()


async def test_a_rebinding_page_gets_421_on_every_route(stack: Stack) -> None:
    port = stack.ports[0]
    evil = f"evil.example:{port}"
    for path in ("/generate/ws", "/v1/realtime?model=echo"):
        status, body = await handshake(port, path, evil, f"http://{evil}")
        assert status == 421 and "auth.allowed_hosts" in body, (path, status, body)
    async with httpx.AsyncClient(base_url=stack.http_url(), timeout=10) as client:
        headers = {"host": evil, "origin": f"http://{evil}"}
        r = await client.post("/generate", json={"text": "hi"}, headers=headers)
        assert r.status_code == 421 and "auth.allowed_hosts" in r.json()["error"], r.text
        for path in ("/healthz", "/readyz", "/metrics", "/"):
            assert (await client.get(path, headers={"host": evil})).status_code == 421, path
        # Loopback names and addresses are served.
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            r = await client.post("/generate", json={"files": [pcm_file(FRAME)]}, headers={"host": host})
            assert r.status_code == 200 and "finish" in r.text.splitlines()[-1], r.text
    assert (await handshake(port, "/generate/ws", f"localhost:{port}", f"http://localhost:{port}"))[0] == 101
    # A page on another origin (no rebinding: its Host is the frontend's) is the Origin rule's: 403.
    assert (await handshake(port, "/generate/ws", f"127.0.0.1:{port}", "http://evil.example"))[0] == 403


async def test_a_post_over_max_message_mb_is_refused_before_its_body(stack: Stack) -> None:
    """The Content-Length alone: nothing of the body is sent, and the answer comes all the same."""
    reader, writer = await asyncio.open_connection(LOOPBACK, stack.ports[0])
    length = 64 * 1024 * 1024
    writer.write(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413"), head
        rest = await asyncio.wait_for(reader.read(4096), 10)
        assert b"max_message_mb" in rest, rest
    finally:
        writer.close()


async def test_one_socket_cannot_take_every_slot(stack: Stack) -> None:
    """The probe of issue 25 in small: one socket opens request_ids as fast as it can; it gets
    max_calls_per_socket of them, the rest 429, and a call on another socket is admitted."""
    greedy, other = await WS.connect(stack.ws_url()), await WS.connect(stack.ws_url())
    try:
        for i in range(12):
            await greedy.send({"request_id": f"g{i}"})
        refused = [await greedy.final(f"g{i}") for i in range(3, 12)]
        assert all(m["status"] == 429 and m["error"].startswith("max_calls_per_socket: ") for m in refused), refused
        await other.send({"request_id": "fair", "files": [pcm_file(FRAME)]})
        await other.send({"request_id": "fair", "end_input": True})
        assert "finish" in await other.final("fair")
        # A slot of the socket's own comes back as one of its calls ends.
        await greedy.send({"request_id": "g0", "end_input": True})
        assert "finish" in await greedy.final("g0")
        await greedy.send({"request_id": "g12", "files": [pcm_file(FRAME)], "end_input": True})
        assert "finish" in await greedy.final("g12")
    finally:
        await greedy.close()
        await other.close()
