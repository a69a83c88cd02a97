"""Publishes the stream confirms (shared/bus/confirmed.py): what it did not store is sent
again until it has. Without them, a message published while the stream has no leader (a
cluster electing one after a node died) is stored nowhere, and a subscriber that was
reconnecting meanwhile never gets it."""

from __future__ import annotations

import asyncio

import nats

from shared.bus import subjects
from shared.bus.confirmed import Unconfirmed
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from tests.support.bus import own_nats_server


def test_unconfirmed_publishes_are_due_again_oldest_first_after_the_wait() -> None:
    u = Unconfirmed(wait_s=2.0, max_bytes=10)
    a = u.add("call.c.in.x", b"aaaa", None, now=0.0)
    b = u.add("call.c.in.x", b"bbbb", None, now=1.0)
    assert (len(u), u.bytes, u.full) == (2, 8, False)
    assert u.due(now=1.9) == []
    assert [t for t, _ in u.due(now=2.0)] == [a]  # b was sent later: not due yet
    assert [t for t, _ in u.due(now=3.0)] == [b]
    assert [t for t, _ in u.due(now=4.0)] == [a]  # a was sent again at 2.0
    assert u.confirmed(a) and not u.confirmed(a)  # a repeat's ack finds nothing left
    assert (len(u), u.bytes, u.resent) == (1, 4, 3)
    u.add("call.c.in.x", b"cccccc", None, now=4.0)
    assert u.full


async def test_what_the_stream_did_not_store_is_sent_again_until_it_is() -> None:
    """The stream is gone while three items are published (no one answers: 503); once it is
    back, they are sent again and stored, in order, each once."""
    with own_nats_server("duplexbus-confirmed-") as server:
        config = parse_config({"nats_url": server.url, "retention": {"confirm_publishes": True}})
        bus = await BusConnection.open(config, "confirmed")
        nc = await nats.connect(server.url)
        try:
            assert bus.confirmer is not None
            await nc.jetstream().delete_stream(subjects.STREAM)
            for i in range(3):
                await bus.publish(subjects.input_("c1", "audio_in"), f"item {i}".encode())
            await asyncio.sleep(0.5)
            assert len(bus.confirmer.unconfirmed) == 3
            await bus.ensure_stream()
            for _ in range(100):
                if not len(bus.confirmer.unconfirmed):
                    break
                await asyncio.sleep(0.1)
            stored = [body async for _, body, _ in bus.read_stored([subjects.call_all("c1")])]
            assert stored == [b"item 0", b"item 1", b"item 2"]
            assert bus.confirmer.unconfirmed.resent == 3
        finally:
            await nc.close()
            await bus.close()


def test_replicas_turn_confirmed_publishes_on() -> None:
    assert not parse_config({}).confirms_publishes
    assert parse_config({"retention": {"replicas": 3}}).confirms_publishes
    assert not parse_config({"retention": {"replicas": 3, "confirm_publishes": False}}).confirms_publishes
