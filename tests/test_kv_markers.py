"""Ended calls leave nothing in the KV buckets: a removal's marker expires (kv.MARKER_TTL_S).

Before, every call left a delete marker in `duplex_calls` and one in `duplex_request_ids`
forever, and the conductor's restore (a listing of keys) read them all again: 1.4 s per
100k ended calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import pytest
from nats.js.api import StreamConfig
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.bus import kv as kv_module
from shared.bus import subjects
from shared.runtime.errors import KeyTaken
from tests.support.bus import bus_client
from tests.support.calls import EchoCall
from tests.support.poll import until
from tests.support.stack import running_stack

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

            async def empty() -> bool:
                return (await js.stream_info("KV_duplex_old")).state.messages == 0

            # The delete's marker goes once its TTL is past: a bucket without TTLs keeps it for ever.
            await until(empty, kv_module.MARKER_TTL_S + 5, "the delete marker removed after its TTL")
    finally:
        await js.delete_stream("KV_duplex_old")
        await nc.close()


@pytest.mark.parametrize(
    ("expires_after_write", "expires_before_write"),
    [(1, 0), (0, 2)],
    ids=["between-the-write-and-the-read", "between-the-read-and-the-write"],
)
async def test_a_create_over_a_marker_that_expires_meanwhile_succeeds(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, expires_after_write: int, expires_before_write: int
) -> None:
    """A create over a removed key finds its marker, reads the marker's revision, and writes
    on it. The marker expiring (MARKER_TTL_S) between those steps made nats-py's create fail
    with "key not found" or "the key exists": seen reusing request_ids under load. The
    expiry is played here by purging the key at that moment."""
    real_update = KeyValue._update
    writes = 0

    async def expiring(self: KeyValue, key: str, value: bytes, last: int | None = None, **kw: Any) -> int:
        nonlocal writes
        writes += 1
        if writes == expires_before_write:
            await self._js.purge_stream(self._stream, subject=f"{self._pre}{key}")
        try:
            return int(await real_update(self, key, value, last=last, **kw))
        except KeyWrongLastSequenceError:
            if writes == expires_after_write:
                await self._js.purge_stream(self._stream, subject=f"{self._pre}{key}")
            raise

    async with bus_client(nats_url, "create-race") as bus:
        bucket = await bus.bucket(subjects.KV_REQUEST_IDS)
        key = f"race-{expires_after_write}-{expires_before_write}"
        await bucket.delete(key, last=await bucket.create(key, b"first call"))
        monkeypatch.setattr(KeyValue, "_update", expiring)
        await bucket.create(key, b"second call")
        entry = await bucket.get(key)
        assert entry is not None and entry.value == b"second call"
        with pytest.raises(KeyTaken):  # a live key is still refused
            await bucket.create(key, b"third call")
        await bucket.delete(key)
