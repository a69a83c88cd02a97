"""Clients that read slower than their calls' outputs come.

A slow reader loses nothing: past `max_send_buffer_mb` waiting for it, its outputs wait in
the stream and are read from there as it reads (socket and one-shot alike), and what the
frontend holds for it stays bounded. A client that stops reading altogether is dropped
once it has read nothing for `send_timeout_s`, its calls are aborted and their slots
freed, and it slows no other client.

The slow clients send enough input for their echo outputs to fill the kernel's socket
buffers and then the frontend's bound (the client's receive buffer is fixed small, so the
kernel's autotuning cannot hide the test). The one that stops reading goes silent without
closing: the frontend must act on its own, not on the client's next message."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets

from tests.support.audio import echo_bytes, padded, pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack

SEND_BUFFER_MB = 1.0
SEND_TIMEOUT_S = 4.0
CONFIG = {
    "model": "echo",
    "max_send_buffer_mb": SEND_BUFFER_MB,
    "max_call_input_mb": 1024.0,
    "send_timeout_s": SEND_TIMEOUT_S,
    "request_timeout_s": 60.0,  # the silent client's call must end by send_timeout_s, not by this
}
APPEND_S = 2.0  # each append: 25 echo frames, about 87 KB of output


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


CLIENT_RCVBUF = 64 * 1024  # fixed, so the kernel's receive-side autotuning cannot hide the test


def _kernel_socket_buffers() -> int:
    """The most the kernel may hold for the slow connection: its fixed receive buffer plus
    the most the frontend's send buffer can grow to."""
    return 2 * CLIENT_RCVBUF + int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


def _small_buffer_socket(url: str) -> socket.socket:
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    return sock


