"""Ended calls leave nothing in the KV buckets: a removal's marker expires (kv.MARKER_TTL_S).

Before, every call left a delete marker in `duplex_calls` and one in `duplex_request_ids`
forever, and the conductor's restore (a listing of keys) read them all again: 1.4 s per
100k ended calls."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.js.api import StreamConfig

from shared.bus import kv as kv_module
from shared.bus import subjects
from tests.helpers import EchoCall, bus_client, running_stack

CALLS = 20


async def _messages(nats_url: str, bucket: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return int((await nc.jetstream().stream_info(f"KV_{bucket}")).state.messages)
    finally:
        await nc.close()


async def test_ended_calls_leave_no_marker_in_the_buckets(nats_url: str) -> None:
    async with running_stack(nats_url, {"model": "echo"}) as stack:
        for i in range(CALLS):
            call = await EchoCall.open(stack.ws_url(), f"marker-{i}", frames=2, seed=i)
            await call.finish(logs=stack.logs())
        buckets = (subjects.KV_CALLS, subjects.KV_REQUEST_IDS)
        deadline = time.monotonic() + kv_module.MARKER_TTL_S + 10
        while True:
            held = {b: await _messages(nats_url, b) for b in buckets}
            if not any(held.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert held == dict.fromkeys(buckets, 0), held  # was {duplex_calls: 20, duplex_request_ids: 20}


async def test_a_bucket_made_without_message_ttls_is_given_them(nats_url: str) -> None:
    """A bucket an older version made refuses the marker's TTL: opening it turns TTLs on, and
    a removal there leaves nothing either."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.delete_key_value("duplex_old")
    except nats.js.errors.NotFoundError:
        pass
    old = StreamConfig(
        name="KV_duplex_old", subjects=["$KV.duplex_old.>"], max_msgs_per_subject=1, allow_rollup_hdrs=True, deny_delete=True
    )
    await js.add_stream(old)
    try:
        async with bus_client(nats_url, "old-bucket") as bus:
            bucket = await bus.bucket("duplex_old")
            revision = await bucket.create("k", b"v")
            await bucket.delete("k", last=revision)
            assert await bucket.get("k") is None
            await asyncio.sleep(kv_module.MARKER_TTL_S + 1.5)
            assert (await js.stream_info("KV_duplex_old")).state.messages == 0
    finally:
        await js.delete_stream("KV_duplex_old")
        await nc.close()
