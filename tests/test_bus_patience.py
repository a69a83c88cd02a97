"""A message a call has once (open, end of input, fin) waits out a server that answers late:
its ack is asked for again until the caller's patience runs out, and the stream keeps it once.
Before, the first 5 s publish wait failed the call with 503 ("no answer in time"), as it did
once for one of twenty 3-minute uploads at once on a busy 2-core machine; and a fin that
failed so was never stored: the conductor logged it, and the client waited for an end."""

from __future__ import annotations

import asyncio

import pytest

from services.conductor import core
from services.conductor.service import ConductorService
from shared.bus import subjects, wire
from shared.runtime.config import parse_config
from shared.runtime.errors import BusTimeout
from tests.support.bus import bus_client, own_nats_server
from tests.support.freeze import frozen


async def test_a_late_ack_is_asked_for_again_and_the_message_is_stored_once() -> None:
    with own_nats_server("duplexbus-patience-") as server:
        assert server.proc is not None
        async with bus_client(server.url, "patience") as bus:
            subject = subjects.eoi("c-patient", "audio_in")
            # frozen: returns once the kernel has stopped the server (the kill's return alone
            # does not say it; a publish sent before that could be answered: once in a full run).
            with frozen(server.proc.pid):
                store = asyncio.create_task(bus.store_once(subject, b'{"total":3}', patience_s=30.0))
                await asyncio.sleep(6.5)  # past JetStream's 5 s publish wait
                assert not store.done(), store
            await asyncio.wait_for(store, 30)
            stored = [body async for _, body, _ in bus.read_stored([subject])]
            assert stored == [b'{"total":3}']  # the repeat was dropped by its Nats-Msg-Id


async def test_the_conductor_waits_out_a_late_ack_of_a_fin() -> None:
    with own_nats_server("duplexbus-fin-patience-") as server:
        assert server.proc is not None
        async with bus_client(server.url, "fin-patience") as bus:
            conductor = ConductorService(parse_config({}))
            conductor._bus = bus
            fin = wire.Fin(status=200, reason="completed")
            with frozen(server.proc.pid):
                store = asyncio.create_task(conductor._fin(core.PublishFin("c-fin-late", fin, request_id="")))
                await asyncio.sleep(6.5)  # past JetStream's 5 s publish wait
                assert not store.done(), store
            await asyncio.wait_for(store, 30)
            stored = [wire.decode(body) async for _, body, _ in bus.read_stored([subjects.fin("c-fin-late")])]
            assert stored == [fin]


async def test_without_patience_the_timeout_is_raised() -> None:
    with own_nats_server("duplexbus-impatience-") as server:
        assert server.proc is not None
        async with bus_client(server.url, "impatience") as bus:
            with frozen(server.proc.pid):
                store = asyncio.create_task(bus.store_once(subjects.eoi("c-impatient", "audio_in"), b"{}"))
                with pytest.raises(BusTimeout):
                    await asyncio.wait_for(store, 20)
