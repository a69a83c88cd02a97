"""The conductor's shell: bus messages and ticks in, the core's actions out.

It consumes only open/eoi/done/abort subjects through one durable JetStream
consumer (so a restarted conductor misses nothing) and keeps call records in KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

from services.conductor import core
from services.conductor.liveness import Liveness
from shared.bus import nats_io as bus
from shared.bus import subjects, wire
from shared.runtime import health
from shared.runtime.config import ServingConfig
from shared.runtime.errors import DuplexError
from shared.runtime.process import TaskSet

log = logging.getLogger(__name__)

MAX_UNSETTLED = 1024  # events whose writes are under way: past this the ordered path waits


def consumer_config() -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=subjects.CONDUCTOR_DURABLE,
        filter_subjects=subjects.CONDUCTOR_FILTERS,
        ack_policy=AckPolicy.EXPLICIT,
        # A new durable starts at now: opens of calls from before it existed are history,
        # not work. Frontends wait for this consumer before they accept calls.
        deliver_policy=DeliverPolicy.NEW,
        ack_wait=30,
        max_ack_pending=10_000,
    )


class ConductorService:
    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.core = core.Conductor(config)
        self.tasks = TaskSet()  # assignments waiting for a worker's reply
        self.events: asyncio.Queue[tuple[core.Event, Msg | None]] = asyncio.Queue(maxsize=10_000)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.kv: dict[str, KeyValue] = {}
        self._unsettled = asyncio.Semaphore(MAX_UNSETTLED)
        self._live = {b: Liveness(config.liveness_s) for b in (subjects.KV_WORKERS, subjects.KV_FRONTENDS)}

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await bus.connect(self.config, "duplexbus-conductor")
        self.js = self.nc.jetstream()
        self.payloads = bus.Payloads(self.nc, self.js, self.config)
        await bus.ensure_stream(self.js, self.config)
        self.kv = await bus.ensure_buckets(self.js, self.config, list(bus.BUCKETS))
        await self._restore()
        try:
            await self.js.add_consumer(subjects.STREAM, consumer_config())
        except Exception:
            log.debug("consumer exists", exc_info=True)
        sub = await self.js.pull_subscribe_bind(durable=subjects.CONDUCTOR_DURABLE, stream=subjects.STREAM)
        log.info("conductor ready")
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._consume(sub)),
                    tg.create_task(self._watch(subjects.KV_WORKERS)),
                    tg.create_task(self._watch(subjects.KV_FRONTENDS)),
                    tg.create_task(self._ticks()),
                    tg.create_task(self._process()),
                    tg.create_task(self._beat()),
                ]
                await stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            await self.tasks.close()
            await bus.close(self.nc)

    async def _restore(self) -> None:
        kv = self.kv[subjects.KV_CALLS]
        records: list[wire.CallRecord] = []
        try:
            keys = await kv.keys()
        except NoKeysError:
            keys = []
        except Exception:
            log.exception("listing the call records failed: no call restored")
            keys = []
        for key in keys:
            try:  # one unreadable record must not cost the others
                entry = await kv.get(key)
                if entry.value:
                    records.append(wire.decode_as(entry.value, wire.CallRecord))
            except Exception:
                log.exception("call record %s could not be restored", key)
        self.core.restore(records)
        if records:
            log.info("restored %d calls", len(records))

    async def _consume(self, sub: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                continue
            for m in msgs:
                try:
                    ev = _event_of(m.subject, await self.payloads.body(m))
                except Exception:
                    log.exception("cannot read the body of %s", m.subject)
                    ev = None
                if ev is None:
                    await m.ack()
                    continue
                await self.events.put((ev, m))

    async def _process(self) -> None:
        """The one task that calls the core: events are handled strictly in order.

        Their writes are started in that order but not awaited here: the next event does not
        wait on this one's round trips (a record, a fin, a request_id). NATS keeps one
        connection's messages in order, so a call's records are stored in the order written.
        The event's own message is acknowledged only once its writes are stored, so a
        conductor that dies in between gets it again. At most MAX_UNSETTLED events wait so.
        """
        while True:
            ev, msg = await self.events.get()
            try:
                writes = self._execute(self.core.handle(ev))
            except Exception:
                log.exception("handling %r failed", ev)
                writes = []
            if writes or msg is not None:
                await self._unsettled.acquire()
                self.tasks.spawn(self._settle(ev, writes, msg))

    async def _settle(self, ev: core.Event, writes: list[asyncio.Task[Any]], msg: Msg | None) -> None:
        try:
            for result in await asyncio.gather(*writes, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("a write for %r failed: %r", ev, result)
            if msg is not None:
                with contextlib.suppress(Exception):
                    await msg.ack()
        finally:
            self._unsettled.release()

    def _execute(self, actions: list[core.Action]) -> list[asyncio.Task[Any]]:
        """Start each action's writes, in order (a task's first step writes its message, and
        tasks start in the order created); return those the event's ack waits for."""
        assert self.js is not None and self.nc is not None
        writes: list[asyncio.Task[Any]] = []
        for a in actions:
            if isinstance(a, core.SendAssign):
                self.tasks.spawn(self._assign(a))
            elif isinstance(a, core.PublishFin):
                writes.append(self.tasks.spawn(self.payloads.publish_once(subjects.fin(a.cid), wire.encode(a.msg))))
                # The frontend frees it too, when it is alive to see the fin.
                rids = self.kv[subjects.KV_REQUEST_IDS]
                self.tasks.spawn(bus.release_request_id(rids, a.request_id, a.cid, a.request_id_revision))
            elif isinstance(a, core.PublishAbort):
                writes.append(self.tasks.spawn(self.js.publish(subjects.abort(a.cid), wire.encode(a.msg))))
            elif isinstance(a, core.SaveRecord):
                writes.append(self.tasks.spawn(self.kv[subjects.KV_CALLS].put(a.record.cid, wire.encode(a.record))))
            elif isinstance(a, core.DeleteRecord):
                writes.append(self.tasks.spawn(_quietly(self.kv[subjects.KV_CALLS].delete(a.cid))))
        return writes

    async def _assign(self, a: core.SendAssign) -> None:
        assert self.nc is not None
        ok, error = False, None
        try:
            reply = await self.nc.request(
                subjects.assign(a.worker_id), wire.encode(a.msg), timeout=self.config.placement_timeout_s
            )
            r = wire.decode_as(reply.data, wire.AssignReply)
            ok, error = r.ok, r.error
        except (TimeoutError, NatsTimeout):
            error = "no reply"
        except Exception as e:
            error = str(e)
        await self.events.put((core.AssignResult(a.msg.cid, a.worker_id, tuple(a.msg.partitions), ok, error), None))

    async def _watch(self, bucket: str) -> None:
        """Liveness from heartbeats: a put with a new revision is a sign of life, a delete a
        clean exit (liveness.py). Heartbeats come every heartbeat_s, so a watch that stays
        silent longer may have died with a server restart: it is replaced, and the entries it
        replays are not new revisions, so an old heartbeat does not revive a dead process."""
        kv = self.kv[bucket]
        silence = max(3 * self.config.heartbeat_s, self.config.liveness_s / 2)
        while True:
            watcher = await kv.watchall()
            try:
                while True:
                    try:
                        entry = await watcher.updates(timeout=silence)
                    except NatsTimeout:
                        break
                    if entry is not None:
                        await self._heartbeat_entry(bucket, entry)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

    async def _heartbeat_entry(self, bucket: str, entry: Any) -> None:
        live = self._live[bucket]
        if entry.operation in ("DEL", "PURGE"):
            if live.left(entry.key):
                log.warning("%s %s left (%s)", bucket, entry.key, entry.operation)
                await self.events.put((_lost(bucket, entry.key), None))
            return
        if not entry.value or not live.saw(entry.key, entry.revision or 0, time.monotonic()):
            return  # a replayed heartbeat
        if bucket == subjects.KV_WORKERS:
            with contextlib.suppress(DuplexError):
                await self.events.put((core.WorkerSeen(wire.decode_as(entry.value, wire.WorkerHeartbeat)), None))

    async def _beat(self) -> None:
        """The container healthcheck's sign of life: NATS answered a round trip just now."""
        assert self.nc is not None
        while True:
            with contextlib.suppress(Exception):  # no answer: no beat, and the check fails
                await self.nc.flush(timeout=math.ceil(self.config.heartbeat_s))
                health.beat()
            await asyncio.sleep(self.config.heartbeat_s)

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for bucket, live in self._live.items():
                for key in live.expired(time.monotonic()):
                    log.warning("%s %s stopped heartbeating", bucket, key)
                    await self.events.put((_lost(bucket, key), None))
            await self.events.put((core.Tick(time.time()), None))


async def _quietly(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(Exception):
        await aw


def _lost(bucket: str, key: str) -> core.Event:
    return core.WorkerLost(key) if bucket == subjects.KV_WORKERS else core.FrontendLost(key)


def _event_of(subject: str, data: bytes) -> core.Event | None:
    try:
        s = subjects.parse(subject)
        msg = wire.decode(data)
    except (ValueError, DuplexError):
        log.warning("undecodable message on %s", subject)
        return None
    if isinstance(msg, wire.Open):
        return core.Opened(msg, time.time())
    if isinstance(msg, wire.EndOfInput) and s.edge:
        return core.InputEnded(s.cid, s.edge, msg.total)
    if isinstance(msg, wire.Done):
        return core.PartitionDone(s.cid, msg)
    if isinstance(msg, wire.Abort):
        return core.AbortRequested(s.cid, msg.reason, msg.status)
    return None