def _health(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(stack.http_url(0) + "/healthz", timeout=5) as r:
        return dict(json.loads(r.read()))


def _live_calls(stack: Stack) -> int:
    return int(_health(stack)["calls"])


@contextlib.asynccontextmanager
async def most_buffered(stack: Stack) -> AsyncIterator[list[int]]:
    """The most output the frontend held for its clients (/healthz), sampled meanwhile. (Its
    input is bounded apart: these clients send all their input at once.)"""
    seen = [0]

    async def sample() -> None:
        while True:
            seen[0] = max(seen[0], int((await asyncio.to_thread(_health, stack))["buffered"]["output"]))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# Output the kernel cannot hold, several times over: most of it must wait in the stream.
SLOW_AUDIO_S = 240.0  # 3000 echo frames, about 10 MB of output


async def test_a_slow_reader_gets_every_output_and_the_frontend_holds_a_bounded_amount(stack: Stack) -> None:
    """Issue 15: the whole input sent at once, its outputs read at about 2 MB/s. Before,
    the socket was dropped once max_send_buffer_mb waited ("client not reading")."""
    x = np.random.default_rng(7).integers(-20000, 20000, int(16000 * SLOW_AUDIO_S)).astype("<i2")
    url = stack.ws_url(0)
    sock = await websockets.connect(url, sock=_small_buffer_socket(url), max_size=None, max_queue=4)
    try:
        await sock.send(json.dumps({"request_id": "slow-ok"}))
        step = int(16000 * APPEND_S)
        for i in range(0, len(x), step):
            await sock.send(json.dumps({"request_id": "slow-ok", "append": [pcm_file(x[i : i + step])]}))
        await sock.send(json.dumps({"request_id": "slow-ok", "end_input": True}))
        outputs: list[dict[str, Any]] = []
        received = 0
        async with most_buffered(stack) as held:
            while True:
                raw = await asyncio.wait_for(sock.recv(), 30)
                received += len(raw)
                m = json.loads(raw)
                if "output" in m:
                    outputs.append(m["output"])
                    await asyncio.sleep(0.0015)  # a slow reader: about 2 MB/s
                    continue
                assert "finish" in m, m
                break
    finally:
        await sock.close()
    assert received > 1.5 * (_kernel_socket_buffers() + SEND_BUFFER_MB * 1024 * 1024)  # much of it waited in the stream
    assert m["finish"]["usage"]["frames"] == len(outputs) and echo_bytes(outputs) == padded(x)  # every output, in order
    # What the frontend held: the socket's bound, one message over it, and replies.
    assert held[0] <= 2 * SEND_BUFFER_MB * 1024 * 1024, held[0]


async def test_a_slow_one_shot_reader_gets_every_output(stack: Stack) -> None:
    """The same for POST /generate: its NDJSON lines read slowly over a small-buffered socket."""
    x = np.random.default_rng(8).integers(-20000, 20000, int(16000 * SLOW_AUDIO_S / 2)).astype("<i2")
    body = json.dumps({"request_id": "slow-post", "files": [pcm_file(x)]}).encode()
    async with most_buffered(stack) as held:
        status, lines = await slow_post(stack.http_url(0), body, pause_s=0.002)
    assert status == 200
    msgs = [json.loads(line) for line in lines]
    assert "finish" in msgs[-1], msgs[-1]
    outs = [m["output"] for m in msgs[:-1]]
    assert msgs[-1]["finish"]["usage"]["frames"] == len(outs) and echo_bytes(outs) == padded(x)
    assert held[0] <= 2 * SEND_BUFFER_MB * 1024 * 1024, held[0]


async def slow_post(base: str, body: bytes, pause_s: float) -> tuple[int, list[bytes]]:
    """POST /generate over a socket with a small receive buffer, read in 4 KiB pieces with a
    pause between them; the status and the NDJSON lines."""
    sock = _small_buffer_socket(base)
    reader, writer = await asyncio.open_connection(sock=sock)
    host = base.split("//")[1]
    head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    data = bytearray()
    while chunk := await asyncio.wait_for(reader.read(4096), 30):
        data += chunk
        await asyncio.sleep(pause_s)
    writer.close()
    head_bytes, _, rest = bytes(data).partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ")[1])
    text = bytearray()
    while rest:  # chunked transfer encoding
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        text += rest[:size]
        rest = rest[size + 2 :]
    return status, [line for line in bytes(text).split(b"\n") if line]


async def test_client_not_reading_is_disconnected_and_others_go_on(stack: Stack, ws: WS) -> None:
    frame = pcm_file(np.ones(int(16000 * APPEND_S), dtype="<i2"))
    output_per_append = 25 * 3500
    appends = int(1.5 * (_kernel_socket_buffers() + SEND_BUFFER_MB * 1024 * 1024) / output_per_append) + 10

    # A reading client's live call, paced, all through the test.
    await ws.send({"request_id": "reader"})

    url = stack.ws_url(0)
    slow = await websockets.connect(url, sock=_small_buffer_socket(url), max_size=None, max_queue=1)  # stops reading at once
    try:
        await slow.send(json.dumps({"request_id": "slow"}))
        for _ in range(appends):
            await slow.send(json.dumps({"request_id": "slow", "append": [frame]}))
        # Now silent, socket open: the frontend must notice by itself. (Its call is live by
        # then: its opening may still be under way when the last append has been sent.)
        t0 = time.monotonic()
        while _live_calls(stack) < 2:
            assert time.monotonic() - t0 < 20, "the slow client's call never opened"
            await asyncio.sleep(0.05)
        reader_frames = 0
        while _live_calls(stack) > 1:
            assert time.monotonic() - t0 < 60, "the slow client's call was not ended"
            await ws.send({"request_id": "reader", "append": [pcm_file(np.ones(1280, dtype="<i2"))]})
            await ws.until(lambda m: m.get("request_id") == "reader" and "output" in m, timeout=5)
            reader_frames += 1
            await asyncio.sleep(0.08)
        assert "client not reading: send_timeout_s" in stack.procs["frontend-0"].log.read_text()
        # The reader was served while the slow client filled its bound: each of its appends
        # was echoed within until()'s 5 s, at least once before the slow call ended.
        assert reader_frames >= 1
        with pytest.raises(websockets.ConnectionClosed):  # the server dropped it
            for _ in range(50):
                await slow.send(json.dumps({"request_id": "slow", "append": [frame]}))
                await asyncio.sleep(0.05)
    finally:
        await slow.close()

    # The reading client's call was never held up, and finishes normally.
    await ws.send({"request_id": "reader", "end_input": True})
    m = await ws.final("reader", timeout=20)
    assert "finish" in m, m
    assert m["finish"]["usage"]["frames"] == reader_frames and not ws.outputs("reader"), (m, reader_frames)
