"""The limits a server needs, each under the hostile load of issue 11 scaled down to seconds,
against a real frontend (loopback only, bounded in count and time):

- raw TCP connections past `max_connections` are refused at once (503);
- connections that never finish their request headers are closed after `header_timeout_s`;
- idle sockets (no call) are closed after `socket_idle_timeout_s` (1000), busy ones are not;
- a fragmented message never finished, a frame cut short, a POST body never finished:
  closed after `message_timeout_s` (1008, 408);
- input held over `frontend_memory_mb`: the newest offenders are closed (1013), the
  frontend's memory stays bounded, and the other clients' calls go on byte-exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tests.support.audio import echo_bytes, padded, pcm_file
from tests.support.client import WS, RawWS
from tests.support.stack import Stack, rss_bytes, running_stack

MB = 1024 * 1024
CONFIG: dict[str, Any] = {
    "model": "echo",
    "max_connections": 48,
    "header_timeout_s": 1.0,
    "message_timeout_s": 1.5,
    "socket_idle_timeout_s": 1.5,
    "frontend_memory_mb": 24.0,
    "max_message_mb": 4.0,
    "max_send_buffer_mb": 1.0,
    "request_timeout_s": 30.0,
}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


def health(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(stack.http_url(0) + "/healthz", timeout=5) as r:
        return dict(json.loads(r.read()))


async def settled(stack: Stack, timeout: float = 10.0) -> dict[str, Any]:
    """/healthz once the frontend holds no connection but the probe's own."""
    deadline = time.monotonic() + timeout
    while True:
        h = await asyncio.to_thread(health, stack)
        if h["connections"] <= 1 or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.1)


class LiveCall:
    """A client's live call, paced, alongside the hostile load: it must go on untouched."""

    def __init__(self, ws: WS, rid: str) -> None:
        self.ws, self.rid = ws, rid
        self.sent: list[np.ndarray] = []

    @classmethod
    async def open(cls, stack: Stack, rid: str) -> LiveCall:
        call = cls(await WS.connect(stack.ws_url(0)), rid)
        await call.ws.send({"request_id": rid})
        return call

    async def append(self) -> None:
        x = np.random.default_rng(len(self.sent)).integers(-20000, 20000, 1280).astype("<i2")
        self.sent.append(x)
        await self.ws.send({"request_id": self.rid, "append": [pcm_file(x)]})

    async def keep_going(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await self.append()
            await asyncio.sleep(0.1)

    async def finish(self) -> None:
        await self.ws.send({"request_id": self.rid, "end_input": True})
        final = await self.ws.final(self.rid, timeout=20)
        assert "finish" in final, final
        assert echo_bytes(self.ws.outputs(self.rid)) == padded(np.concatenate(self.sent))  # byte-exact
        await self.ws.close()


async def test_connections_past_max_connections_are_refused_at_once(stack: Stack) -> None:
    """80 raw TCP connections at once, on top of a client's live socket: those past the cap
    get 503 at once; the ones let in send nothing and are closed by header_timeout_s."""
    live = await LiveCall.open(stack, "cap")
    port = stack.ports[0]
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(80)]
    t0 = time.monotonic()

    async def answer(reader: asyncio.StreamReader) -> tuple[bytes, float]:
        data = await asyncio.wait_for(reader.read(), 10)
        return data.split(b"\r\n", 1)[0], time.monotonic() - t0

    try:
        await live.keep_going(0.5)
        answers = await asyncio.gather(*(answer(r) for r, _ in conns))
    finally:
        for _, w in conns:
            w.close()
    refused = [t for line, t in answers if line == b"HTTP/1.1 503 Service Unavailable"]
    timed_out = [t for line, t in answers if line == b"HTTP/1.1 408 Request Timeout"]
    assert len(refused) == 80 - (CONFIG["max_connections"] - 1), answers  # the live socket counts too
    assert max(refused) < 1.0 and len(timed_out) == CONFIG["max_connections"] - 1
    await live.finish()


async def test_unfinished_request_headers_are_closed_after_header_timeout_s(stack: Stack) -> None:
    """Slowloris: 40 connections trickle a header line every 0.3 s and never end the headers."""
    live = await LiveCall.open(stack, "loris")
    port = stack.ports[0]
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
    t0 = time.monotonic()
    for _, w in conns:
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bytes, float]:
        """A header line every 0.3 s until the server answers: its answer."""
        for i in range(30):
            writer.write(f"X-{i}: y\r\n".encode())
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                data = await asyncio.wait_for(reader.read(4096), 0.3)
                return data.split(b"\r\n", 1)[0], time.monotonic() - t0
        return b"no answer", time.monotonic() - t0

    going = asyncio.create_task(live.keep_going(1.0))
    try:
        answers = await asyncio.gather(*(trickle(r, w) for r, w in conns))
    finally:
        for _, w in conns:
            w.close()
    await going
    assert all(line == b"HTTP/1.1 408 Request Timeout" for line, _ in answers), answers
    assert max(t for _, t in answers) < CONFIG["header_timeout_s"] + 2.0
    await live.finish()
    assert (await settled(stack))["shed"].get("header_timeout_s", 0) >= 40


