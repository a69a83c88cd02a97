"""The worker's shell: per-call subscriptions and catch-up reads in, engine actions out.

A worker runs one or more partitions of one model. For each assigned call it
subscribes (core NATS) to the call's input subjects of those partitions, then
reads whatever the stream already holds for them (input that arrived before
placement, I-2; or everything, when it replaces a lost worker). Items are
numbered, so the overlap of the two is deduplicated by the stream buffers.
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
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg, BusSubscription
from shared.bus.store_behind import StoreBehind
from shared.runtime.config import ServingConfig
from shared.runtime.errors import ConfigError, DuplexError, Overloaded, WorkerFailed
from shared.runtime.process import TaskSet
from shared.runtime.stats import Reservoir
from shared.sdk.model import StepInput

log = logging.getLogger(__name__)

TICK_S = 0.02  # how often a partition that wants steps without input (paced audio) is stepped
REPAIR_PERIOD_S = 0.5  # how long an item may be missing before it is read from the stream
STALL_S = 2.0  # no input at all this long, streams not complete: read the stream (a lost end leaves no gap)
STALL_MAX_S = 16.0  # the wait doubles while such reads bring nothing, up to this


@dataclass
class _Assigned:
    cid: str
    partitions: list[str]
    subs: list[BusSubscription] = field(default_factory=list)
    catchup: asyncio.Task[None] | None = None
    catchup_edges: frozenset[str] = frozenset()  # what the running catch-up read covers
    read_to: int = 0  # the stream sequence catch-up reads of those edges have read to
    last_input: float = field(default_factory=time.monotonic)  # live input, or a stall read, last
    stall_s: float = STALL_S


class _Runner:
    """One engine and the task that steps it."""

    def __init__(self, engine: eng.Engine, blocking: bool) -> None:
        self.engine = engine
        self.blocking = blocking  # run step() in a thread so bus I/O goes on meanwhile
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # partition state is not touched while a step runs in a thread


class WorkerService:
    def __init__(
        self, config: ServingConfig, model: str, partitions: list[str] | None = None, worker_id: str | None = None
    ) -> None:
        self.config = config
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
        # which partition consumes each edge this worker reads
        self.consumer_of = {c.edge_name: c.to_partition for c in topo.connections if c.to_partition in self.partitions}
        self.producer_of = {c.edge_name: c.from_partition for c in topo.connections}
        self.calls: dict[str, _Assigned] = {}
        self._bus: BusConnection | None = None
        self._accepting = True
        self.tasks = TaskSet()
        self.repairs = 0  # catch-up reads started for items lost in transit
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
        await self.bus.subscribe(subjects.assign(self.worker_id), self._on_assign)
        await self.bus.subscribe(subjects.worker_stats(self.worker_id), self._on_stats)
        log.info("worker %s serving %s %s", self.worker_id, self.model_name, self.partitions)
        async with asyncio.TaskGroup() as tg:
            steppers = [tg.create_task(self._step_loop(name, r)) for name, r in self.runners.items()]
            hb = tg.create_task(kv.heartbeat(self.worker_id, self._heartbeat, self.config.heartbeat_s))
            repair = tg.create_task(self._repair_gaps())
            ends = tg.create_task(self.ends.run())
            await stop.wait()
            # Graceful: stop intake (a heartbeat with no capacity left), let running calls
            # finish, and only then leave: a deleted key is a lost worker to the conductor,
            # which would place these calls again elsewhere while they still run here.
            self._accepting = False
            await kv.put(self.worker_id, self._heartbeat())
            await self._drain(timeout=self.config.shutdown_drain_s)
            hb.cancel()
            await kv.delete_if_there(self.worker_id)
            repair.cancel()
            ends.cancel()
            for t in steppers:
                t.cancel()
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
        for e in [e for p in mine for e in self.runners[p].engine.input_edges()]:
            if self.producer_of.get(e) in call.partitions:
                continue  # produced in this process: handed over directly (_local_consumer)
            call.subs.append(await self.bus.subscribe_direct(subjects.consumed(a.cid, e), self._on_data))
        # No flush (a round trip) here: assignments are handled one at a time, and the catch-up
        # read's barrier is published on this connection after these subscriptions, so the
        # server has them in place before it stores the barrier.
        self._start_catch_up(call)
        for p in mine:
            self.runners[p].wake.set()

    async def _repair_gaps(self) -> None:
        """An item can go missing in transit (published while a subscription was being set up,
        or during a reconnect), and a stream buffer then waits on it forever. Every item is in
        the stream: where the same item has been missing for a whole period, read the call's
        input again from the stream (duplicates are dropped by seq)."""
        seen: dict[str, tuple[tuple[str, int], ...]] = {}
        while True:
            await asyncio.sleep(REPAIR_PERIOD_S)
            now: dict[str, tuple[tuple[str, int], ...]] = {}
            for r in self.runners.values():
                for cid, gaps in r.engine.missing().items():
                    now[cid] = now.get(cid, ()) + gaps
            for cid, gaps in now.items():
                call = self.calls.get(cid)
                if call is None or seen.get(cid) != gaps:
                    continue
                log.warning("call %s: items %s missing for %.1fs, reading them from the stream", cid, gaps, REPAIR_PERIOD_S)
                self.repairs += 1
                self._start_catch_up(call)
            seen = now
            self._read_stalled()

    def _read_stalled(self) -> None:
        """A lost item with nothing after it, or a lost end of stream, leaves no gap to see:
        where a call's input is incomplete and nothing has come for a while, read the stream
        (waiting twice as long each time such a read brings nothing new, for idle clients)."""
        t = time.monotonic()
        for cid in {c for r in self.runners.values() for c in r.engine.awaiting_input()}:
            call = self.calls.get(cid)
            if call is None or t - call.last_input < call.stall_s or (call.catchup and not call.catchup.done()):
                continue
            log.info("call %s: no input for %.1fs, reading its input from the stream", cid, t - call.last_input)
            call.last_input, call.stall_s = t, min(2 * call.stall_s, STALL_MAX_S)
            self._start_catch_up(call)

    async def _on_reconnect(self) -> None:
        """While disconnected the core subscriptions missed whatever was published: read every
        call's input again from the stream (duplicates are dropped by seq)."""
        log.warning("reconnected to NATS: reading %d calls' input from the stream", len(self.calls))
        for call in list(self.calls.values()):
            self._start_catch_up(call)

    def _start_catch_up(self, call: _Assigned) -> None:
        """Read the call's input from the stream, unless a read of all of it is under way (one
        started before the call gained a partition here does not cover that one's input)."""
        edges = frozenset(e for p in call.partitions for e in self.runners[p].engine.input_edges())
        if call.catchup is not None and not call.catchup.done():
            if edges <= call.catchup_edges:
                return
            call.catchup.cancel()  # read again, all of it: repeats are dropped by seq
        placed = not edges <= call.catchup_edges  # new subscriptions: read from the start, behind a barrier
        if placed:
            call.read_to = 0
        call.catchup_edges = edges
        call.catchup = self.tasks.spawn(self._catch_up(call, sorted(edges), placed))

    async def _kwargs_from_open(self, cid: str) -> dict[str, Any]:
        stored = await self.bus.last_stored(subjects.open_(cid))
        return dict(wire.decode_as(stored, wire.Open).model_kwargs)

    async def _catch_up(self, call: _Assigned, edges: list[str], placed: bool) -> None:
        """Read what the stream holds for the call's input subjects: from the start when it
        was just placed here, else after what earlier reads read (all of that was handed to
        the engines, so an item still missing was stored after it)."""
        cid = call.cid
        # abort and fin too: a call that ended before we subscribed must not hold a slot forever
        filters = [subjects.consumed(cid, e) for e in edges] + [subjects.abort(cid), subjects.fin(cid)]
        try:
            if placed:
                await self._barrier(call)
            # aclosing: a read left early ends its consumer now, not when the generator is collected
            read = self.bus.read_stored(filters, after=call.read_to)
            async with contextlib.aclosing(read) as stored:
                async for subject, data, seq in stored:
                    if cid not in self.calls:
                        return
                    if subjects.parse(subject).kind in (subjects.ABORT, subjects.FIN):
                        await self._forget(cid)
                        return
                    await self._handle_data(subject, data, live=False)
                    call.read_to = seq
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("catch-up read for %s failed", cid)

    async def _barrier(self, call: _Assigned) -> None:
        """Store a Placed message (see wire.Placed): once it is stored, so is any input published
        before this worker's subscriptions. Where it cannot be, the read goes on, and the gap
        and stall reads cover what it misses."""
        placed = wire.Placed(worker_id=self.worker_id, partitions=list(call.partitions))
        try:
            await self.bus.store(subjects.placed(call.cid, self.worker_id), wire.encode(placed))
        except Exception as e:
            log.warning("call %s: the barrier before its catch-up read was not stored (%r)", call.cid, e)

    async def _on_stats(self, msg: BusMsg) -> None:
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
            "store_retries": self.ends.retries,
            "partitions": parts,
            "data_path_ms": {"n": lat.count, "p50": lat.percentile(50), "p99": lat.percentile(99)},
        }
        if msg.data == b"reset":
            lat.clear()
            for r in self.runners.values():
                r.engine.stats.batch_sizes.clear()
        if msg.reply:
            await msg.respond(json.dumps(body).encode())

    # -- data ----------------------------------------------------------------
    def _on_data(self, m: BusMsg) -> None:
        """Straight from the read loop (BusConnection.subscribe_direct): most items only go into a
        stream buffer and wake the step loop, with no task in between."""
        if self.bus.is_stored(m):
            self.tasks.spawn(self._handle_stored(m))
            return
        actions, partition = self._take(m.subject, m.data, live=True)
        if actions:
            self.tasks.spawn(self._carry_out(actions, partition))

    async def _handle_stored(self, m: BusMsg) -> None:
        await self._handle_data(m.subject, await self.bus.body(m), live=True)

    async def _handle_data(self, subject: str, data: bytes, live: bool) -> None:
        await self._carry_out(*self._take(subject, data, live))

    def _take(self, subject: str, data: bytes, live: bool) -> tuple[list[eng.Action], str]:
        """Hand one item or end of stream to its engine: (actions to carry out, partition)."""
        try:
            s = subjects.parse(subject)
            msg = wire.decode(data)
        except (ValueError, DuplexError):
            log.warning("dropping undecodable message on %s", subject)
            return [], ""
        if s.edge is None or s.edge not in self.consumer_of:
            return [], ""
        r = self.runners[self.consumer_of[s.edge]]
        if live and (call := self.calls.get(s.cid)) is not None:
            call.last_input, call.stall_s = time.monotonic(), STALL_S
        if isinstance(msg, wire.InputItem | wire.EdgeItemMsg):
            if live and isinstance(msg, wire.InputItem) and msg.sent_ns:
                self.data_path_ms.add((time.time_ns() - msg.sent_ns) / 1e6)
            actions = r.engine.push(s.cid, s.edge, msg.seq, msg.item.to_item())
        elif isinstance(msg, wire.EndOfInput | wire.EdgeEnd):
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
        for p in call.partitions:
            r = self.runners[p]
            async with r.lock:
                r.engine.drop_call(cid)
        self._unsubscribe_later(call)

    def _unsubscribe_later(self, call: _Assigned) -> None:
        """In a task of its own: this often runs inside one of the call's own subscription
        callbacks, and nats-py cancels a subscription's callback when it unsubscribes."""
        self.tasks.spawn(self._unsubscribe(call))

    async def _unsubscribe(self, call: _Assigned) -> None:
        if call.catchup is not None and not call.catchup.done() and call.catchup is not asyncio.current_task():
            call.catchup.cancel()
        subs, call.subs = call.subs, []
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
            if r.blocking:
                emissions = await asyncio.to_thread(r.engine.partition.step, batch)
            else:
                emissions = r.engine.partition.step(batch)
            return r.engine.complete(batch, emissions)
        except Exception as e:  # a model bug fails the batch's calls, not the process (I-4)
            log.exception("step of %s failed", name)
            err = WorkerFailed(f"partition {name} failed: {e}")
            return [a for s in batch for a in r.engine.fail_call(s.cid, err)]

    async def _carry_out(self, actions: list[eng.Action], partition: str) -> None:
        for a in actions:
            if isinstance(a, eng.PublishOutput):
                body = wire.encode(wire.OutputMsg(partition=partition, seq=a.seq, json=msgspec.json.encode(a.data)))
                await self.bus.publish(subjects.out(a.cid), body)
            elif isinstance(a, eng.PublishEdgeItem):
                body = wire.encode(wire.EdgeItemMsg(seq=a.seq, item=wire.WireItem.from_item(a.item)))
                await self.bus.publish(subjects.edge(a.cid, a.edge), body)  # stored for replay and recovery
                if (r := self._local_consumer(a.cid, a.edge)) is not None:
                    r.wake.set()
                    await self._carry_out(r.engine.push(a.cid, a.edge, a.seq, a.item), r.engine.name)
            elif isinstance(a, eng.PublishEdgeEnd):
                # Stored behind (self.ends): the step loop does not wait for the ack.
                self.ends.put(subjects.edge_end(a.cid, a.edge), wire.encode(wire.EdgeEnd(total=a.total)))
                if (r := self._local_consumer(a.cid, a.edge)) is not None:
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
            self._unsubscribe_later(call)
