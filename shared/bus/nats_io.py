"""NATS helpers: connect, and create (idempotently) the stream and buckets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from shared.bus import subjects
from shared.runtime.config import ServingConfig

log = logging.getLogger(__name__)

# History and TTL per bucket: heartbeats expire so a dead process disappears by itself.
BUCKETS: dict[str, dict[str, Any]] = {
    subjects.KV_WORKERS: {"history": 1},
    subjects.KV_FRONTENDS: {"history": 1},
    subjects.KV_CALLS: {"history": 1},
    subjects.KV_REQUEST_IDS: {"history": 1},
}


async def connect(config: ServingConfig, name: str, reconnected: Callable[[], Awaitable[None]] | None = None) -> Client:
    """`reconnected` runs after each reconnect: core subscriptions missed what was published
    meanwhile, and the caller reads it from the stream."""
    if not config.nats_url:
        raise RuntimeError("no NATS URL: set NATS_URL or nats_url in the config")
    opts: dict[str, Any] = {
        "servers": config.nats_url.split(","),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "pending_size": 64 * 1024 * 1024,
    }
    if reconnected is not None:
        opts["reconnected_cb"] = reconnected
    if config.nats_creds:
        opts["user_credentials"] = config.nats_creds
    if config.nats_tls:
        ctx = ssl.create_default_context(cafile=config.nats_tls.ca_file)
        if config.nats_tls.cert_file:
            ctx.load_cert_chain(config.nats_tls.cert_file, config.nats_tls.key_file)
        opts["tls"] = ctx
    return await nats.connect(**opts)


def stream_config(config: ServingConfig) -> StreamConfig:
    return StreamConfig(
        name=subjects.STREAM,
        subjects=subjects.STREAM_SUBJECTS,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=config.retention.max_age_s,
        max_bytes=config.retention.max_bytes,
        num_replicas=config.retention.replicas,
        discard=DiscardPolicy.OLD,
        duplicate_window=120.0,
        allow_direct=True,
    )


async def ensure_stream(js: JetStreamContext, config: ServingConfig) -> None:
    cfg = stream_config(config)
    try:
        await js.add_stream(cfg)
    except BadRequestError:
        # Exists with other settings (another service won the race, or the config changed).
        await js.update_stream(cfg)


async def ensure_buckets(js: JetStreamContext, config: ServingConfig, names: list[str]) -> dict[str, KeyValue]:
    out: dict[str, KeyValue] = {}
    for name in names:
        try:
            out[name] = await js.key_value(name)
        except NotFoundError:
            ttl = config.liveness_s if name in (subjects.KV_WORKERS, subjects.KV_FRONTENDS) else None
            kv_cfg = KeyValueConfig(bucket=name, ttl=ttl, replicas=config.retention.replicas, **BUCKETS[name])
            try:
                out[name] = await js.create_key_value(kv_cfg)
            except BadRequestError:
                out[name] = await js.key_value(name)
    return out


async def close(nc: Client, timeout: float = 2.0) -> None:
    """Flush what is written, then close. (nats-py's drain waits up to 30 s on the KV
    watchers' consumers; nothing here needs drain: unacked work is redelivered.)"""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(nc.flush(), timeout)
    with contextlib.suppress(Exception):
        await nc.close()


PAYLOAD_HEADER = "Duplex-Payload"


class Payloads:
    """Bodies over the server's max_payload go through the JetStream Object Store.

    The message on the call's subject then carries no body and names the object in a
    header; `body()` gives the bytes back either way. The bucket has the stream's
    retention, so a replayed call still finds its large payloads.
    """

    def __init__(self, nc: Client, js: JetStreamContext, config: ServingConfig) -> None:
        self.nc, self.js, self.config = nc, js, config
        self._store: Any = None

    @property
    def limit(self) -> int:
        return int(self.nc.max_payload) - 8192  # room for the subject and headers

    async def _bucket(self) -> Any:
        if self._store is None:
            from nats.js.api import ObjectStoreConfig

            try:
                self._store = await self.js.object_store(subjects.OBJ_PAYLOADS)
            except NotFoundError:
                cfg = ObjectStoreConfig(
                    bucket=subjects.OBJ_PAYLOADS,
                    ttl=self.config.retention.max_age_s,
                    max_bytes=self.config.retention.max_bytes,
                    storage=StorageType.FILE,
                    replicas=self.config.retention.replicas,
                )
                try:
                    self._store = await self.js.create_object_store(subjects.OBJ_PAYLOADS, config=cfg)
                except BadRequestError:
                    self._store = await self.js.object_store(subjects.OBJ_PAYLOADS)
        return self._store

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None, ack: bool = False) -> None:
        """Core publish (or, with ack, a JetStream publish awaiting the stream's ack)."""
        if len(body) > self.limit:
            name = f"{subject}.{self.nc._nuid.next().decode()}"
            await (await self._bucket()).put(name, body)
            headers = {**(headers or {}), PAYLOAD_HEADER: name}
            body = b""
        if ack:
            await self.js.publish(subject, body, headers=headers)
        else:
            await self.nc.publish(subject, body, headers=headers)

    async def publish_once(self, subject: str, body: bytes) -> None:
        """A message a call has once (open, end of input, edge end, done, fin), stored with an ack.
        Its subject is unique in the call, so it is also its `Nats-Msg-Id`: a republish after a
        reconnect is deduplicated by the stream."""
        await self.publish(subject, body, headers={"Nats-Msg-Id": subject}, ack=True)

    @staticmethod
    def is_stored(msg: Any) -> bool:
        """The body is in the Object Store (it was over max_payload); `body()` fetches it."""
        return bool(msg.headers and msg.headers.get(PAYLOAD_HEADER))

    async def body(self, msg: Any) -> bytes:
        """The message's body, fetched from the Object Store when it was too large to carry."""
        name = msg.headers.get(PAYLOAD_HEADER) if msg.headers else None
        if not name:
            return bytes(msg.data)
        result = await (await self._bucket()).get(name)
        return bytes(result.data or b"")