async def test_idle_sockets_are_closed_and_a_socket_with_a_call_is_not(stack: Stack) -> None:
    """40 sockets that open no call: closed with 1000 after socket_idle_timeout_s. A socket
    whose live call is quiet for longer stays, and its call finishes."""
    await settled(stack)
    quiet = await LiveCall.open(stack, "quiet")
    await quiet.append()
    idle = [await RawWS.connect(stack.ws_url(0)) for _ in range(40)]
    t0 = time.monotonic()
    try:
        closes = await asyncio.gather(*(ws.closed(timeout=10) for ws in idle))
    finally:
        for ws in idle:
            ws.close()
    assert all(code == 1000 and reason.startswith("socket_idle_timeout_s:") for code, reason in closes), closes
    assert time.monotonic() - t0 < CONFIG["socket_idle_timeout_s"] + 3.0
    await asyncio.sleep(0.5)  # quiet for 2 s all told: past the idle timeout, but it has a call
    await quiet.append()
    await quiet.finish()


async def test_an_unfinished_message_closes_its_socket_after_message_timeout_s(stack: Stack) -> None:
    """Fragments without the last one, and a frame cut short: 1008 after message_timeout_s.
    A POST body cut short: 408. The memory they held is let go."""
    live = await LiveCall.open(stack, "frag")
    fragmented = [await RawWS.connect(stack.ws_url(0)) for _ in range(10)]
    cut = [await RawWS.connect(stack.ws_url(0)) for _ in range(5)]
    t0 = time.monotonic()
    for ws in fragmented:
        await ws.text(b'{"request_id": "f", "text": "' + b"a" * 100_000, fin=False)
        await ws.continuation(b"a" * 100_000, fin=False)
    for ws in cut:
        frame = ws.frame_bytes(b"x" * 1_000_000)
        await ws.write(frame[: len(frame) // 3])
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.ports[0])
    writer.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n" + b"{" * 10_000)

    async def post_answer() -> bytes:
        return (await asyncio.wait_for(reader.read(), 10)).split(b"\r\n", 1)[0]

    going = asyncio.create_task(live.keep_going(1.0))
    posted = asyncio.create_task(post_answer())
    try:
        closes = await asyncio.gather(*(ws.closed(timeout=10) for ws in fragmented + cut))
        answer = await posted
    finally:
        writer.close()
        for ws in fragmented + cut:
            ws.close()
    await going
    assert answer == b"HTTP/1.1 408 Request Timeout", answer
    assert all(code == 1008 and reason.startswith("message_timeout_s:") for code, reason in closes), closes
    assert time.monotonic() - t0 < CONFIG["message_timeout_s"] + 3.0
    await live.finish()
    assert (await settled(stack))["buffered_bytes"] < MB


async def test_over_the_memory_budget_the_newest_offenders_are_closed_with_1013(stack: Stack) -> None:
    """Issue 11's load, scaled: 12 sockets each send a 3 MiB fragmented message and never its
    last fragment (36 MiB against a 24 MiB budget). Each holds 100 KB first, so all of them
    are offenders (holding over 64 KiB) when the budget is crossed: the newest are closed
    with 1013 until the rest fit; the older ones hold until message_timeout_s. The
    frontend's memory stays bounded and a live call goes on."""
    await settled(stack)
    live = await LiveCall.open(stack, "budget")
    await live.append()
    pid = int((await asyncio.to_thread(health, stack))["frontend_id"].split("-")[1])  # frontend-{pid}-{random}
    rss0 = rss_bytes(pid)
    socks = [await RawWS.connect(stack.ws_url(0)) for _ in range(12)]  # connected in this order
    for ws in socks:
        await ws.text(b'{"request_id": "m", "text": "' + b"a" * 100_000, fin=False)
    for ws in socks:
        try:
            for _ in range(3):
                await ws.continuation(b"a" * MB, fin=False)
        except ConnectionError:
            pass  # closed by the frontend meanwhile
    await asyncio.sleep(0.3)
    h = await asyncio.to_thread(health, stack)
    rss_peak = rss_bytes(pid)
    try:
        closes = await asyncio.gather(*(ws.closed(timeout=10) for ws in socks))
    finally:
        for ws in socks:
            ws.close()
    codes = [code for code, _ in closes]
    budget_closed = [i for i, (code, reason) in enumerate(closes) if code == 1013 and reason.startswith("frontend_memory_mb:")]
    assert budget_closed and budget_closed == list(range(12 - len(budget_closed), 12)), codes  # the newest
    assert all(code == 1008 for code in codes[: 12 - len(budget_closed)]), codes  # the rest: message_timeout_s
    assert 12 - len(budget_closed) >= int(CONFIG["frontend_memory_mb"]) // 4  # as many as fit were kept
    assert h["buffered_bytes"] <= CONFIG["frontend_memory_mb"] * MB, h
    # Memory: the budget, plus what a few reads past it and the interpreter's allocator keep.
    assert rss_peak - rss0 < CONFIG["frontend_memory_mb"] * MB + 48 * MB, (rss0, rss_peak)
    await live.keep_going(0.5)
    await live.finish()
