"""The bus as the tests and benchmarks see it from outside the services: connections of
their own to reset it, to read the conductor's records and the workers' heartbeats, and
nats-servers of a test's own. The support code's one use of nats-py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer
from shared.runtime.config import parse_config


@contextlib.asynccontextmanager
async def connected(nats_url: str) -> AsyncIterator[Client]:
    """A plain connection of the test's own, closed afterwards."""
    nc = await nats.connect(servers=nats_url.split(","))  # a cluster's URLs, comma-separated
    try:
        yield nc
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def consumer_requests(nats_url: str, about: str = "") -> AsyncIterator[list[str]]:
    """The JetStream consumer API requests (create, delete...) anyone sends meanwhile, as
    their subjects: a core subscription gets a copy of each. With `about`, only those whose
    subject or body holds it (a consumer's create names its filter subjects)."""
    seen: list[str] = []

    async def saw(m: Any) -> None:
        if about in m.subject or about.encode() in m.data:
            seen.append(m.subject)

    async with connected(nats_url) as nc:
        await nc.subscribe("$JS.API.CONSUMER.>", cb=saw)
        await nc.flush()
        yield seen
        await nc.flush()


async def bucket_keys(kv: KeyValue, tries: int = 20) -> list[str]:
    """A bucket's keys. Listing is a watch, which can come back empty on a busy server: an
    empty listing is tried again, up to `tries` times in all (0.1 s apart)."""
    for i in range(tries):
        with contextlib.suppress(NoKeysError):
            return list(await kv.keys())
        if i + 1 < tries:
            await asyncio.sleep(0.1)
    return []


async def reset_bus(nats_url: str) -> None:
    """Delete the stream and the buckets, so the next services start from a clean bus."""
    async with connected(nats_url) as nc:
        js = nc.jetstream()
        with contextlib.suppress(NatsError):  # not there yet
            await js.delete_stream(subjects.STREAM)
        for b in (subjects.KV_WORKERS, subjects.KV_FRONTENDS, subjects.KV_CALLS, subjects.KV_REQUEST_IDS):
            with contextlib.suppress(NatsError):
                await js.delete_key_value(b)


async def wait_workers(nats_url: str, n: int, timeout: float = 30.0) -> None:
    """Until n worker heartbeats are in the bucket."""
    async with connected(nats_url) as nc:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(NatsError):  # the bucket is made by the first worker
                kv = await js.key_value(subjects.KV_WORKERS)
                if len(await kv.keys()) >= n:
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"fewer than {n} workers registered")


async def call_records(nats_url: str, tries: int = 20) -> dict[str, wire.CallRecord]:
    """The conductor's call records (its calls bucket) by call id. `tries` as for `bucket_keys`:
    1 where an empty bucket is what the caller waits for."""
    async with connected(nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_CALLS)
        out = {}
        for key in await bucket_keys(kv, tries):
            try:
                e = await kv.get(key)
            except KeyNotFoundError:  # deleted since it was listed: the call ended meanwhile
                continue
            if e.value:
                r = wire.decode_as(e.value, wire.CallRecord)
                out[r.cid] = r
        return out


async def conductor_status(nats_url: str) -> dict[str, Any]:
    """What the conductor says of itself (`ctl.conductor.status`): its live calls, queued calls
    and workers. Unlike a listing of its records (a watch, which can come back empty on a busy
    server), this is its own count."""
    async with connected(nats_url) as nc:
        reply = await nc.request(subjects.conductor_status(), b"", timeout=2)
    status: dict[str, Any] = json.loads(reply.data)
    return status


async def until_call_records(
    nats_url: str, pred: Callable[[dict[str, wire.CallRecord]], bool], timeout: float = 10.0
) -> dict[str, wire.CallRecord]:
    """The call records (by call id) once `pred` holds of them. A call's record is deleted in
    a write of its own beside its fin, so a client that has its fin can still list the record
    for a moment: a test that wants it gone waits here."""
    deadline = time.monotonic() + timeout
    while True:
        records = await call_records(nats_url, tries=1)
        if pred(records):
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"call records: {[(r.request_id, r.state) for r in records.values()]}")
        await asyncio.sleep(0.05)


async def delivered(nats_url: str) -> int:
    """Messages the conductor's durable consumer has delivered so far."""
    async with connected(nats_url) as nc:
        info = await nc.jetstream().consumer_info(subjects.STREAM, subjects.CONDUCTOR_DURABLE)
        assert info.delivered is not None  # the server reports it for every consumer
        return int(info.delivered.consumer_seq or 0)


async def worker_stats(nats_url: str, reset: bool = False) -> list[dict[str, Any]]:
    """Every live worker's stats (and, with `reset`, a fresh start of them)."""
    async with connected(nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
        out = []
        for wid in await bucket_keys(kv):
            r = await nc.request(subjects.worker_stats(wid), b"reset" if reset else b"", timeout=5)
            out.append(json.loads(r.data))
        return out


@contextlib.asynccontextmanager
async def bus_client(nats_url: str, name: str) -> AsyncIterator[BusConnection]:
    """A bus connection with the stream in place, as the services have it."""
    conn = await BusConnection.open(parse_config({"nats_url": nats_url}), name)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.contextmanager
def own_nats_server(prefix: str) -> Iterator[NatsServer]:
    """A nats-server of the test's own (one it may freeze, kill or restart on its store), in a
    temporary folder that goes with it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as store, NatsServer(store) as server:
        yield server


class StandInBus:
    """A worker's connection, standing in (a `WorkerService` run by hand: the worker's
    benchmark, the tests of its shell): publishes are kept, stores succeed, reads find
    nothing."""

    reads_direct = True

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.published.append((subject, body))

    async def store(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> int:
        return 1

    async def store_once(self, subject: str, body: bytes, *args: Any) -> int:
        return 1

    async def subscribe_direct(self, subject: str, handler: Any) -> object:
        return object()

    def is_stored(self, m: Any) -> bool:
        return False

    async def read_stored(self, *args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, bytes, int]]:
        for _ in ():
            yield "", b"", 0
