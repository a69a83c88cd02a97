"""subscribe_direct against a real nats-server: every message reaches the handler, in
order, with no task per subscription; a failing handler does not end the subscription.
And the nats-py internals it relies on are where it expects them: a nats-py upgrade that
moves them fails here, loudly, rather than slowing every service down in silence."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from shared.bus import direct, internals, subjects
from shared.runtime.errors import BusTimeout


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


async def test_a_direct_read_that_times_out_leaves_no_page_whose_timeout_nobody_retrieves(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of three filters whose pages all go unanswered (a server too busy to answer in
    time): the read fails with BusTimeout, and the other two pages' timeouts are not left in
    futures nobody awaits. Before, asyncio logged "Future exception was never retrieved" for
    each (517 lines in one benchmark case of 300 calls opened at once on a full stream)."""
    monkeypatch.setattr(direct, "PAGE_TIMEOUT_S", 0.2)
    nc = await nats.connect(nats_url)
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, ctx: unhandled.append(ctx))
    try:
        await nc.subscribe(subjects.js_api_direct_get("SILENT"), cb=_ignore)  # takes every page, answers none
        await nc.flush()
        reads = direct.DirectReads(nc, "SILENT")
        with pytest.raises(BusTimeout):
            async for _ in reads.read(["a.1", "a.2", "a.3"], after=0, upto=10, batch=4):
                pass
        await asyncio.sleep(0.3)  # past every page's expiry
        del reads
        gc.collect()
        await asyncio.sleep(0)
        assert unhandled == []
    finally:
        loop.set_exception_handler(None)
        await nc.close()
