"""subscribe_direct against a real nats-server: every message reaches the handler, in
order, with no task per subscription; a failing handler does not end the subscription.
And the nats-py internals it relies on are where it expects them: a nats-py upgrade that
moves them fails here, loudly, rather than slowing every service down in silence."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg

from shared.bus import internals


async def test_nats_py_internals_are_where_subscribe_direct_expects_them(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe("direct.check", cb=_ignore)
        assert internals.missing_internals(sub) == [], "nats-py moved what shared/bus/internals.py relies on"
        await sub.unsubscribe()
    finally:
        await nc.close()


async def _ignore(m: Msg) -> None:
    pass


async def test_direct_subscription_delivers_in_order_and_survives_a_bad_message(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        got: list[bytes] = []

        def handler(m: Msg) -> None:
            if m.data == b"bad":
                raise ValueError("a handler bug")
            got.append(m.data)

        sub = await internals.subscribe_direct(nc, "direct.test", handler)
        assert internals.is_direct(sub)  # the fast path, not the fallback
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