@dataclass
class _ToStore:
    subject: str
    body: bytes
    then: Callable[[], Awaitable[None]] | None


class StoreBehind:
    """Messages a call has once (edge end, done, abort) stored with an ack, in order, from
    one task of their own (`run`), so the caller does not wait a round trip per message: a
    worker's step that ends many calls goes on to its next step at once.

    Whatever is queued when the task wakes is written at once and the acks awaited
    together. A message the stream did not take (the server restarting, a timeout) is sent
    again, after a pause that doubles up to `max_pause_s`, until it is stored: the stream
    drops repeats by `Nats-Msg-Id` (`Payloads.publish_once`). Only such a retry can put a
    message after one queued later. `then` runs once its message is stored. The queue
    holds at most a few messages per call its owner holds, so it needs no other bound.
    """

    def __init__(self, publish: Callable[[str, bytes], Awaitable[None]], max_pause_s: float = 2.0) -> None:
        self._publish = publish
        self._queue: deque[_ToStore] = deque()
        self._ready = asyncio.Event()
        self._in_flight = 0
        self.max_pause_s = max_pause_s
        self.retries = 0

    def put(self, subject: str, body: bytes, then: Callable[[], Awaitable[None]] | None = None) -> None:
        self._queue.append(_ToStore(subject, body, then))
        self._ready.set()

    def __len__(self) -> int:
        """Messages not yet stored (or stored, their `then` still running)."""
        return len(self._queue) + self._in_flight

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                batch = list(self._queue)
                self._queue.clear()
                self._in_flight = len(batch)
                try:
                    await self._store(batch)
                    for m in batch:
                        if m.then is not None:
                            try:
                                await m.then()
                            except Exception:
                                log.exception("after storing %s", m.subject)
                finally:
                    self._in_flight = 0

    async def _store(self, batch: list[_ToStore]) -> None:
        pause = 0.05
        while True:
            results = await asyncio.gather(*(self._publish(m.subject, m.body) for m in batch), return_exceptions=True)
            failed = [m for m, r in zip(batch, results, strict=True) if isinstance(r, Exception)]
            if not failed:
                return
            errors = sorted({type(r).__name__ for r in results if isinstance(r, Exception)})
            log.warning("%d message(s) not stored (%s), sending again in %.2fs", len(failed), ", ".join(errors), pause)
            self.retries += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.max_pause_s)
            batch = failed


