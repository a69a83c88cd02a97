"""shared.bus.kv.Bucket against a real server: a request_id is freed only by the call that holds
it, and a release that lost the race to the other releaser is quiet (no warning)."""

from __future__ import annotations

import logging

import pytest

from shared.bus import subjects
from tests.support.bus import bus_client


async def test_release_frees_only_the_holders_key_and_is_quiet_when_it_moved_on(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with bus_client(nats_url, "test-kv") as conn:
        rids = await conn.bucket(subjects.KV_REQUEST_IDS)
        key = f"kv-{subjects.new_cid()}"
        first = await rids.create(key, b"cid-1")
        await rids.release(key, b"cid-1", first)
        assert await rids.get(key) is None
        second = await rids.create(key, b"cid-2")  # free again: a new call takes it
        with caplog.at_level(logging.WARNING, logger="shared.bus.kv"):
            await rids.release(key, b"cid-1", first)  # the old call's late release: refused, quietly
            await rids.release(key, b"cid-1")  # without a revision: not its value, nothing done
        entry = await rids.get(key)
        assert entry is not None and entry.value == b"cid-2" and entry.revision == second
        assert caplog.records == []
        await rids.release(key, b"cid-2", second)
        assert await rids.get(key) is None
