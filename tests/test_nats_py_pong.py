"""A paused nats-server against nats-py and against the project's connection (shared/bus), on
a nats-server of the test's own that each test freezes (SIGSTOP) or not.

- nats-py 2.16.0 alone goes deaf once a PONG comes after its `flush(timeout)` gave up (the
  reproduction of bench/nats_py_pong.py, on the same server as a BusConnection that does not);
- a read loop that ends another way is found and a reconnect forced;
- a server frozen for good is left within seconds (the pings), and the connection hears again
  as soon as it thaws;
- a connection deaf past its bound is lost: its round trips are refused for good and the
  process's /livez fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from shared.bus.connection import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, BusConnection, BusMsg
from shared.bus.embedded import NatsServer
from shared.bus.internals import missing_client_internals
from shared.bus.link import Link, LinkWatch
from shared.bus.readiness import Readiness
from shared.runtime.config import parse_config
from shared.runtime.errors import BusLost, BusTimeout, BusUnavailable
from shared.runtime.health import HealthServer
from tests.support import freeze
from tests.support.bus import own_nats_server
from tests.support.poll import until


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with own_nats_server("duplexbus-pong-") as s:
        yield s


def frozen(server: NatsServer) -> contextlib.AbstractContextManager[None]:
    assert server.proc is not None
    return freeze.frozen(server.proc.pid)


@contextlib.asynccontextmanager
async def bus_on(server: NatsServer) -> AsyncIterator[BusConnection]:
    bus = await BusConnection.open(parse_config({"nats_url": server.url}), "pong-test", stream=False)
    try:
        yield bus
    finally:
        await bus.close()


class Ear:
    """A subscription on `subject` that remembers what it heard."""

    def __init__(self) -> None:
        self.heard: list[bytes] = []

    async def on_bus(self, msg: BusMsg) -> None:
        self.heard.append(msg.data)

    async def on_nats(self, msg: Msg) -> None:
        self.heard.append(msg.data)


async def hears(ear: Ear, server: NatsServer, body: bytes, timeout: float) -> bool:
    """Whether `ear` hears `body`, published on `probe` by another connection, within `timeout`."""
    async with contextlib.AsyncExitStack() as stack:
        nc = await nats.connect(server.url)
        stack.push_async_callback(nc.close)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # published again until heard: a reconnecting ear misses some
            await nc.publish("probe", body)
            await nc.flush()
            for _ in range(5):
                if body in ear.heard:
                    return True
                await asyncio.sleep(0.02)
    return False


async def test_a_pong_after_a_flush_timed_out_deafens_nats_py_and_not_the_bus_connection(server: NatsServer) -> None:
    raw = Client()
    await raw.connect(server.url)
    assert missing_client_internals(raw) == []  # what the guard relies on is where it was
    raw_ear, bus_ear = Ear(), Ear()
    await raw.subscribe("probe", cb=raw_ear.on_nats)
    async with bus_on(server) as bus:
        await bus.subscribe("probe", bus_ear.on_bus)
        await bus.round_trip(1.0)
        with frozen(server):  # a GC pause, a disk stall: both flushes time out
            results = await asyncio.gather(raw.flush(timeout=1), bus.round_trip(1.0), return_exceptions=True)
            assert isinstance(results[0], NatsTimeout) and isinstance(results[1], BusTimeout), results
            await asyncio.sleep(0.8)
        # The late PONGs come: nats-py's read loop dies on its own, the bus connection's does not.
        assert await hears(bus_ear, server, b"after", 5.0)
        assert bus.link.state is Link.UP and bus.is_connected
        assert bus._nc.stats["reconnects"] == 0  # it went on reading: nothing had to be mended
        await bus.round_trip(1.0)
        assert not await hears(raw_ear, server, b"after", 1.0)
        assert raw.is_connected  # what nats-py says: connected, and deaf (if this fails, nats-py mended it)
    await raw.close()


async def test_a_read_loop_that_ends_is_found_and_a_reconnect_forced(
    server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    ear = Ear()
    async with bus_on(server) as bus:
        await bus.subscribe("probe", ear.on_bus)
        task = bus._nc._reading_task  # (ended by hand: the one way there is without a nats-py bug)
        assert task is not None
        task.cancel()
        await asyncio.wait([task])
        assert not bus.is_connected  # nats-py still says connected: the connection does not
        with pytest.raises(BusUnavailable, match="not reading"):
            await bus.round_trip(1.0)  # nats-py's flush would return at once: a false all-clear
        start = time.monotonic()
        assert await hears(ear, server, b"again", 5.0)
        took = time.monotonic() - start
        print(f"a dead read loop found and the connection hearing again in {took:.2f} s")
        await until(lambda: bus.link.state is Link.UP, 2.0, "the link up again")
        assert not bus.lost
    said = [r.getMessage() for r in caplog.records]
    assert any("deaf): reconnecting" in m for m in said) and any("reads again" in m for m in said), said


async def test_a_server_frozen_for_good_is_left_within_seconds_and_heard_again_after_the_thaw(server: NatsServer) -> None:
    ear = Ear()
    async with bus_on(server) as bus:
        await bus.subscribe("probe", ear.on_bus)
        bound = PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) + 2.0  # (a margin for a loaded machine)
        with frozen(server):
            start = time.monotonic()
            await until(lambda: not bus.is_connected, bound, "the frozen server found stale")
            left = time.monotonic() - start
        thawed = time.monotonic()
        assert await hears(ear, server, b"thawed", 5.0)
        back = time.monotonic() - thawed
        print(f"a frozen server left after {left:.1f} s; hearing again {back:.1f} s after the thaw")
        await until(lambda: bus.link.state is Link.UP, 2.0, "the link up again")


async def test_a_connection_deaf_past_its_bound_is_lost_its_round_trips_refused_and_its_livez_fails(
    server: NatsServer,
) -> None:
    async with bus_on(server) as bus:
        readiness = Readiness(1.0)
        readiness.conn = bus
        health = HealthServer(None, readiness, live=readiness.live)
        assert health.answer("/livez")[0] == 200
        bus.link = LinkWatch(deaf_bound_s=0.0)  # deaf past its bound at the first look
        task = bus._nc._reading_task
        assert task is not None
        task.cancel()
        await until(lambda: bus.lost, 2.0, "the link lost")
        with pytest.raises(BusLost):
            await bus.round_trip(1.0)  # not recoverable: the conductor's health beat ends it
        status, _, body = health.answer("/livez")
        assert status == 503 and json.loads(body) == {"live": False, "checks": {"bus": False}}
