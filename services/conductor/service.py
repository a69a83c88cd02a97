"""The conductor's shell: bus messages and ticks in, the core's actions out.

It consumes only open/eoi/done/abort subjects through one durable JetStream
consumer (so a restarted conductor misses nothing) and keeps call records in KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Protocol

from services.conductor import core
from services.conductor.liveness import Liveness
from services.conductor.observe import Observer
from services.conductor.retention import Janitor
from shared.bus import subjects, wire
from shared.bus.connection import BUCKETS, STORE_PATIENCE_S, BusConnection, BusMsg, conductor_consumer
from shared.bus.durable import Durable
from shared.bus.kv import Bucket, KvEntry
from shared.bus.readiness import Readiness
from shared.runtime import healthfile
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError, BusTimeout, BusUnavailable, DuplexError
from shared.runtime.health import HealthServer
from shared.runtime.metrics import ConductorMetrics
from shared.runtime.process import TaskSet, cancel_and_wait
from shared.runtime.retry import Backoff, Outage, retrying
from shared.runtime.version import VERSION

log = logging.getLogger(__name__)

ASSIGN_RETRY_S = 0.25  # an assignment nobody was subscribed to is asked again after this
MAX_UNSETTLED = 1024  # events whose writes are under way: past this the ordered path waits
BATCH = 256  # events handled before their writes are started together (a fetch holds up to 256)
TICK_S = 0.5  # liveness, timeouts and the janitor are looked at this often
WATCH_POLL_S = 0.5  # a watch's wait is cut this short, to notice a reconnect or a silent watch
JANITOR_S = 1.0  # how often the stream's size is looked at and finished calls removed
PURGES_AT_ONCE = 32


class ConductorService:
    def __init__(self, config: ServingConfig, health_port: int | None = None) -> None:
        self.config = config
        self.core = core.Conductor(config)
        self.metrics = ConductorMetrics()
        self.observer = Observer(self.core, self.metrics)
        self.readiness = Readiness(config.heartbeat_s, is_conductor=True)
        self.health_port = health_port  # /livez, /readyz, /metrics on it (None: not served)
        self.tasks = TaskSet()  # assignments waiting for a worker's reply
        self.events: asyncio.Queue[tuple[core.Event, BusMsg | None]] = asyncio.Queue(maxsize=10_000)
        self._bus: BusConnection | None = None
        self._unsettled = asyncio.Semaphore(MAX_UNSETTLED)
        # A tick late by more than two periods means this process did not run meanwhile: that
        # stretch is not counted as anyone's silence (liveness.ListeningClock).
        # A process silent past liveness_s is asked directly, and lost without an answer in ask_s.
        ask_s = config.liveness_s / 2
        self._live = {b: Liveness(config.liveness_s, 2 * TICK_S, ask_s) for b in (subjects.KV_WORKERS, subjects.KV_FRONTENDS)}
        self._watching = dict.fromkeys(self._live, False)  # the bucket's watch has delivered what it held: it hears heartbeats
        self._writable = dict.fromkeys(self._live, False)  # the bucket takes heartbeats (a cluster may be electing its leader)
        self._reconnects = 0  # a watch made before the last reconnect may have died with the server
        r = config.retention
        self.janitor = Janitor(r.max_age_s, r.max_bytes, r.refuse_above_bytes)
        self._stream_full = False  # as last told to the core
        self.removed = 0  # finished calls removed from the stream, and the seconds it took
        self.removing_s = 0.0
        self.cuts = 0  # of the stream's head (retention.py)

    @property
    def bus(self) -> BusConnection:
        if self._bus is None:
            raise RuntimeError("the conductor has not started")
        return self._bus

    @property
    def kv(self) -> dict[str, Bucket]:
        return self.bus.kv

    async def run(self, stop: asyncio.Event) -> None:
        self._bus = await BusConnection.open(
            self.config, "duplexbus-conductor", buckets=list(BUCKETS), reconnected=self._on_reconnect
        )
        await self._restore()
        sub = await self.bus.durable(conductor_consumer)
        self.readiness.conn = self.bus
        health = None
        if self.health_port is not None:  # loopback unless the config opens it (health_host)
            health = HealthServer(
                self.metrics, self.readiness, host=self.config.health_host, port=self.health_port, live=self.readiness.live
            )
        if health is not None:
            await health.start()
        # In NATS service discovery: frontends and workers ping it to know a conductor is alive.
        announced = await self.bus.announce(
            subjects.SERVICE_CONDUCTOR,
            VERSION,
            "admission, placement, completion",
            {},
            {"status": (subjects.conductor_status(), self._status)},
        )
        log.info("conductor ready")
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._consume(sub)),
                    tg.create_task(self._watch(subjects.KV_WORKERS)),
                    tg.create_task(self._watch(subjects.KV_FRONTENDS)),
                    tg.create_task(self._probe(subjects.KV_WORKERS)),
                    tg.create_task(self._probe(subjects.KV_FRONTENDS)),
                    tg.create_task(self._ticks()),
                    tg.create_task(self._process()),
                    tg.create_task(self._janitor()),
                    tg.create_task(self._beat()),
                    tg.create_task(self.readiness.run()),
                ]
                await stop.wait()
                await cancel_and_wait(*tasks)
        finally:
            await announced.stop()
            if health is not None:
                await health.close()
            await self.tasks.close()
            await self.bus.close()

    async def _status(self, body: bytes) -> bytes:
        """ctl.conductor.status (and NATS service discovery's `status` endpoint)."""
        c = self.core
        status = {"live_calls": c.active, "queued": len(c.queue), "workers": sorted(c.workers)}
        return json.dumps(status).encode()

    async def _restore(self) -> None:
        kv = self.kv[subjects.KV_CALLS]
        records: list[wire.CallRecord] = []
        # Without its calls' records the conductor would forget them: wait for the bus.
        keys = await retrying(kv.keys, Outage("listing the call records", log))
        for key in keys:
            try:  # one unreadable record must not cost the others
                entry = await kv.get(key)
                if entry is not None and entry.value:
                    records.append(wire.decode_as(entry.value, wire.CallRecord))
            except (BusError, DuplexError) as e:
                log.error("call record %s could not be restored: %s", key, e)
        self.core.restore(records)
        if records:
            log.info("restored %d calls", len(records))

    async def _consume(self, sub: Durable) -> None:
        outage = Outage("the conductor's consumer", log)  # NATS restarting, say
        while True:
            msgs = await retrying(lambda: sub.fetch(256, timeout=1.0), outage)
            for m in msgs:
                try:
                    ev = _event_of(m.subject, await self.bus.body(m), self.bus.stream_seq(m))
                except BusError as e:  # left unacknowledged: redelivered after ack_wait
                    log.error("cannot read the body of %s: %s", m.subject, e)
                    continue
                if ev is None:
                    await self._ack(m)
                    continue
                await self.events.put((ev, m))

    async def _process(self) -> None:
        """The one task that calls the core: events are handled strictly in order, a batch at
        a time (what is queued when the task comes round, up to BATCH: a fetch's opens in a
        storm, say).

        The batch's writes are started in order but not awaited here: the next batch does not
        wait on this one's round trips (a record, a fin, a request_id). NATS keeps one
        connection's messages in order, so a call's records are stored in the order written;
        within a batch each call's record is written once, its last (core.coalesce). The
        batch's messages are acknowledged only once its writes are stored, so a conductor
        that dies in between gets them again. At most MAX_UNSETTLED events wait so.
        """
        while True:
            batch = [await self.events.get()]
            while len(batch) < BATCH and not self.events.empty():
                batch.append(self.events.get_nowait())
            actions: list[core.Action] = []
            now = time.monotonic()
            for ev, _ in batch:
                try:
                    done = self.core.handle(ev)
                    self.observer.after(ev, done, now)
                except Exception:
                    log.exception("handling %r failed", ev)
                    continue
                actions.extend(done)
            try:
                writes = self._execute(core.coalesce(actions))
            except Exception:
                log.exception("carrying out the actions of %d events failed", len(batch))
                writes = []
            msgs = [m for _, m in batch if m is not None]
            if writes or msgs:
                for _ in batch:
                    await self._unsettled.acquire()
                self.tasks.spawn(self._settle(len(batch), writes, msgs))

    async def _settle(self, events: int, writes: list[asyncio.Task[Any]], msgs: list[BusMsg]) -> None:
        try:
            for result in await asyncio.gather(*writes, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("a write failed: %r", result)
            for msg in msgs:
                await self._ack(msg)
        finally:
            for _ in range(events):
                self._unsettled.release()

    def _execute(self, actions: list[core.Action]) -> list[asyncio.Task[Any]]:
        """Start each action's writes, in order (a task's first step writes its message, and
        tasks start in the order created); return those the event's ack waits for."""
        writes: list[asyncio.Task[Any]] = []
        for a in actions:
            if isinstance(a, core.SendAssign):
                self.tasks.spawn(self._assign(a))
            elif isinstance(a, core.PublishFin):
                self.janitor.ending(a.cid, a.floor)
                writes.append(self.tasks.spawn(self._fin(a), awaited=True))
                if a.request_id:  # the frontend frees it too, when it is alive to see the fin
                    rids = self.kv[subjects.KV_REQUEST_IDS]
                    self.tasks.spawn(rids.release(a.request_id, a.cid.encode(), a.request_id_revision))
            elif isinstance(a, core.PublishAbort):
                writes.append(self.tasks.spawn(self.bus.store(subjects.abort(a.cid), wire.encode(a.msg)), awaited=True))
            elif isinstance(a, core.SaveRecord):
                writes.append(self.tasks.spawn(self.kv[subjects.KV_CALLS].put(a.record.cid, wire.encode(a.record)), awaited=True))
            elif isinstance(a, core.DeleteRecord):
                writes.append(self.tasks.spawn(self.kv[subjects.KV_CALLS].delete_if_there(a.cid), awaited=True))
        return writes

    async def _fin(self, a: core.PublishFin) -> None:
        """A fin whose ack is late is asked for again (`store_once`): the call's client waits
        for it, and the event that ended the call is acknowledged whatever becomes of it."""
        seq = 0
        try:
            seq = await self.bus.store_once(subjects.fin(a.cid), wire.encode(a.msg), STORE_PATIENCE_S)
        finally:  # its messages may go from now on (retention.py); where the fin was not stored, by subject
            self.janitor.ended(a.cid, time.monotonic(), a.floor, seq)

    async def _janitor(self) -> None:
        """Keep the stream within retention by removing finished calls (retention.py); tell
        the core when it is past hard_max_bytes. Live calls are never touched."""
        await self._find_finished()
        report = time.monotonic() + 60
        while True:
            await asyncio.sleep(JANITOR_S)
            try:
                await self._clean()
            except BusError as e:
                log.log(logging.WARNING if e.recoverable else logging.ERROR, "removing finished calls: %s", e)
                await asyncio.sleep(0 if e.recoverable else 30)
            if time.monotonic() > report:
                if self.removed:
                    held = f"; the last round's cut held: {self.janitor.held_by}" if self.janitor.held_by else ""
                    log.info(
                        "removed %d finished calls from the stream in %.1f s (%d cuts of its head%s)",
                        self.removed,
                        self.removing_s,
                        self.cuts,
                        held,
                    )
                self.removed, self.removing_s, self.cuts, report = 0, 0.0, 0, time.monotonic() + 60

    async def _read_to(self, last_seq: int) -> int:
        """The stream sequence up to which the conductor has read and acknowledged its
        consumer (0 where that cannot be asked now: no cut this round)."""
        try:
            return await self.bus.acked_to(subjects.CONDUCTOR_DURABLE, last_seq)
        except BusError:
            return 0

    async def _find_finished(self) -> None:
        """The finished calls a conductor before this one left in the stream (each has a fin)."""
        outage = Outage("finding the finished calls in the stream", log)
        try:
            fins = await retrying(lambda: self.bus.stored_subjects(subjects.fin("*")), outage)
        except BusError as e:
            log.error("finding the finished calls in the stream: %s; they go by age alone", e)
            return
        cids = [c for c in (subjects.parse(f).cid for f in fins) if c not in self.core.calls]
        self.janitor.found(cids, time.monotonic())
        if cids:
            log.info("%d finished calls in the stream", len(cids))

    async def _clean(self) -> None:
        stream = await self.bus.stream_state()
        stream_bytes = stream.bytes
        self.janitor.mark(time.monotonic(), stream.last_seq)
        full = self.janitor.full(stream_bytes)
        if full != self._stream_full:
            self._stream_full = full
            if full:
                log.error("the stream holds %d bytes (retention.hard_max_bytes): new calls are refused", stream_bytes)
            else:
                log.warning("the stream holds %d bytes: new calls are taken again", stream_bytes)
            await self.events.put((core.StreamFull(full), None))
        cids = self.janitor.plan(stream_bytes, len(self.core.calls), time.time(), time.monotonic())
        if not cids:
            return
        start = time.monotonic()
        cut, rest, besides = self.janitor.head(self.core.floor(), await self._read_to(stream.last_seq), time.monotonic())
        if cut > stream.first_seq:
            try:
                await self.bus.purge_below(cut)
                self.cuts += 1
            except BusError as e:  # by subject, as they would have gone without the cut
                log.warning("cutting the stream's head below %d failed (%s); removing calls one by one", cut, e)
                self.janitor.again(besides)  # still in the stream: they wait for a later round
                rest, besides = cids, []
        whole = sorted((set(cids) - set(rest)) | set(besides))  # below the cut: gone with it (now or at an earlier one)
        self.janitor.removed(whole)
        self.removed += len(whole)
        for i in range(0, len(rest), PURGES_AT_ONCE):
            batch = rest[i : i + PURGES_AT_ONCE]
            results = await asyncio.gather(*(self.bus.purge(subjects.call_all(c)) for c in batch), return_exceptions=True)
            errors = {c: r for c, r in zip(batch, results, strict=True) if isinstance(r, Exception)}
            self.janitor.again(list(errors))
            self.janitor.removed([c for c in batch if c not in errors])
            self.removed += len(batch) - len(errors)
            if errors:
                log.warning("removing %d finished calls failed (%s); trying again", len(errors), next(iter(errors.values())))
        self.removing_s += time.monotonic() - start

    async def _assign(self, a: core.SendAssign) -> None:
        ok, error = False, None
        deadline = time.monotonic() + self.config.placement_timeout_s

        async def ask() -> bytes:  # each ask waits what is left of the placement's time
            left = max(0.1, deadline - time.monotonic())
            return await self.bus.request(subjects.assign(a.worker_id), wire.encode(a.msg), left)

        try:
            # No responders (BusUnavailable): the worker is not subscribed right now (NATS
            # restarted and it is reconnecting, say). Asked again until the placement's time is
            # up; a worker that is gone for good is declared lost meanwhile and the call placed
            # elsewhere. A timeout comes only once that time is up.
            outage = Outage(f"assigning call {a.msg.cid} to {a.worker_id}", log)
            backoff = Backoff(ASSIGN_RETRY_S, ASSIGN_RETRY_S)
            reply = await retrying(ask, outage, backoff=backoff, give_up_s=self.config.placement_timeout_s)
            r = wire.decode_as(reply, wire.AssignReply)
            ok, error = r.ok, r.error
        except BusTimeout:
            error = "no reply"
        except DuplexError as e:
            error = e.message
        await self.events.put((core.AssignResult(a.msg.cid, a.worker_id, tuple(a.msg.partitions), ok, error), None))

    async def _ack(self, msg: BusMsg) -> None:
        """Acknowledge a consumer message; one not acknowledged comes again after ack_wait, and
        the core treats a repeated event as the same event."""
        try:
            await self.bus.ack(msg)
        except BusError as e:  # the connection closed, say: only a repeat comes of it
            log.warning("%s", e)

    async def _on_reconnect(self) -> None:
        log.warning("reconnected to NATS: watching the heartbeats again")
        self._reconnects += 1

    async def _watch(self, bucket: str) -> None:
        """Liveness from heartbeats: a put with a new revision is a sign of life, a delete a
        clean exit (liveness.py). Heartbeats come every heartbeat_s, so a watch that stays
        silent longer may have died with a server restart: it is replaced (so is one made
        before a reconnect), and the entries it replays are not new revisions, so an old
        heartbeat does not revive a dead process. Until a new watch has delivered what the
        bucket holds, this conductor is not listening and counts nobody's silence."""
        kv = self.kv[bucket]
        silence = max(3 * self.config.heartbeat_s, self.config.liveness_s / 2)
        outage = Outage(f"watching {bucket}", log)  # NATS restarting or out of reach: the watch is made again
        while True:
            self._watching[bucket] = False
            reconnects = self._reconnects
            watch = await retrying(kv.watch, outage)
            try:
                quiet = 0.0
                while quiet < silence and reconnects == self._reconnects:
                    try:
                        entry = await watch.next(timeout=WATCH_POLL_S)
                    except BusTimeout:
                        quiet += WATCH_POLL_S
                        continue
                    except BusError as e:
                        log.warning("%s; watching again", e)
                        break
                    quiet = 0.0
                    if entry is None:  # what the bucket held is delivered: from now on it is news
                        self._watching[bucket] = True
                    else:
                        await self._heartbeat_entry(bucket, entry)
            finally:
                self._watching[bucket] = False
                await watch.stop()

    async def _probe(self, bucket: str) -> None:
        """Whether heartbeats can be stored at all: a bucket whose stream has lost its leader (a
        cluster node died) takes none until another is elected, and the silence that makes is
        nobody's fault. Asked every tick, with a write the bucket refuses (Bucket.writable)."""
        kv = self.kv[bucket]
        while True:
            start = time.monotonic()
            self._writable[bucket] = await kv.writable(timeout=TICK_S)
            await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - start)))

    async def _heartbeat_entry(self, bucket: str, entry: KvEntry) -> None:
        live = self._live[bucket]
        if entry.removed:
            if live.left(entry.key):
                log.warning("%s %s left (%s)", bucket, entry.key, entry.operation)
                await self.events.put((_lost(bucket, entry.key), None))
            return
        if not entry.value or not live.saw(entry.key, entry.revision, time.monotonic()):
            return  # a replayed heartbeat
        with contextlib.suppress(DuplexError):  # undecodable: a sign of life, and nothing more
            ev: core.Event
            if bucket == subjects.KV_WORKERS:
                ev = core.WorkerSeen(wire.decode_as(entry.value, wire.WorkerHeartbeat))
            else:  # it lists the calls the frontend holds: the core ends those it no longer does
                ev = core.FrontendSeen(wire.decode_as(entry.value, wire.FrontendHeartbeat))
            await self.events.put((ev, None))

    async def _beat(self) -> None:
        await health_beat(self.bus, self.config.heartbeat_s)

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for bucket, live in self._live.items():
                now = time.monotonic()
                live.hear(self.bus.is_connected and self._watching[bucket] and self._writable[bucket], now)
                for key in live.expired(now):
                    log.warning("%s %s stopped heartbeating and did not answer when asked", bucket, key)
                    await self._lose(bucket, key, "expired")
                for key in live.overdue(now):
                    self.tasks.spawn(self._ask(bucket, key))
            await self.events.put((core.Tick(time.time()), None))

    async def _ask(self, bucket: str, key: str) -> None:
        """Ask a process whose heartbeats stopped whether it lives, until it answers, nobody
        is there to answer, or its time is up (Liveness.expired, on the ticks)."""
        live = self._live[bucket]
        while live.asked(key):
            try:
                await self.bus.request(subjects.alive(key), b"", live.ask_s)
            except BusTimeout:
                continue  # asked again: only the ticks' listening clock convicts a silent one
            except BusUnavailable as e:
                if self.bus.is_connected and live.absent(key):  # no one subscribed: its connection is gone
                    log.warning("%s %s stopped heartbeating and is not connected (%s)", bucket, key, e.message)
                    await self._lose(bucket, key, "absent")
                    return
                await asyncio.sleep(TICK_S)  # this conductor is cut off: it hears nobody, convicts nobody
            except BusError as e:
                log.warning("asking %s %s whether it lives: %s", bucket, key, e)
                await asyncio.sleep(TICK_S)
            else:
                if live.answered(key, time.monotonic()):
                    log.warning("%s %s answered: alive, its heartbeats come late (the bus is slow)", bucket, key)
                    self.metrics.liveness_asks.labels("answered").inc()
                return

    async def _lose(self, bucket: str, key: str, outcome: str) -> None:
        self.metrics.liveness_asks.labels(outcome).inc()
        await self.events.put((_lost(bucket, key), None))


