"""The nats-server itself is killed (SIGKILL) mid-call and restarted on its store: the call completes."""

from __future__ import annotations

import asyncio

import numpy as np

from models.echo import FRAME
from shared.bus.embedded import NatsServer
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import own_nats_server
from tests.support.client import WS
from tests.support.stack import Stack


async def test_server_killed_and_restarted_mid_call() -> None:
    with own_nats_server("duplexbus-nats-restart-") as first:
        await _outage_mid_call(first)


async def _outage_mid_call(first: NatsServer) -> None:
    server = first
    try:
        stack = Stack(server.url, {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 10.0})
        try:
            await stack.start(workers=[["Encoder"], ["Talker"]])
            await stack.wait_workers(2)
            ws = await WS.connect(stack.ws_url())
            samples = (np.arange(40 * FRAME) % 25000).astype("<i2")
            await ws.send({"request_id": "outage"})
            for k in range(20):
                await ws.send({"request_id": "outage", "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
                await asyncio.sleep(0.02)
            await ws.until(lambda m: "output" in m and m["output"]["frame"] >= 10, timeout=20, keep=True)
            server.kill()
            for k in range(20, 30):  # appends during the outage wait in the frontend's client buffer
                await ws.send({"request_id": "outage", "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
                await asyncio.sleep(0.02)
            server = NatsServer(first.store_dir, port=first.port).start()  # same port, same store
            for k in range(30, 40):
                await ws.send({"request_id": "outage", "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
                await asyncio.sleep(0.02)
            await ws.send({"request_id": "outage", "end_input": True})
            final = await ws.final("outage", timeout=60)
            assert "finish" in final, (final, stack.logs())
            outs = ws.outputs("outage")
            assert [o["frame"] for o in outs] == list(range(40))
            assert echo_bytes(outs) == samples.tobytes()
            await ws.close()
        finally:
            stack.stop()
    finally:
        server.stop()  # the restarted one (the first, killed, is stopped with its folder)
