"""The worker's shell: per-call subscriptions and catch-up reads in, engine actions out.

A worker runs one or more partitions of one model. For each assigned call it
subscribes (core NATS) to the call's input subjects of those partitions, then
reads whatever the stream already holds for them (input that arrived before
placement, I-2; or everything, when it replaces a lost worker). Items are
numbered, so the overlap of the two is deduplicated by the stream buffers.
When to read the stream, and from where, is `repair.InputReads`' to decide, and how
much input a call and the worker may hold, `flow.Bounds`' (both pure); this shell
carries the reads out and steps the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from models.registry import served_model
from services.worker import engine as eng
from services.worker.flow import Bounds
from services.worker.repair import Gaps, InputReads, Next, StartRead, Unit, Why
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg, BusSubscription
from shared.bus.life import SignsOfLife
from shared.bus.readiness import Readiness
from shared.bus.store_behind import StoreBehind
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError, ConfigError, DuplexError, Overloaded, WorkerFailed
from shared.runtime.health import HealthServer
from shared.runtime.metrics import WorkerMetrics
from shared.runtime.process import TaskSet, cancel_and_wait
from shared.runtime.stats import Reservoir
from shared.runtime.version import VERSION
from shared.sdk.model import StepInput

log = logging.getLogger(__name__)

TICK_S = 0.02  # how often a partition that wants steps without input (paced audio) is stepped
READ_BATCH = 64  # messages a read fetches at once: what one that stops for want of room has fetched in vain


@dataclass
class _Assigned:
    cid: str
    partitions: list[str]
    subs: list[BusSubscription] = field(default_factory=list)  # its abort and fin
    inputs: dict[str, BusSubscription] = field(default_factory=dict)  # edge -> live input (none while paused)
    catchups: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # partition -> the read InputReads last started


class _Signal:
    """Wakes every task waiting on it at the next fire() (steps free room for reads)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0

    async def wait(self, timeout: float) -> None:
        event = self._event
        self._waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:
            self._waiting -= 1

    def fire(self) -> None:
        if self._waiting:
            self._event.set()
            self._event = asyncio.Event()


class _Runner:
    """One engine and the task that steps it."""

    def __init__(self, engine: eng.Engine, blocking: bool) -> None:
        self.engine = engine
        self.blocking = blocking  # run step() in a thread so bus I/O goes on meanwhile
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # partition state is not touched while a step runs in a thread