class RoundTrips(Protocol):
    async def round_trip(self, timeout: float) -> None: ...


async def health_beat(bus: RoundTrips, period_s: float) -> None:
    """The container healthcheck's sign of life: NATS answered a round trip just now. No
    answer: no beat (the check fails), logged once per outage, and asked again. A failure
    that trying again cannot mend (BusError.recoverable false), or one that is not the bus's
    at all (a bug), ends the conductor with that error rather than leave it running unhealthy
    for ever without a word (`duplexbus up` or the container restarts it)."""
    outage = Outage("the health beat's round trip to NATS", log)
    while True:
        try:
            await bus.round_trip(period_s)
        except BusError as e:
            if not e.recoverable:
                log.error("the health beat's round trip to NATS: %s; trying again cannot mend it: stopping", e)
                raise
            outage.failed(e, time.monotonic())
        except Exception as e:
            log.error("the health beat failed: %r; stopping", e)
            raise
        else:
            outage.ok(time.monotonic())
            healthfile.beat()
        await asyncio.sleep(period_s)


def _lost(bucket: str, key: str) -> core.Event:
    return core.WorkerLost(key) if bucket == subjects.KV_WORKERS else core.FrontendLost(key)


def _event_of(subject: str, data: bytes, seq: int) -> core.Event | None:
    try:
        s = subjects.parse(subject)
        msg = wire.decode(data)
    except (ValueError, DuplexError):
        log.warning("undecodable message on %s", subject)
        return None
    if isinstance(msg, wire.Open):
        return core.Opened(msg, time.time(), seq)
    if isinstance(msg, wire.EndOfInput) and s.edge:
        return core.InputEnded(s.cid, s.edge, msg.total)
    if isinstance(msg, wire.Done):
        return core.PartitionDone(s.cid, msg)
    if isinstance(msg, wire.Abort):
        return core.AbortRequested(s.cid, msg.reason, msg.status)
    return None
