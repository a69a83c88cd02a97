"""The worker's intake: per-call subscriptions and catch-up reads in, items to the engines.

For each assigned call it subscribes (core NATS) to the call's input subjects of its
partitions here, then reads whatever the stream already holds for them (input that arrived
before placement, I-2; or everything, when it replaces a lost worker). Items are numbered,
so the overlap of the two is deduplicated by the stream buffers. When to read the stream,
and from where, is `repair.InputReads`' to decide, and how much input a call and the worker
may hold, `flow.Bounds`' (both pure); this shell carries the reads out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.worker import engine as eng
from services.worker.calls import AssignedCall, CarryOut, Context, Freed, Runner, Took
from services.worker.flow import Bounds
from services.worker.repair import Gaps, InputReads, Next, StartRead, Unit, Why
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg
from shared.runtime.errors import BusError, DuplexError, WorkerFailed
from shared.runtime.process import TaskSet
from shared.runtime.stats import Reservoir
from shared.sdk.chunking import Item
from shared.sdk.topology import CLIENT, PartitionTopology

log = logging.getLogger(__name__)

READ_BATCH = 64  # messages a read fetches at once: what one that stops for want of room has fetched in vain


class Intake:
    """Owns the assigned calls (`calls`), their subscriptions and reads, and the side tasks
    that carry them out; `run()` is the repair loop, `close()` cancels and awaits the rest."""

    def __init__(
        self,
        ctx: Context,
        topology: PartitionTopology,
        bounds: Bounds,
        carry_out: CarryOut,
    ) -> None:
        self.ctx = ctx
        self._engines = tuple(r.engine for r in ctx.runners.values())
        # which partition consumes each edge this worker reads
        self.consumer_of = {c.edge_name: c.to_partition for c in topology.connections if c.to_partition in ctx.runners}
        self.producer_of = {c.edge_name: c.from_partition for c in topology.connections}
        self.bounds = bounds  # flow control
        self._carry_out = carry_out
        self.calls: dict[str, AssignedCall] = {}
        # when a call's input is read from the stream (repair policy)
        self.reads = InputReads(produced_by=self.producer_of)
        self.freed = Freed()  # a step or a dropped call freed held input
        self.tasks = TaskSet()
        self.repairs = 0  # catch-up reads started for items lost in transit
        self.pauses = 0  # calls whose live input was left in the stream for want of room
        self.data_path_ms = Reservoir()  # publish by the frontend -> here, for live (not catch-up) items

    async def close(self) -> None:
        await self.tasks.close()

    # -- placement -----------------------------------------------------------
    async def start(self) -> None:
        """Every call's abort and fin, on two subscriptions for the worker's life rather than
        two per call: in an open storm those were made and dropped by the hundred (each one
        a SUB and an UNSUB, and nats-py's subscription object). Each worker so receives every
        call's ends (one or two small messages a call), and drops those of calls not here.
        One that came before the call was taken here was stored before its barrier: the read
        at placement finds it (its filters hold the abort and fin)."""
        await self.ctx.bus.subscribe_direct(subjects.abort("*"), self._on_end)
        await self.ctx.bus.subscribe_direct(subjects.fin("*"), self._on_end)

    def open(self, cid: str) -> AssignedCall:
        """The call's record here (its ends come on the subscriptions `start` made)."""
        call = self.calls[cid] = AssignedCall(cid, [])
        return call

    async def placed(self, call: AssignedCall, mine: list[str]) -> None:
        """The call's partitions `mine` were added to their engines: take their input, live and
        from the stream."""
        call.partitions += mine
        await self._subscribe_inputs(call, mine)
        # No flush (a round trip) here: assignments are handled one at a time, and the catch-up
        # reads' barrier is published on this connection after these subscriptions, so the
        # server has them in place before it stores the barrier. One barrier serves them all.
        now = time.monotonic()
        floor = call.read_after  # nothing of the call is stored at or before it
        reads = [self.reads.subscribed(call.cid, p, self.ctx.runners[p].engine.input_edges(), now, floor) for p in mine]
        barrier = self.tasks.spawn(self._barrier(call)) if any(r is not None and r.from_start for r in reads) else None
        for read in reads:
            self._start_read(read, barrier)
        for p in mine:
            self.ctx.runners[p].wake.set()

    async def run(self) -> None:
        """An item can go missing in transit (published while a subscription was being set up,
        or during a reconnect), and a stream buffer then waits on it forever; a lost end leaves
        no gap but stalls the call. InputReads says which calls to read again from the stream."""
        while True:
            await asyncio.sleep(self.reads.period_s)
            missing: dict[Unit, Gaps] = {
                (cid, p): gaps for p, r in self.ctx.runners.items() for cid, gaps in r.engine.missing().items()
            }
            awaiting = [(cid, p) for p, r in self.ctx.runners.items() for cid in r.engine.awaiting_input()]
            for read in self.reads.tick(time.monotonic(), missing, awaiting):
                self._start_read(read)

    async def reconnected(self) -> None:
        """While disconnected the core subscriptions missed whatever was published: read every
        call's input again from the stream (duplicates are dropped by seq)."""
        log.warning("reconnected to NATS: reading %d calls' input from the stream", len(self.calls))
        for read in self.reads.reconnected():
            self._start_read(read)

    async def _subscribe_inputs(self, call: AssignedCall, partitions: list[str]) -> None:
        """Live input of the partitions' edges that have no subscription yet."""
        for e in [e for p in partitions for e in self.ctx.runners[p].engine.input_edges()]:
            if e in call.inputs or self.producer_of.get(e) in call.partitions:
                continue  # subscribed, or produced in this process: handed over directly (local_consumer)
            call.inputs[e] = await self.ctx.bus.subscribe_direct(subjects.consumed(call.cid, e), self._on_data)

    # -- flow control ----------------------------------------------------------
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
            subs = [call.inputs.pop(e) for e in self.ctx.runners[partition].engine.input_edges() if e in call.inputs]
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
            await self.freed.wait(0.5)
        return False

    # -- catch-up reads --------------------------------------------------------
    def _start_read(self, read: StartRead | None, barrier: asyncio.Task[int | None] | None = None) -> None:
        """Carry out InputReads' decision (`barrier`: the placement barrier it shares with the
        reads of the call's other partitions placed with it)."""
        if read is None:
            return
        call = self.calls.get(read.cid)
        if call is None:
            self.reads.forget(read.cid)
            return
        self.ctx.metrics.catch_up_reads.labels(read.why.value).inc()
        if read.why is Why.GAP:
            log.warning("call %s, %s: %s, reading them from the stream", read.cid, read.partition, read.detail)
            self.repairs += 1
        elif read.why is Why.STALL:  # a client that is quiet is no news: DEBUG, not INFO
            log.debug("call %s, %s: %s, reading its input from the stream", read.cid, read.partition, read.detail)
        running = call.catchups.get(read.partition)
        if running is not None and not running.done():
            running.cancel()  # ended as far as InputReads knows (it starts one read at a time)
        call.catchups[read.partition] = self.tasks.spawn(self._catch_up(call, read, barrier))

    async def _catch_up(self, call: AssignedCall, r: StartRead, barrier: asyncio.Task[int | None] | None) -> None:
        """Carry out a read InputReads started (from the start behind a barrier, or on from where
        reads reached), at the worker's pace: without room for the next item it stops, the
        partition is paused, and it reads on once there is room. A paused partition read to
        the end takes live input again behind a barrier and is read on (repair.Next.RESUME).

        A read from the start reads up to its barrier: whatever came after it came live (the
        subscriptions were made before it), and a read with that bound needs no consumer on
        a stream one server holds (BusConnection.read_stored). A gap, stall or reconnect read
        there has a barrier of its own: what it looks for was published before the read began,
        so it is stored before that barrier, and an open storm's overload no longer makes a
        consumer per late item (6,600 gap reads in one worker, up to 965 consumers at once,
        before the stream's head cut: docs/performance.md). Once the partition is paused (its
        live input left in the stream) its reads go on to the stream's end."""
        cid, engine = call.cid, self.ctx.runners[r.partition].engine
        upto: int | None = None
        try:
            if r.from_start:
                upto = await (asyncio.shield(barrier) if barrier is not None else self._barrier(call))
            elif r.why is not Why.PAUSED and self.ctx.bus.reads_direct:
                upto = await self._barrier(call)
            while await self._room(cid, engine):
                ended = await self._read_on(call, r, upto)
                if ended is None:
                    return
                if not ended:
                    self._pause(cid, r.partition)
                    upto = None
                    continue
                if self.reads.at_end(cid, r.partition, r.read_id) is Next.DONE or not await self._room(cid, engine):
                    return
                upto = None
                await self._subscribe_inputs(call, [r.partition])
                self.reads.resumed(cid, r.partition, time.monotonic())
                await self._barrier(call)  # what was left in the stream before the subscriptions is stored before it
        except BusError as e:  # the gap and stall reads try again; a bug ends the task, and TaskSet logs it
            log.warning("catch-up read for %s, %s failed: %s", cid, r.partition, e)
        finally:
            self.reads.read_ended(cid, r.partition, r.read_id)

    async def _read_on(self, call: AssignedCall, r: StartRead, upto: int | None = None) -> bool | None:
        """Read the partition's input subjects from where its reads reached (up to stream
        sequence `upto` where given): True once read to the end, False where it stopped for
        want of room, None where the call ended."""
        cid = call.cid
        # abort and fin too: a call that ended before we subscribed must not hold a slot forever.
        # Each edge's two subjects by name, not consumed()'s wildcard: a direct get on a wildcard
        # filter costs the server about 1 ms, on a subject it names 30 to 60 us.
        filters = [s for e in r.edges for s in self._consumed(cid, e)] + [subjects.abort(cid), subjects.fin(cid)]
        # aclosing: a read left early ends its consumer now, not when the generator is collected
        read = self.ctx.bus.read_stored(filters, after=self.reads.read_to(cid, r.partition), batch=READ_BATCH, upto=upto)
        async with contextlib.aclosing(read) as stored:
            async for subject, data, seq in stored:
                if cid not in self.calls:
                    return None
                if subjects.parse(subject).kind in (subjects.ABORT, subjects.FIN):
                    await self.forget(cid)
                    return None
                took = self._take(subject, data, live=False)
                if took is None:
                    return False
                await self._carry_out(*took)
                self.reads.read_progress(cid, r.partition, r.read_id, seq)
        return True

    def _consumed(self, cid: str, edge: str) -> tuple[str, str]:
        """The subjects of an edge's items and end (subjects.consumed's two, by name)."""
        if self.producer_of.get(edge, CLIENT) == CLIENT:
            return subjects.input_(cid, edge), subjects.eoi(cid, edge)
        return subjects.edge(cid, edge), subjects.edge_end(cid, edge)

    async def _barrier(self, call: AssignedCall) -> int | None:
        """Store a Placed message (see wire.Placed): once it is stored, so is any input published
        before this worker's subscriptions (at placement), or before a read began (a gap,
        stall or reconnect read). Its stream sequence, or None where it cannot be stored: the
        read then goes on to the stream's end, and the gap and stall reads cover what it
        misses."""
        placed = wire.Placed(worker_id=self.ctx.worker_id, partitions=list(call.partitions))
        try:
            return await self.ctx.bus.store(subjects.placed(call.cid, self.ctx.worker_id), wire.encode(placed))
        except BusError as e:
            log.warning("call %s: the barrier before its catch-up read was not stored (%s)", call.cid, e)
            return None

    # -- live input ------------------------------------------------------------
    def _on_data(self, m: BusMsg) -> None:
        """Straight from the read loop (BusConnection.subscribe_direct): most items only go into a
        stream buffer and wake the step loop, with no task in between."""
        if self.ctx.bus.is_stored(m):
            self.tasks.spawn(self._handle_stored(m))
            return
        self._carry_out_later(m.subject, self._take(m.subject, m.data, live=True))

    async def _handle_stored(self, m: BusMsg) -> None:
        self._carry_out_later(m.subject, self._take(m.subject, await self.ctx.bus.body(m), live=True))

    def _carry_out_later(self, subject: str, took: Took | None) -> None:
        if took is None:  # no room for it: the partition's input waits in the stream
            s = subjects.parse(subject)
            assert s.edge is not None
            self._pause(s.cid, self.consumer_of[s.edge])
        elif took[0]:
            self.tasks.spawn(self._carry_out(*took))

    def _take(self, subject: str, data: bytes, live: bool) -> Took | None:
        """Hand one item or end of stream to its engine: (actions to carry out, partition), or
        None where there is no room for the item (flow.Bounds): it is left in the stream."""
        try:
            s = subjects.parse(subject)
        except (ValueError, DuplexError):
            log.warning("dropping a message on %s: not a call's subject", subject)
            return [], ""
        if s.edge is None or s.edge not in self.consumer_of:
            return [], ""
        partition = self.consumer_of[s.edge]
        if live and self.reads.paused(s.cid, partition):
            return [], ""  # left in the stream: the partition's read takes it
        try:
            msg = wire.decode(data)
            item = msg.item.to_item() if isinstance(msg, wire.InputItem | wire.EdgeItemMsg) else None
        except (ValueError, TypeError, DuplexError) as e:
            return self._unreadable(s.cid, s.edge, partition, e)
        r = self.ctx.runners[partition]
        if isinstance(msg, wire.InputItem | wire.EdgeItemMsg):
            assert item is not None
            if not self._may_take(s.cid, r.engine, live) and r.engine.wants_item(s.cid, s.edge, msg.seq):
                return None  # (a repeat is let through: it holds nothing)
            if live:
                self.reads.live_input(s.cid, partition, time.monotonic())
                if isinstance(msg, wire.InputItem) and msg.sent_ns:
                    self.data_path_ms.add((time.time_ns() - msg.sent_ns) / 1e6)
            walk = msg.walk if isinstance(msg, wire.EdgeItemMsg) else ""
            actions = r.engine.push(s.cid, s.edge, msg.seq, item, walk)
        elif isinstance(msg, wire.EndOfInput | wire.EdgeEnd):
            if live:
                self.reads.live_input(s.cid, partition, time.monotonic())
            actions = r.engine.end(s.cid, s.edge, msg.total)
        else:
            return [], ""
        r.wake.set()
        return actions, r.engine.name

    def _unreadable(self, cid: str, edge: str, partition: str, error: Exception) -> Took:
        """A message on a call's input that cannot be read (a writer of another version, or
        one that is not duplexbus). It stays in the stream, so every gap and stall read would
        find it again and the call would wait on it for ever: a call running here fails
        instead, at once. For a call not here it is only dropped."""
        if cid not in self.calls:
            log.warning("dropping an unreadable message of call %s on %r: %s", cid, edge, error)
            return [], ""
        log.error("call %s: a message on %r cannot be read (%s): the call fails", cid, edge, error)
        return [eng.FailCall(cid, WorkerFailed(f"partition {partition} could not read its input {edge!r}"))], partition

    # -- edges within this process ------------------------------------------------
    def local_consumer(self, cid: str, edge: str) -> Runner | None:
        """The runner of the edge's consumer partition where it runs the call in this process:
        an edge item (or end) is then handed to it at once instead of through the bus, which
        it also went to (so a replay, or a worker that takes over, reads it from the stream)."""
        consumer = self.consumer_of.get(edge)
        call = self.calls.get(cid)
        if consumer is None or call is None or consumer not in call.partitions:
            return None
        return self.ctx.runners[consumer]

    def hand_over_item(self, cid: str, edge: str, seq: int, item: Item, walk: str = "") -> Took | None:
        """An edge item a partition here produced (with the consumer's walk for it), to its
        consumer here (None: none here, or it waits in the stream, as live input does without room)."""
        if (r := self.local_consumer(cid, edge)) is None:
            return None
        if self.reads.paused(cid, r.engine.name):
            return None  # its read takes the item from the stream
        if not self._may_take(cid, r.engine, live=True) and r.engine.wants_item(cid, edge, seq):
            self._pause(cid, r.engine.name)  # as for live input: it waits in the stream
            return None
        self.reads.live_input(cid, r.engine.name, time.monotonic())
        r.wake.set()
        return r.engine.push(cid, edge, seq, item, walk), r.engine.name

    def hand_over_end(self, cid: str, edge: str, total: int) -> Took | None:
        """An edge's end, to its consumer here (paused too: an end holds nothing)."""
        if (r := self.local_consumer(cid, edge)) is None:
            return None
        self.reads.live_input(cid, r.engine.name, time.monotonic())
        r.wake.set()
        return r.engine.end(cid, edge, total), r.engine.name

    # -- calls ending --------------------------------------------------------------
    def _on_end(self, m: BusMsg) -> None:
        """A call was aborted or finished elsewhere: forget it if it is here (from the read
        loop, so only a call held here costs a task)."""
        try:
            cid = subjects.parse(m.subject).cid
        except ValueError:
            return
        if cid in self.calls:
            self.tasks.spawn(self.forget(cid))

    async def forget(self, cid: str) -> None:
        call = self.calls.pop(cid, None)
        if call is None:
            return
        self.reads.forget(cid)
        for p in call.partitions:
            r = self.ctx.runners[p]
            async with r.lock:
                r.engine.drop_call(cid)
        self.freed.fire()
        self._unsubscribe_later(call)

    async def partition_finished(self, cid: str, partition: str) -> None:
        """A partition's done is stored: the call is let go once none of its partitions here
        runs it."""
        call = self.calls.get(cid)
        if call is None:
            return
        if all(cid not in self.ctx.runners[p].engine for p in call.partitions):
            self.calls.pop(cid, None)
            self.reads.forget(cid)
            self._unsubscribe_later(call)

    def _unsubscribe_later(self, call: AssignedCall) -> None:
        """In a task of its own: this often runs inside one of the call's own subscription
        callbacks, and nats-py cancels a subscription's callback when it unsubscribes."""
        self.tasks.spawn(self._unsubscribe(call))

    async def _unsubscribe(self, call: AssignedCall) -> None:
        for task in call.catchups.values():
            if not task.done() and task is not asyncio.current_task():
                task.cancel()
        subs = list(call.inputs.values())
        call.inputs.clear()
        await BusConnection.unsubscribe_all(subs)