class WorkerService:
    def __init__(
        self,
        config: ServingConfig,
        model: str,
        partitions: list[str] | None = None,
        worker_id: str | None = None,
        health_port: int | None = None,
    ) -> None:
        self.config = config
        self.metrics = WorkerMetrics()
        self.metrics.live_calls.set_function(lambda: len(self.calls))
        self.readiness = Readiness(config.heartbeat_s)
        self.health_port = health_port  # /livez, /readyz, /metrics on it (None: not served)
        self.model = served_model(model)
        self.model_name = model
        topo = self.model.topology
        self.partitions = partitions or list(topo.partitions)
        for p in self.partitions:
            if p not in topo.partitions:
                raise ConfigError("partition", f"model {model!r} has no partition {p!r}; it has {', '.join(topo.partitions)}")
        self.worker_id = worker_id or subjects.new_process_id("worker")
        self.runners: dict[str, _Runner] = {}
        for p in self.partitions:
            part = self.model.create_partition(p)
            self.runners[p] = _Runner(
                eng.Engine(p, topo, part, max_batch=config.max_batch, tick_s=TICK_S),
                blocking=getattr(part, "blocking", True),
            )
        self._engines = tuple(r.engine for r in self.runners.values())
        # which partition consumes each edge this worker reads
        self.consumer_of = {c.edge_name: c.to_partition for c in topo.connections if c.to_partition in self.partitions}
        self.producer_of = {c.edge_name: c.from_partition for c in topo.connections}
        self.calls: dict[str, _Assigned] = {}
        self._bus: BusConnection | None = None
        self._accepting = True
        self.tasks = TaskSet()
        # when a call's input is read from the stream (repair policy)
        self.reads = InputReads(produced_by=self.producer_of)
        self.bounds = Bounds(config.worker_call_buffer_bytes, config.worker_buffer_bytes)  # flow control
        self._freed = _Signal()  # a step or a dropped call freed held input
        self.repairs = 0  # catch-up reads started for items lost in transit
        self.pauses = 0  # calls whose live input was left in the stream for want of room
        self.ends = StoreBehind(self._store_once)  # edge ends, dones and aborts, stored with an ack
        self.data_path_ms = Reservoir()  # publish by the frontend -> here, for live (not catch-up) items

    @property
    def bus(self) -> BusConnection:
        if self._bus is None:
            raise RuntimeError("the worker has not started")
        return self._bus

    @property
    def load(self) -> int:
        return len(self.calls)

    @property
    def capacity(self) -> int:
        """worker_slots, or less where a partition holds fewer calls (its KV cache pool);
        0 while stopping, so the conductor places no new call here."""
        if not self._accepting:
            return 0
        bounds = [self.config.worker_slots]
        bounds += [c for r in self.runners.values() if (c := r.engine.partition.capacity()) is not None]
        return min(bounds)

    async def run(self, stop: asyncio.Event) -> None:
        self._bus = await BusConnection.open(
            self.config, f"duplexbus-{self.worker_id}", buckets=[subjects.KV_WORKERS], reconnected=self._on_reconnect
        )
        kv = self.bus.kv[subjects.KV_WORKERS]
        self.life = SignsOfLife(self.config, subjects.KV_WORKERS, self.worker_id, self._heartbeat, self.config.heartbeat_s)
        await self.bus.subscribe(subjects.assign(self.worker_id), self._on_assign)
        self.readiness.conn = self.bus
        health = None
        if self.health_port is not None:  # on the serving host: loopback unless the config opens it
            health = HealthServer(self.metrics, self.readiness, host=self.config.host, port=self.health_port)
            await health.start()
        # In NATS service discovery (`nats micro ls`), with its figures at ctl.worker.{id}.stats.
        meta = {"worker_id": self.worker_id, "model": self.model_name, "partitions": ",".join(self.partitions)}
        stats = {"stats": (subjects.worker_stats(self.worker_id), self._stats)}
        announced = await self.bus.announce(subjects.SERVICE_WORKER, VERSION, "runs partitions of a model", meta, stats)
        log.info("worker %s serving %s %s", self.worker_id, self.model_name, self.partitions)
        async with asyncio.TaskGroup() as tg:
            ready = tg.create_task(self.readiness.run())
            steppers = [tg.create_task(self._step_loop(name, r)) for name, r in self.runners.items()]
            hb = tg.create_task(self.life.run())
            repair = tg.create_task(self._repair_gaps())
            ends = tg.create_task(self.ends.run())
            await stop.wait()
            # Graceful: stop intake (a heartbeat with no capacity left), let running calls
            # finish, and only then leave: a deleted key is a lost worker to the conductor,
            # which would place these calls again elsewhere while they still run here.
            self._accepting = False
            try:
                await kv.put(self.worker_id, self._heartbeat())
            except BusError as e:  # (a cluster electing a leader, say) the drain goes on all the same
                log.warning("could not announce that this worker stops taking calls: %s", e)
            await self._drain(timeout=self.config.shutdown_drain_s)
            await cancel_and_wait(hb)  # its connection flushed and closed: no heartbeat lands after the delete
            await kv.delete_if_there(self.worker_id)
            await cancel_and_wait(repair, ends, ready, *steppers)
        await announced.stop()
        if health is not None:
            await health.close()
        await self.tasks.close()
        await self.bus.close()

    def _heartbeat(self) -> bytes:
        return wire.encode(
            wire.WorkerHeartbeat(
                worker_id=self.worker_id,
                model=self.model_name,
                partitions=self.partitions,
                model_partitions=list(self.model.topology.partitions),
                capacity=self.capacity,
                load=self.load,
                ts=time.time(),
            )
        )

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (self.calls or len(self.ends)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.calls or len(self.ends):
            log.warning("stopping with %d calls unfinished, %d messages not stored", len(self.calls), len(self.ends))

    # -- assignment ----------------------------------------------------------
    async def _on_assign(self, msg: BusMsg) -> None:
        try:
            a = wire.decode_as(msg.data, wire.Assign)
            await self._assign(a)
            reply = wire.AssignReply(ok=True)
        except DuplexError as e:
            reply = wire.AssignReply(ok=False, error=e.message)
        except Exception as e:
            log.exception("assign failed")
            reply = wire.AssignReply(ok=False, error=str(e))
        if msg.reply:
            await msg.respond(wire.encode(reply))

    async def _assign(self, a: wire.Assign) -> None:
        """Take the call's partitions that run here. A call may come back for more of its
        partitions (another worker of one of them died and it was placed here): only the new
        ones are added; an assignment repeated by the conductor changes nothing."""
        if not self._accepting:
            raise Overloaded("worker is shutting down")
        call = self.calls.get(a.cid)
        mine = [p for p in a.partitions if p in self.runners and (call is None or p not in call.partitions)]
        if call is not None and not mine:
            return
        if call is None and self.load >= self.capacity:
            raise Overloaded(f"worker {self.worker_id} is full ({self.capacity} calls)")
        kwargs = await self._kwargs_from_open(a.cid) if a.kwargs_in_open else a.model_kwargs
        added: list[str] = []
        try:
            for p in mine:
                r = self.runners[p]
                async with r.lock:
                    r.engine.add_call(a.cid, kwargs)
                added.append(p)
        except BaseException:
            for p in added:  # a partition refused it (its own capacity, bad kwargs): leave no trace
                async with self.runners[p].lock:
                    self.runners[p].engine.drop_call(a.cid)
            raise
        if call is None:
            call = self.calls[a.cid] = _Assigned(a.cid, [])
            call.subs.append(await self.bus.subscribe(subjects.abort(a.cid), self._on_end))
            call.subs.append(await self.bus.subscribe(subjects.fin(a.cid), self._on_end))
        call.partitions += mine
        await self._subscribe_inputs(call, mine)
        # No flush (a round trip) here: assignments are handled one at a time, and the catch-up
        # reads' barrier is published on this connection after these subscriptions, so the
        # server has them in place before it stores the barrier. One barrier serves them all.
        now = time.monotonic()
        reads = [self.reads.subscribed(a.cid, p, self.runners[p].engine.input_edges(), now) for p in mine]
        barrier = self.tasks.spawn(self._barrier(call)) if any(r is not None and r.from_start for r in reads) else None
        for read in reads:
            self._start_read(read, barrier)
        for p in mine:
            self.runners[p].wake.set()

    async def _repair_gaps(self) -> None:
        """An item can go missing in transit (published while a subscription was being set up,
        or during a reconnect), and a stream buffer then waits on it forever; a lost end leaves
        no gap but stalls the call. InputReads says which calls to read again from the stream."""
        while True:
            await asyncio.sleep(self.reads.period_s)
            missing: dict[Unit, Gaps] = {
                (cid, p): gaps for p, r in self.runners.items() for cid, gaps in r.engine.missing().items()
            }
            awaiting = [(cid, p) for p, r in self.runners.items() for cid in r.engine.awaiting_input()]
            for read in self.reads.tick(time.monotonic(), missing, awaiting):
                self._start_read(read)

    async def _on_reconnect(self) -> None:
        """While disconnected the core subscriptions missed whatever was published: read every
        call's input again from the stream (duplicates are dropped by seq)."""
        log.warning("reconnected to NATS: reading %d calls' input from the stream", len(self.calls))
        for read in self.reads.reconnected():
            self._start_read(read)

    async def _subscribe_inputs(self, call: _Assigned, partitions: list[str]) -> None:
        """Live input of the partitions' edges that have no subscription yet."""
        for e in [e for p in partitions for e in self.runners[p].engine.input_edges()]:
            if e in call.inputs or self.producer_of.get(e) in call.partitions:
                continue  # subscribed, or produced in this process: handed over directly (_local_consumer)
            call.inputs[e] = await self.bus.subscribe_direct(subjects.consumed(call.cid, e), self._on_data)

    def _pause(self, cid: str, partition: str) -> None:
        """No room for the partition's input of the call: its live input is left in the stream
        (unsubscribed, so the worker does not even receive it) and a read takes it at the
        worker's pace. The call's other partitions here go on as they were."""
        newly, read = self.reads.pause(cid, partition)
        if not newly:
            return
        self.pauses += 1
        call = self.calls.get(cid)
        if call is not None:
            subs = [call.inputs.pop(e) for e in self.runners[partition].engine.input_edges() if e in call.inputs]
            self.tasks.spawn(BusConnection.unsubscribe_all(subs))  # not from inside the subscription's own handler
        self._start_read(read)

    def _may_take(self, cid: str, engine: eng.Engine, live: bool) -> bool:
        """Room for one more item of the call's partition (flow.Bounds), live or from a read.
        On every live item."""
        worker_held = 0
        for e in self._engines:
            worker_held += e.held_bytes
        if live:
            return self.bounds.take(engine.held(cid), worker_held)
        return self.bounds.read_take(engine.held(cid), worker_held, engine.has_chunk(cid))

    async def _room(self, cid: str, engine: eng.Engine) -> bool:
        """Wait until a paused partition of the call may read on or take live input again
        (flow.Bounds.has_room); False once the call is gone."""
        while cid in self.calls:
            worker_held = sum(e.held_bytes for e in self._engines)
            if self.bounds.has_room(engine.held(cid), worker_held, engine.has_chunk(cid)):
                return True
            await self._freed.wait(0.5)
        return False

    def _start_read(self, read: StartRead | None, barrier: asyncio.Task[None] | None = None) -> None:
        """Carry out InputReads' decision (`barrier`: the placement barrier it shares with the
        reads of the call's other partitions placed with it)."""
        if read is None:
            return
        call = self.calls.get(read.cid)
        if call is None:
            self.reads.forget(read.cid)
            return
        self.metrics.catch_up_reads.labels(read.why.value).inc()
        if read.why is Why.GAP:
            log.warning("call %s, %s: %s, reading them from the stream", read.cid, read.partition, read.detail)
            self.repairs += 1
        elif read.why is Why.STALL:  # a client that is quiet is no news: DEBUG, not INFO
            log.debug("call %s, %s: %s, reading its input from the stream", read.cid, read.partition, read.detail)
        running = call.catchups.get(read.partition)
        if running is not None and not running.done():
            running.cancel()  # ended as far as InputReads knows (it starts one read at a time)
        call.catchups[read.partition] = self.tasks.spawn(self._catch_up(call, read, barrier))

    async def _kwargs_from_open(self, cid: str) -> dict[str, Any]:
        stored = await self.bus.last_stored(subjects.open_(cid))
        return dict(wire.decode_as(stored, wire.Open).model_kwargs)

    async def _catch_up(self, call: _Assigned, r: StartRead, barrier: asyncio.Task[None] | None) -> None:
        """Carry out a read InputReads started (from the start behind a barrier, or on from where
        reads reached), at the worker's pace: without room for the next item it stops, the
        partition is paused, and it reads on once there is room. A paused partition read to
        the end takes live input again behind a barrier and is read on (repair.Next.RESUME)."""
        cid, engine = call.cid, self.runners[r.partition].engine
        try:
            if r.from_start:
                await (asyncio.shield(barrier) if barrier is not None else self._barrier(call))
            while await self._room(cid, engine):
                ended = await self._read_on(call, r)
                if ended is None:
                    return
                if not ended:
                    self._pause(cid, r.partition)
                    continue
                if self.reads.at_end(cid, r.partition, r.read_id) is Next.DONE or not await self._room(cid, engine):
                    return
                await self._subscribe_inputs(call, [r.partition])
                self.reads.resumed(cid, r.partition, time.monotonic())
                await self._barrier(call)  # what was left in the stream before the subscriptions is stored before it
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("catch-up read for %s, %s failed", cid, r.partition)
        finally:
            self.reads.read_ended(cid, r.partition, r.read_id)

    async def _read_on(self, call: _Assigned, r: StartRead) -> bool | None:
        """Read the partition's input subjects from where its reads reached: True once read to
        the end, False where it stopped for want of room, None where the call ended."""
        cid = call.cid
        # abort and fin too: a call that ended before we subscribed must not hold a slot forever
        filters = [subjects.consumed(cid, e) for e in r.edges] + [subjects.abort(cid), subjects.fin(cid)]
        # aclosing: a read left early ends its consumer now, not when the generator is collected
        read = self.bus.read_stored(filters, after=self.reads.read_to(cid, r.partition), batch=READ_BATCH)
        async with contextlib.aclosing(read) as stored:
            async for subject, data, seq in stored:
                if cid not in self.calls:
                    return None
                if subjects.parse(subject).kind in (subjects.ABORT, subjects.FIN):
                    await self._forget(cid)
                    return None
                took = self._take(subject, data, live=False)
                if took is None:
                    return False
                await self._carry_out(*took)
                self.reads.read_progress(cid, r.partition, r.read_id, seq)
        return True

    async def _barrier(self, call: _Assigned) -> None:
        """Store a Placed message (see wire.Placed): once it is stored, so is any input published
        before this worker's subscriptions. Where it cannot be, the read goes on, and the gap
        and stall reads cover what it misses."""
        placed = wire.Placed(worker_id=self.worker_id, partitions=list(call.partitions))
        try:
            await self.bus.store(subjects.placed(call.cid, self.worker_id), wire.encode(placed))
        except Exception as e:
            log.warning("call %s: the barrier before its catch-up read was not stored (%r)", call.cid, e)

    async def _stats(self, request: bytes) -> bytes:
        """Live figures for operators and benchmarks; a request body of b"reset" clears them after."""
        parts = {}
        for name, r in self.runners.items():
            st = r.engine.stats
            sizes = st.batch_sizes
            parts[name] = {
                "calls": len(r.engine),
                "steps": st.steps,
                "chunks": st.chunks,
                "mean_batch": (sum(sizes) / len(sizes)) if sizes else 0.0,
                "max_batch": max(sizes) if sizes else 0,
            }
        lat = self.data_path_ms
        body = {
            "worker_id": self.worker_id,
            "model": self.model_name,
            "load": self.load,
            "repairs": self.repairs,
            "pauses": self.pauses,
            "held_bytes": sum(r.engine.held_bytes for r in self.runners.values()),
            "store_retries": self.ends.retries,
            "partitions": parts,
            "data_path_ms": {"n": lat.count, "p50": lat.percentile(50), "p99": lat.percentile(99)},
        }
        if request == b"reset":
            lat.clear()
            for r in self.runners.values():
                r.engine.stats.batch_sizes.clear()
        return json.dumps(body).encode()

    # -- data ----------------------------------------------------------------
    def _on_data(self, m: BusMsg) -> None:
        """Straight from the read loop (BusConnection.subscribe_direct): most items only go into a
        stream buffer and wake the step loop, with no task in between."""
        if self.bus.is_stored(m):
            self.tasks.spawn(self._handle_stored(m))
            return
        self._carry_out_later(m.subject, self._take(m.subject, m.data, live=True))

    async def _handle_stored(self, m: BusMsg) -> None:
        self._carry_out_later(m.subject, self._take(m.subject, await self.bus.body(m), live=True))

    def _carry_out_later(self, subject: str, took: tuple[list[eng.Action], str] | None) -> None:
        if took is None:  # no room for it: the partition's input waits in the stream
            s = subjects.parse(subject)
            assert s.edge is not None
            self._pause(s.cid, self.consumer_of[s.edge])
        elif took[0]:
            self.tasks.spawn(self._carry_out(*took))

    def _take(self, subject: str, data: bytes, live: bool) -> tuple[list[eng.Action], str] | None:
        """Hand one item or end of stream to its engine: (actions to carry out, partition), or
        None where there is no room for the item (flow.Bounds): it is left in the stream."""
        try:
            s = subjects.parse(subject)
            if s.edge is None or s.edge not in self.consumer_of:
                return [], ""
            partition = self.consumer_of[s.edge]
            if live and self.reads.paused(s.cid, partition):
                return [], ""  # left in the stream: the partition's read takes it
            msg = wire.decode(data)
        except (ValueError, DuplexError):
            log.warning("dropping undecodable message on %s", subject)
            return [], ""
        r = self.runners[partition]
        if isinstance(msg, wire.InputItem | wire.EdgeItemMsg):
            if not self._may_take(s.cid, r.engine, live) and r.engine.wants_item(s.cid, s.edge, msg.seq):
                return None  # (a repeat is let through: it holds nothing)
            if live:
                self.reads.live_input(s.cid, partition, time.monotonic())
                if isinstance(msg, wire.InputItem) and msg.sent_ns:
                    self.data_path_ms.add((time.time_ns() - msg.sent_ns) / 1e6)
            actions = r.engine.push(s.cid, s.edge, msg.seq, msg.item.to_item())
        elif isinstance(msg, wire.EndOfInput | wire.EdgeEnd):
            if live:
                self.reads.live_input(s.cid, partition, time.monotonic())
            actions = r.engine.end(s.cid, s.edge, msg.total)
        else:
            return [], ""
        r.wake.set()
        return actions, r.engine.name

    async def _on_end(self, m: BusMsg) -> None:
        """The call was aborted or finished elsewhere: forget it."""
        s = subjects.parse(m.subject)
        await self._forget(s.cid)

    async def _forget(self, cid: str) -> None:
        call = self.calls.pop(cid, None)
        if call is None:
            return
        self.reads.forget(cid)
        for p in call.partitions:
            r = self.runners[p]
            async with r.lock:
                r.engine.drop_call(cid)
        self._freed.fire()
        self._unsubscribe_later(call)

    def _unsubscribe_later(self, call: _Assigned) -> None:
        """In a task of its own: this often runs inside one of the call's own subscription
        callbacks, and nats-py cancels a subscription's callback when it unsubscribes."""
        self.tasks.spawn(self._unsubscribe(call))

    async def _unsubscribe(self, call: _Assigned) -> None:
        for task in call.catchups.values():
            if not task.done() and task is not asyncio.current_task():
                task.cancel()
        subs, call.subs = call.subs + list(call.inputs.values()), []
        call.inputs.clear()
        await BusConnection.unsubscribe_all(subs)

    # -- stepping ------------------------------------------------------------
    async def _step_loop(self, name: str, r: _Runner) -> None:
        window = self.config.step_window_ms / 1000
        while True:
            now = time.monotonic()
            async with r.lock:
                batch = r.engine.next_batch(now)
                if batch:
                    actions = await self._run_step(name, r, batch)
                    self._freed.fire()
            if not batch:
                r.wake.clear()
                due = r.engine.next_due(now)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.wake.wait(), timeout=1.0 if due is None else max(due, 0.001))
                continue
            await self._carry_out(actions, name)
            # Let input gather between steps: bigger batches, and the outputs of one step
            # leave in one socket write rather than many.
            await asyncio.sleep(window)

    async def _run_step(self, name: str, r: _Runner, batch: list[StepInput]) -> list[eng.Action]:
        try:
            start = time.perf_counter()
            if r.blocking:
                emissions = await asyncio.to_thread(r.engine.partition.step, batch)
            else:
                emissions = r.engine.partition.step(batch)
            self.metrics.step_seconds.labels(name).observe(time.perf_counter() - start)
            self.metrics.batch_size.labels(name).observe(len(batch))
            return r.engine.complete(batch, emissions)
        except Exception as e:  # a model bug fails the batch's calls, not the process (I-4)
            log.exception("step of %s failed", name)
            err = WorkerFailed(f"partition {name} failed: {e}")
            return [a for s in batch for a in r.engine.fail_call(s.cid, err)]

    async def _carry_out(self, actions: list[eng.Action], partition: str) -> None:
        for a in actions:
            if isinstance(a, eng.PublishOutput):
                body = wire.encode(
                    wire.OutputMsg(partition=partition, seq=a.seq, json=msgspec.json.encode(a.data), sent_ns=time.time_ns())
                )
                await self.bus.publish(subjects.out(a.cid), body)
            elif isinstance(a, eng.PublishEdgeItem):
                body = wire.encode(wire.EdgeItemMsg(seq=a.seq, item=wire.WireItem.from_item(a.item)))
                await self.bus.publish(subjects.edge(a.cid, a.edge), body)  # stored for replay and recovery
                if (r := self._local_consumer(a.cid, a.edge)) is not None:
                    if self.reads.paused(a.cid, r.engine.name):
                        continue  # its read takes the item from the stream
                    if not self._may_take(a.cid, r.engine, live=True) and r.engine.wants_item(a.cid, a.edge, a.seq):
                        self._pause(a.cid, r.engine.name)  # as for live input: it waits in the stream
                        continue
                    self.reads.live_input(a.cid, r.engine.name, time.monotonic())
                    r.wake.set()
                    await self._carry_out(r.engine.push(a.cid, a.edge, a.seq, a.item), r.engine.name)
            elif isinstance(a, eng.PublishEdgeEnd):
                # Stored behind (self.ends): the step loop does not wait for the ack.
                self.ends.put(subjects.edge_end(a.cid, a.edge), wire.encode(wire.EdgeEnd(total=a.total)))
                if (r := self._local_consumer(a.cid, a.edge)) is not None:  # paused too: an end holds nothing
                    self.reads.live_input(a.cid, r.engine.name, time.monotonic())
                    r.wake.set()
                    await self._carry_out(r.engine.end(a.cid, a.edge, a.total), r.engine.name)
            elif isinstance(a, eng.PublishDone):
                done = wire.Done(partition=partition, worker_id=self.worker_id, outputs=a.outputs, usage=a.usage)
                # The call is let go only once its done is stored: a worker that stopped before
                # that would leave the conductor waiting on a done that never comes.
                then = functools.partial(self._partition_finished, a.cid, partition)
                self.ends.put(subjects.done(a.cid, partition), wire.encode(done), then)
            elif isinstance(a, eng.FailCall):
                log.info("call %s failed in %s: %s", a.cid, partition, a.error.message)
                self.ends.put(subjects.abort(a.cid), wire.encode(wire.Abort(reason=a.error.message, status=a.error.status)))
                await self._forget(a.cid)

    async def _store_once(self, subject: str, body: bytes) -> None:
        await self.bus.store_once(subject, body)

    def _local_consumer(self, cid: str, edge: str) -> _Runner | None:
        """The runner of the edge's consumer partition where it runs the call in this process:
        an edge item (or end) is then handed to it at once instead of through the bus, which
        it also went to (so a replay, or a worker that takes over, reads it from the stream)."""
        consumer = self.consumer_of.get(edge)
        call = self.calls.get(cid)
        if consumer is None or call is None or consumer not in call.partitions:
            return None
        return self.runners[consumer]

    async def _partition_finished(self, cid: str, partition: str) -> None:
        call = self.calls.get(cid)
        if call is None:
            return
        if all(cid not in self.runners[p].engine for p in call.partitions):
            self.calls.pop(cid, None)
            self.reads.forget(cid)
            self._unsubscribe_later(call)
