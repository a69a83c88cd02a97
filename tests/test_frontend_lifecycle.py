"""A frontend that is starting (no conductor yet) or stopping refuses calls with 503; a
stopping frontend lets its live calls go on and end, ends those still live after
`shutdown_drain_s` with 503, and only then closes its sockets (1012). A call no worker
serves gets 503 after `placement_timeout_s`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import numpy as np
import pytest
import websockets

from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, listening, running_stack

DRAIN_S = 4.0
CONFIG = {"model": "echo", "shutdown_drain_s": DRAIN_S}


def frame() -> dict[str, str]:
    return pcm_file(np.ones(1280, dtype="<i2"))


def _health(port: int) -> tuple[int, dict[str, object]] | None:
    """(status, body) of /healthz; None while the frontend is not listening yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def test_stopping_frontend_drains_its_calls_then_closes(stack: Stack, ws: WS) -> None:
    await ws.send({"request_id": "ends", "files": [frame()]})
    await ws.send({"request_id": "lingers", "files": [frame()]})
    for rid in ("ends", "lingers"):
        await ws.until(lambda m, rid=rid: m.get("request_id") == rid and "output" in m)

    stack.procs["frontend-0"].p.terminate()  # SIGTERM: the frontend starts to stop
    stopped_at = time.monotonic()
    # Stopping: with shutdown_unlist_s 0 (the test stacks'), the server closes its listener and
    # starts the drain in the same turn of its loop.
    await until(lambda: not listening(stack.ports[0]), 10, "the frontend's listener closed on SIGTERM")

    # No new calls...
    await ws.send({"request_id": "new", "files": [frame()]})
    m = await ws.final("new", timeout=5)
    assert m.get("status") == 503 and "stopping" in m["error"], m
    # ...but the live ones go on: input is still taken and echoed, and a call may end.
    await ws.send({"request_id": "ends", "append": [frame()]})
    await ws.until(lambda m: m.get("request_id") == "ends" and m.get("output", {}).get("frame") == 1)
    await ws.send({"request_id": "ends", "end_input": True})
    m = await ws.final("ends", timeout=5)
    assert "finish" in m, m

    # The one still live at the end of the drain ends with 503, then the socket closes.
    m = await ws.final("lingers", timeout=DRAIN_S + 5)
    took = time.monotonic() - stopped_at
    assert m.get("status") == 503 and "stopping" in m["error"], m
    assert DRAIN_S * 0.8 <= took < DRAIN_S + 3, took
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await ws.recv(timeout=5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    stack.procs["frontend-0"].p.wait(10)


async def test_frontend_without_a_conductor_refuses_calls_with_503(nats_url: str) -> None:
    s = Stack(nats_url, CONFIG)
    try:
        await s.reset_bus()
        port = s.start_frontend()  # no conductor: the frontend never becomes ready
        deadline = time.monotonic() + 30
        health = None
        while health is None and time.monotonic() < deadline:
            health = await asyncio.to_thread(_health, port)
            await asyncio.sleep(0.1)
        assert health is not None
        status, body = health
        assert status == 503 and body["ready"] is False
        ws = await WS.connect(s.ws_url(0))
        try:
            await ws.send({"request_id": "early", "files": [frame()]})
            m = await ws.final("early", timeout=5)
            assert m.get("status") == 503 and "starting" in m["error"], m
        finally:
            await ws.close()
    finally:
        s.stop()


async def test_call_no_worker_can_serve_gets_503_after_the_placement_timeout(nats_url: str) -> None:
    async with running_stack(nats_url, {**CONFIG, "placement_timeout_s": 1.0}, workers=[]) as s:
        ws = await WS.connect(s.ws_url(0))
        try:
            t = time.monotonic()
            await ws.send({"request_id": "nobody", "files": [frame()]})
            m = await ws.final("nobody", timeout=10)
            assert m.get("status") == 503 and "worker" in m["error"], m
            assert 0.9 <= time.monotonic() - t < 5
        finally:
            await ws.close()
