"""A client that stops reading is disconnected once `max_send_buffer_mb` of output waits
for it, its calls are aborted and their slots freed, and it slows no other client.

The slow client sends enough input for its echo outputs to fill the kernel's socket
buffers and then the frontend's bound, and then goes silent without closing: the frontend
must act on its own, not on the client's next message."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import websockets

from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack

SEND_BUFFER_MB = 1.0
CONFIG = {"model": "echo", "max_send_buffer_mb": SEND_BUFFER_MB, "max_call_input_mb": 1024.0}
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


def _live_calls(stack: Stack) -> int:
    with urllib.request.urlopen(stack.http_url(0) + "/healthz", timeout=5) as r:
        return int(json.loads(r.read())["calls"])


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
        # Now silent, socket open: the frontend must notice by itself.
        t0 = time.monotonic()
        reader_frames = 0
        while _live_calls(stack) > 1:
            assert time.monotonic() - t0 < 60, "the slow client's call was not ended"
            await ws.send({"request_id": "reader", "append": [pcm_file(np.ones(1280, dtype="<i2"))]})
            await ws.until(lambda m: m.get("request_id") == "reader" and "output" in m, timeout=5)
            reader_frames += 1
            await asyncio.sleep(0.08)
        assert "not reading" in stack.logs()
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