async def read_stored(
    js: JetStreamContext, payloads: Payloads, filters: list[str], after: int = 0, batch: int = 512
) -> AsyncGenerator[tuple[str, bytes, int], None]:
    """Every message the stream holds on `filters`, oldest first: (subject, body, stream seq).
    With `after`, only those stored after that stream sequence: a reader that has read to
    some point reads again from there, not the whole call. At most `batch` messages are
    fetched at once (what a reader that stops early has fetched in vain).

    One ephemeral consumer, read to the end and deleted: the catch-up read of workers,
    the frontend's recovery of lost outputs and `duplexbus replay` all use it.
    """
    cfg = ConsumerConfig(
        filter_subjects=filters,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after else DeliverPolicy.ALL,
        opt_start_seq=after + 1 if after else None,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    info = await js.add_consumer(subjects.STREAM, cfg)
    pending = info.num_pending or 0
    try:
        if pending == 0:
            return
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=subjects.STREAM)
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, batch), timeout=2.0)
                except (NatsTimeoutError, TimeoutError):
                    return
                for m in msgs:
                    pending = m.metadata.num_pending
                    yield m.subject, await payloads.body(m), m.metadata.sequence.stream
        finally:
            await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(subjects.STREAM, info.name)


class _Direct:
    """Stands in for a subscription's message queue: each message goes to the handler at
    once, from the client's read loop. The methods are those nats-py calls on the queue."""

    def __init__(self, handler: Callable[[Msg], None], sub: Subscription) -> None:
        self.handler = handler
        self.sub = sub

    def put_nowait(self, msg: Msg) -> None:
        self.sub._pending_size -= len(msg.data)  # nothing waits: keep the slow-consumer check quiet
        try:
            self.handler(msg)
        except Exception:  # as a callback's would be: logged, and the subscription goes on
            log.exception("handling a message on %s failed", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


async def subscribe_direct(nc: Client, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    """A core subscription whose messages reach a plain function from the read loop.

    nats-py gives each subscription a queue and a task, so every message costs a queue put,
    a task switch and a coroutine; a worker or frontend with hundreds of live calls spends a
    large part of its time on that. The handler must not block; it starts a task for any
    work that awaits. Where the client's internals are not the ones this relies on, it falls
    back to an ordinary callback subscription.
    """

    async def cb(msg: Msg) -> None:
        handler(msg)

    sub = await nc.subscribe(subject, cb=cb)
    task = getattr(sub, "_wait_for_msgs_task", None)
    queue = getattr(sub, "_pending_queue", None)
    if isinstance(queue, asyncio.Queue) and isinstance(task, asyncio.Task):
        task.cancel()
        sub._pending_queue = _Direct(handler, sub)  # type: ignore[assignment]
        while not queue.empty():  # anything that came in while subscribing
            sub._pending_queue.put_nowait(queue.get_nowait())
    return sub


async def release_request_id(kv: KeyValue, request_id: str, cid: str, revision: int = 0) -> None:
    """Free a live call's request_id, only if it is still this call's (a new call may hold it).
    With the revision that reserved it, that is one round trip: the delete is refused where
    the key has changed since."""
    with contextlib.suppress(Exception):
        if not revision:
            entry = await kv.get(request_id)
            if entry.value != cid.encode():
                return
            revision = entry.revision or 0
        await kv.delete(request_id, last=revision)


async def unsubscribe_all(subs: list[Subscription]) -> None:
    """Best effort: a subscription of a connection that is closing may already be gone."""
    for sub in subs:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
