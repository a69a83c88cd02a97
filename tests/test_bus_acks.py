"""Stored publishes, KV writes and requests through shared/bus/acks.py against a real server:
they leave nats-py's JetStream publish and request aside (at more than twice the CPU), and
give what those give: the stream sequence or the reply, or the same BusErrors for the same
failures."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from shared.bus import subjects
from shared.bus.connection import BusMsg
from shared.runtime.errors import BusTimeout, BusUnavailable, KeyTaken
from tests.support.bus import bus_client


async def test_stores_and_kv_writes_are_acked_without_nats_py_publish(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with bus_client(nats_url, "test-acks") as conn:
        rids = await conn.bucket(subjects.KV_REQUEST_IDS)

        async def not_this_way(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a stored publish went through nats-py's JetStream publish")

        monkeypatch.setattr(JetStreamContext, "publish", not_this_way)
        cid = subjects.new_cid()
        first = await conn.store(subjects.out(cid), b"one")
        second = await conn.store(subjects.out(cid), b"two")
        assert 0 < first < second
        assert [(body, seq) async for _, body, seq in conn.read_stored([subjects.out(cid)])] == [
            (b"one", first),
            (b"two", second),
        ]
        key = f"acks-{cid}"
        revision = await rids.create(key, b"cid-1")
        with pytest.raises(KeyTaken):
            await rids.create(key, b"cid-2")  # the server's "wrong last sequence", as before
        with pytest.raises(KeyTaken):
            await rids.delete(key, last=revision + 1000)
        assert await rids.put(key, b"cid-3") > revision
        await rids.delete(key)
        assert await rids.get(key) is None
        assert await rids.create(key, b"cid-4") > revision  # over the removal's marker
        with pytest.raises(BusUnavailable, match="no response from stream"):
            await conn.store("nowhere.stored", b"x")  # no stream captures it


async def test_requests_are_answered_without_nats_py_request(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The conductor's assignments and liveness asks: the reply, or nats-py's failures as the
    same BusErrors (nobody subscribed, no reply in time)."""
    async with bus_client(nats_url, "test-acks-requests") as conn:

        async def answer(m: BusMsg) -> None:
            await conn.answer(m, b"re: " + m.data)

        async def silent(m: BusMsg) -> None:
            pass

        await conn.subscribe("test.acks.ask", answer)
        await conn.subscribe("test.acks.silent", silent)
        await conn.round_trip(2)

        async def not_this_way(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a request went through nats-py's request")

        monkeypatch.setattr(Client, "request", not_this_way)
        assert await asyncio.gather(*(conn.request("test.acks.ask", f"{i}".encode(), 2.0) for i in range(20))) == [
            f"re: {i}".encode() for i in range(20)
        ]
        with pytest.raises(BusUnavailable):
            await conn.request("test.acks.nobody", b"", 2.0)
        with pytest.raises(BusTimeout):
            await conn.request("test.acks.silent", b"", 0.2)
