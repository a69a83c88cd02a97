"""bus.subscribe_direct against a real nats-server: every message reaches the handler, in
order, with no task per subscription; a failing handler does not end the subscription."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg

from shared.bus import nats_io as bus


async def test_direct_subscription_delivers_in_order_and_survives_a_bad_message(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        got: list[bytes] = []

        def handler(m: Msg) -> None:
            if m.data == b"bad":
                raise ValueError("a handler bug")
            got.append(m.data)

        sub = await bus.subscribe_direct(nc, "direct.test", handler)
        assert isinstance(sub._pending_queue, bus._Direct)  # the fast path, not the fallback
        assert sub._wait_for_msgs_task is not None
        await asyncio.sleep(0)
        assert sub._wait_for_msgs_task.done()  # no task per subscription
        for i in range(500):
            await nc.publish("direct.test", b"bad" if i == 7 else str(i).encode())
        await nc.flush()
        for _ in range(100):
            if len(got) == 499:
                break
            await asyncio.sleep(0.02)
        assert got == [str(i).encode() for i in range(500) if i != 7]
        await sub.unsubscribe()
        await nc.publish("direct.test", b"after")
        await nc.flush()
        await asyncio.sleep(0.1)
        assert got[-1] == b"499"
    finally:
        await nc.close()
