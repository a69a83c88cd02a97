"""A message the server delivered to the conductor and the conductor never received (a route
between cluster nodes dropped with it in flight, a read loop that died) comes again after the
conductor consumer's ack_wait: the call whose open it was waits that long to be placed, so
that wait is short (`shared.bus.connection.CONDUCTOR_ACK_WAIT_S`).

The loss is made here as it happens: the conductor is frozen (SIGSTOP) until its pull request
has expired, another client pulls from the conductor's durable meanwhile and is handed the
open of a new call, and drops it unacknowledged. The call is then placed once the server
delivers the open again. It was 30 s (a full run once saw a call on a cluster wait so, and its
test gave up first)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from models.echo import FRAME
from shared.bus import subjects
from shared.bus.connection import CONDUCTOR_ACK_WAIT_S
from tests.support.audio import pcm_file
from tests.support.bus import connected
from tests.support.client import WS
from tests.support.freeze import frozen
from tests.support.stack import running_stack

CONFIG = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 10.0}
PULL_EXPIRES_S = 1.5  # past the conductor's own pull request (fetch's 1 s): it is handed nothing more


async def test_an_open_delivered_to_the_conductor_and_lost_is_placed_within_ack_wait(nats_url: str) -> None:
    async with running_stack(nats_url, CONFIG) as stack, connected(nats_url) as nc:
        ws = await WS.connect(stack.ws_url())
        conductor = stack.procs["conductor"].p.pid
        thief = await nc.jetstream().pull_subscribe_bind(durable=subjects.CONDUCTOR_DURABLE, stream=subjects.STREAM)
        with frozen(conductor):
            await asyncio.sleep(PULL_EXPIRES_S)
            pulled = asyncio.create_task(thief.fetch(1, timeout=10))
            await asyncio.sleep(0.2)  # the pull request is at the server before the open is stored
            samples = (np.arange(4 * FRAME) % 7000).astype("<i2")
            await ws.send({"request_id": "lost-open", "files": [pcm_file(samples)], "end_input": True})
            taken = await pulled
            assert [m.subject for m in taken] == [subjects.open_(taken[0].subject.split(".")[1])], taken
            lost_at = time.monotonic()  # never acknowledged: delivered again after ack_wait
        final = await ws.final("lost-open", timeout=CONDUCTOR_ACK_WAIT_S + 10)
        waited = time.monotonic() - lost_at
        await ws.close()
        assert "finish" in final, final
        assert waited < CONDUCTOR_ACK_WAIT_S + 4, f"the call waited {waited:.1f} s for its open to come again"
        print(f"the lost open came again and the call finished {waited:.1f} s after the loss")
