"""The frontend's bus side: publishes call input, relays outputs, ends calls.

Clients reach it through `app.py`. Each call's server -> client messages go to its
connection's `Outbox` (bounded). What is logic and needs no bus is in pure pieces: the
input side in `calls.CallInput`, the output side in `relay.OutputRelay`; this module keeps
the calls and does their bus I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from models.registry import get_model, served_model
from services.frontend.calls import CallInput, InputState, Prepared
from services.frontend.outbox import Reply
from services.frontend.pressure import BusPressure
from services.frontend.protocol import Append, EndInput, Opening
from services.frontend.relay import OutputRelay
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg, BusSubscription
from shared.bus.kv import Bucket
from shared.bus.life import SignsOfLife
from shared.bus.readiness import Readiness
from shared.runtime.config import ServingConfig
from shared.runtime.errors import (
    BusError,
    CallTimeout,
    Conflict,
    DuplexError,
    KeyTaken,
    Overloaded,
    ProtocolError,
)
from shared.runtime.metrics import FrontendMetrics
from shared.runtime.process import TaskSet, TimeSlice, event, every
from shared.sdk.model import Model

log = logging.getLogger(__name__)

# A call's open and its ends of input are stored with an ack; an ack that a server slow under
# load does not send in JetStream's 5 s is asked for again (the stream drops the repeat) for
# this long before the call fails with 503 (once: twenty 3-minute uploads at once on 2 cores).
STORE_PATIENCE_S = 30.0
LOOP_PROBE_S = 0.1  # the loop's timer lag is measured this often
PROBE_EVERY_S = 0.25  # the bus connection's round trip measured this often (pressure.py)
PROBE_TIMEOUT_S = 10.0

# A stop's bounds past the drain (the whole stop: process.stop_bound_s, server.FrontendServer):
ABORTS_S = 3.0  # the aborts of the calls still live, published at once, all within this
LEAVE_S = 3.0  # then the heartbeat key's delete and the bus's close


class Sink(Protocol):
    """Takes a call's server -> client messages; never blocks (`outbox.Outbox`)."""

    def send(self, msg: Reply) -> None: ...
    def has_room(self) -> bool: ...  # False: outputs wait in the stream until `when_room` calls back
    def when_room(self, key: str, then: Callable[[], None]) -> None: ...


@dataclass(eq=False)  # a call is itself, whatever its fields: its owner keeps it in a set
class RelayedCall:
    cid: str
    request_id: str | None
    input: CallInput
    sink: Sink
    live: bool
    request_id_revision: int = 0  # the KV revision that reserved request_id (0: none)
    subs: list[BusSubscription] = field(default_factory=list)
    relay: OutputRelay = field(default_factory=OutputRelay)
    recovering: bool = False  # a read of the call's outputs from the stream is under way
    fin: wire.Fin | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    on_end: Callable[[RelayedCall], None] | None = None  # whoever opened it forgets it (a socket)
    opened: float = field(default_factory=time.monotonic)

    _output_prefix: bytes | None = None

    def reply(self, body: dict[str, Any]) -> None:
        self.sink.send({"request_id": self.request_id, **body})

    def relay_output(self, event_json: bytes) -> None:
        """`{"request_id": ..., "output": EVENT}` spliced as JSON text: the event is never decoded here."""
        if self._output_prefix is None:
            self._output_prefix = b'{"request_id":' + msgspec.json.encode(self.request_id) + b',"output":'
        self.sink.send(b"".join((self._output_prefix, event_json, b"}")))


class FrontendService:
    def __init__(self, config: ServingConfig, frontend_id: str | None = None) -> None:
        self.config = config
        self.frontend_id = frontend_id or subjects.new_process_id("frontend")
        self.calls: dict[str, RelayedCall] = {}  # cid -> call
        self._bus: BusConnection | None = None
        self.ready = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self.tasks = TaskSet()  # heartbeat, timeouts, unsubscribing, output recovery, finishes, aborts
        self._limits: dict[str, dict[str, int | None]] = {}
        self.default_model = config.model
        self.metrics = FrontendMetrics()
        self.readiness = Readiness(config.heartbeat_s)
        self.pressure = BusPressure()  # client input waits while the bus connection is backed up
        self._taking = asyncio.Event()
        self._taking.set()
        # Publishing gives the loop back every few ms, one slice for every call (a one-shot's
        # thousands of items), so the hot path makes no object per append.
        self._turn = TimeSlice()
        self.metrics.live_calls.set_function(lambda: len(self.calls))
        # Load the served model and check the config's client_streams against it now, so a
        # bad name or bound stops the process at start-up with an error naming the key.
        served_model(self.default_model)
        self.model(self.default_model)

    @property
    def bus(self) -> BusConnection:
        if self._bus is None:
            raise RuntimeError("the frontend has not started")
        return self._bus

    @property
    def rids(self) -> Bucket:
        return self.bus.kv[subjects.KV_REQUEST_IDS]

    @property
    def frontends(self) -> Bucket:
        return self.bus.kv[subjects.KV_FRONTENDS]

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Returns at once: the bus connection is made in a task of its own, and the frontend
        is ready (healthz 200, calls taken) once it is and a conductor exists. So the HTTP
        server answers (503, "starting") while NATS is out of reach, and a stop signal in that
        time stops it rather than waiting on the connect."""
        self.tasks.spawn(self._connect())
        self.tasks.spawn(self.readiness.run())

    async def _connect(self) -> None:
        try:
            self._bus = await BusConnection.open(
                self.config,
                f"duplexbus-{self.frontend_id}",
                buckets=[subjects.KV_REQUEST_IDS, subjects.KV_FRONTENDS],
                reconnected=self._on_reconnect,
            )
        except BusError as e:  # refused (credentials, permissions): it stays not ready, and says why
            log.error("frontend %s cannot use the bus: %s", self.frontend_id, e)
            raise
        self.readiness.conn = self._bus
        hb = wire.encode(wire.FrontendHeartbeat(frontend_id=self.frontend_id, ts=0.0))
        self.life = SignsOfLife(self.config, subjects.KV_FRONTENDS, self.frontend_id, lambda: hb, self.config.heartbeat_s)
        self.tasks.spawn(self.life.run())
        self.tasks.spawn(every(0.25, self._check_timeouts, "timeouts"))
        self.tasks.spawn(self._probe_bus())
        self.tasks.spawn(self._time_loop())
        await self._wait_for_conductor()

    async def _wait_for_conductor(self) -> None:
        """Opens are only published once the conductor's durable consumer exists (it starts at
        NEW). A bus failure that waiting will not mend (permissions) stops the wait loudly."""
        complained = False
        while True:
            try:
                if await self.bus.has_consumer(subjects.CONDUCTOR_DURABLE):
                    self.ready.set()
                    log.info("frontend %s ready", self.frontend_id)
                    return
            except BusError as e:
                if not e.recoverable:
                    log.error("frontend %s cannot start serving: %s", self.frontend_id, e)
                    raise
                if not complained:
                    log.warning("waiting for the conductor: %s", e)
                    complained = True
            await asyncio.sleep(0.2)

    @property
    def stopping(self) -> bool:
        return self._drain_task is not None

    def drain(self) -> asyncio.Task[None]:
        """Stop intake and let live calls end, for at most `shutdown_drain_s`; then end the
        rest with 503 (told to their clients). One drain however often it is asked for: the
        WebSocket connections ask when the server starts to stop, the lifespan at the end."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return self._drain_task

    async def _drain(self) -> None:
        self.ready.clear()
        deadline = time.monotonic() + self.config.shutdown_drain_s
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.calls:
            log.warning("ending %d calls still live after %.0f s of draining", len(self.calls), self.config.shutdown_drain_s)
            await self._abort_all("the frontend is stopping", 503)

    async def _abort_all(self, reason: str, status: int) -> None:
        """Abort every live call at once, within ABORTS_S in all: with NATS out of reach each
        abort's round trips wait for their timeouts (seconds each), and one after another
        they would hold the stop for seconds per call. A call whose abort is cut short is told
        all the same; its abort is lost (the conductor ends it when this frontend is lost)."""
        calls = list(self.calls.values())
        aborts = [asyncio.ensure_future(self.abort(c, reason, status, tell_client=True)) for c in calls]
        try:
            _, late = await asyncio.wait(aborts, timeout=ABORTS_S)
        finally:
            for t in aborts:
                t.cancel()
            results = await asyncio.gather(*aborts, return_exceptions=True)
        for call in calls:
            if not call.ended.is_set():  # cut short before it told its client
                self.calls.pop(call.cid, None)
                self._let_go(call, {"error": reason, "status": status})
        for r in results:
            if isinstance(r, Exception):
                log.error("aborting a call on stopping failed: %r", r)
        if late:
            log.error(
                "%d of %d calls' aborts were not published within %.0f s (NATS out of reach?); they were ended here",
                len(late),
                len(calls),
                ABORTS_S,
            )

    async def close(self) -> None:
        """Stop intake, drain, then stop the side tasks and leave the bus (within LEAVE_S:
        what is not done by then the bus does without, the heartbeat key by its TTL)."""
        await self.drain()
        await self.tasks.close()
        if self._bus is not None:
            try:
                await asyncio.wait_for(self._leave(self._bus), LEAVE_S)
            except TimeoutError:
                log.warning("leaving the bus took more than %.0f s (NATS out of reach?): stopping without", LEAVE_S)

    async def _leave(self, bus: BusConnection) -> None:
        await self.frontends.delete_if_there(self.frontend_id)
        await bus.close()

    def model(self, name: str | None) -> Model:
        name = name or self.default_model
        m = get_model(name)
        if name not in self._limits:
            # Only the served model's limits come from the config's client_streams.
            self._limits[name] = (
                m.topology.stream_limits(self.config.max_items_overrides)
                if name == self.default_model
                else {e: c.limits.max_items if c.limits else None for e, c in m.topology.client_edges().items()}
            )
        return m

    def stream_limits(self, name: str) -> dict[str, int | None]:
        """max_items per client stream of model `name`, as calls of it are bounded."""
        self.model(name)
        return self._limits[name]

    # -- calls -----------------------------------------------------------------
    async def open_call(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None = None) -> RelayedCall:
        """Open a call whose messages go to `sink`; `on_end` runs once when it ends, after its
        last message went to the sink."""
        try:
            call = await self._open_call(o, sink, on_end)
        except DuplexError as e:
            if e.status in (409, 503):  # taken, or no room: refused admission (a 400 is the client's)
                self.metrics.refusals.labels(str(e.status)).inc()
            raise
        event(log, "call opened", cid=call.cid, request_id=call.request_id, model=call.input.model.name, live=call.live)
        return call

    async def _open_call(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None) -> RelayedCall:
        if not self.ready.is_set():
            raise Overloaded("the frontend is stopping" if self.stopping else "the frontend is starting (no conductor yet)")
        model_name = o.model or self.default_model
        model = self.model(model_name)
        now = time.monotonic()
        inp = CallInput(model, self._limits[model_name], self.config.max_call_input_bytes, now)
        prepared = inp.accept(o.input, opening=True, end=o.end_input, now=now)
        # A live call leaves a client stream open; one that ends them all is a one-shot (may queue).
        live = inp.state is InputState.OPEN
        if live and o.request_id is None:
            raise ProtocolError("a live call (one that leaves a client stream open) needs a request_id")
        cid = subjects.new_cid()
        revision = 0
        if o.request_id is not None:
            try:
                revision = await self.rids.create(o.request_id, cid.encode())
            except KeyTaken:
                raise Conflict(f"request_id {o.request_id!r} is already in use by a live call") from None
        call = RelayedCall(cid, o.request_id, inp, sink, live, revision, on_end=on_end)
        self.calls[cid] = call
        try:
            call.subs.append(await self.bus.subscribe_direct(subjects.out(cid), self._on_out))
            call.subs.append(await self.bus.subscribe_direct(subjects.fin(cid), self._on_fin))
            await self._publish_items(cid, prepared)
            await self.bus.store_once(
                subjects.open_(cid),
                wire.encode(
                    wire.Open(
                        cid=cid,
                        request_id=o.request_id or "",
                        model=model_name,
                        frontend_id=self.frontend_id,
                        model_kwargs=o.input.model_kwargs,
                        open_streams=sorted(inp.open_streams),
                        published=dict(inp.published),
                        live=live,
                        request_id_revision=revision,
                    )
                ),
                STORE_PATIENCE_S,
            )
            await self._publish_ends(cid, prepared)
        except BaseException:
            await self._cleanup(call)
            raise
        return call

    async def append(self, call: RelayedCall, a: Append) -> None:
        """An append; raises for a rejected append (the caller ends the call with its error)."""
        now = time.monotonic()
        prepared = call.input.accept(a.input, opening=False, end=a.end_input, now=now)
        await self._publish_items(call.cid, prepared)
        await self._publish_ends(call.cid, prepared)
        self._report_late(call, prepared)

    async def end_input(self, call: RelayedCall, e: EndInput) -> None:
        prepared = call.input.end_input(e.end_input, time.monotonic())
        await self._publish_items(call.cid, prepared)
        await self._publish_ends(call.cid, prepared)
        self._report_late(call, prepared)

    def _report_late(self, call: RelayedCall, p: Prepared) -> None:
        """The late-append reply: input for (or an end of) streams the client had already ended.
        Nothing of it was charged or sent; the call goes on."""
        late = sorted(set(p.late) | set(p.already_ended))
        if not late:
            return
        what = []
        if p.late:
            what.append(f"input routed to stream(s) {p.late} was neither charged nor sent")
        if p.already_ended:
            what.append(f"end_input named stream(s) {p.already_ended} again")
        error = f"stream(s) {late} already ended: " + "; ".join(what)
        call.reply({"append": True, "error": error, "status": 409, "late": late})

    async def _probe_bus(self) -> None:
        """Round trips on the bus connection, for `pressure.BusPressure` to judge: each 0.25 s
        while input is taken, back to back while it is held. An outage holds nothing (the
        connection's reconnect buffer and the calls' own timeouts see to that)."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            probe = loop.create_task(self.bus.round_trip(PROBE_TIMEOUT_S))
            try:
                if not (await asyncio.wait({probe}, timeout=self.pressure.slow_s))[0]:
                    self._take_input(self.pressure.observed(None, loop.time()))
                await probe
                self._take_input(self.pressure.observed(loop.time() - t0, loop.time()))
            except BusError as e:
                log.debug("bus probe: %s", e)
                self._take_input(True)
            finally:
                probe.cancel()
            if self.pressure.taking:
                await asyncio.sleep(PROBE_EVERY_S)

    async def _time_loop(self) -> None:
        """How late the event loop runs a timer (`duplexbus_frontend_loop_lag_seconds`): work
        that holds the loop (TimeSlice) shows here before calls fail for it."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_PROBE_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - t0 - LOOP_PROBE_S))

    def _take_input(self, taking: bool) -> None:
        if taking == self._taking.is_set():
            return
        if taking:
            self._taking.set()
            log.debug("the bus caught up: taking client input again")
        else:
            self._taking.clear()
            self.metrics.input_holds.inc()
            log.debug("the bus connection is backed up: client input waits")

    async def _publish_items(self, cid: str, p: Prepared) -> None:
        self.metrics.appends.inc(len(p.items))
        for edge, seq, item in p.items:
            await self._turn.due()
            if not self._taking.is_set():
                await self._taking.wait()
            body = wire.encode(wire.InputItem(seq=seq, item=wire.WireItem.from_item(item), sent_ns=time.time_ns()))
            # Core publish: the stream stores it all the same, with no round trip per append.
            # No Nats-Msg-Id: consumers deduplicate items by seq, and the server's duplicate
            # window would track every item (measured: docs/performance.md).
            await self.bus.publish(subjects.input_(cid, edge), body)

    async def _publish_ends(self, cid: str, p: Prepared) -> None:
        for edge, total in p.ended.items():
            await self.bus.store_once(subjects.eoi(cid, edge), wire.encode(wire.EndOfInput(total=total)), STORE_PATIENCE_S)

    async def abort(self, call: RelayedCall, reason: str, status: int, tell_client: bool = False) -> None:
        """End a call from this side (socket closed, timeout, refused append)."""
        if call.cid not in self.calls:
            return
        self._ended(call, "aborted", status)
        await self._cleanup(call, {"error": reason, "status": status} if tell_client else None)
        try:
            await self.bus.store(subjects.abort(call.cid), wire.encode(wire.Abort(reason=reason, status=status)))
        except BusError as e:  # the workers then hold the call until its own timeouts end it
            log.error("call %s: its abort (%s) was not published: %s", call.cid, reason, e)

    def abort_soon(self, call: RelayedCall, reason: str, status: int) -> None:
        """`abort` in a task of the service's own, for a caller that may be cancelled at any
        await (a response Starlette cancels when its client leaves): an abort cut short would
        leave the call, queued or running, to the conductor."""
        if not call.ended.is_set():
            self.tasks.spawn(self.abort(call, reason, status))

    async def _cleanup(self, call: RelayedCall, reply: dict[str, Any] | None = None) -> None:
        """Forget the call, free its request_id, then send `reply` and tell its owner (so a
        client that reads the call's last message may reuse the request_id at once), then
        drop its subscriptions."""
        self.calls.pop(call.cid, None)
        call.input.close()
        if call.request_id is not None and self._bus is not None:
            await self.rids.release(call.request_id, call.cid.encode(), call.request_id_revision)
        self._let_go(call, reply)

    def _let_go(self, call: RelayedCall, reply: dict[str, Any] | None) -> None:
        """The rest of `_cleanup`, with no await: also for a call whose cleanup was cut short."""
        call.ended.set()
        # No await from here to the owner's forgetting it: the reply and the forgetting are
        # one step for whoever reads the sink.
        if reply is not None:
            call.reply(reply)
        if call.on_end is not None:
            call.on_end(call)
        subs, call.subs = call.subs, []
        # In a task of its own: unsubscribing from inside that subscription's callback (a fin
        # or the last output) would cancel the callback itself.
        self.tasks.spawn(BusConnection.unsubscribe_all(subs))

    # -- from the bus ----------------------------------------------------------
    def _on_out(self, m: BusMsg) -> None:
        """Straight from the read loop (BusConnection.subscribe_direct): an output goes to the socket
        with no task in between; only a large one (in the Object Store) needs one."""
        call = self.calls.get(subjects.parse(m.subject).cid)
        if call is None:
            return
        if call.relay.behind or not call.sink.has_room():
            self._fall_behind(call)  # the client is slower than its outputs: this one waits in the stream
        elif self.bus.is_stored(m):
            self.tasks.spawn(self._accept_stored_output(call, m))
        else:
            self._accept_output(call, m.data)

    async def _accept_stored_output(self, call: RelayedCall, m: BusMsg) -> None:
        self._accept_output(call, await self.bus.body(m))

    def _fall_behind(self, call: RelayedCall) -> None:
        """Live outputs are not taken until the client has room; then they are read from the
        stream (`_recover_outputs`), from where the relay is."""
        call.relay.fall_behind()
        call.sink.when_room(call.cid, lambda: self._recover_outputs(call))

    def _accept_output(self, call: RelayedCall, body: bytes) -> None:
        """Relay what the relay lets through now (`relay.OutputRelay`). The last output a fin
        counts finishes the call."""
        try:
            o = wire.decode_as(body, wire.OutputMsg)
        except DuplexError:
            return
        relayed = call.relay.accept(o.partition, o.seq, o.json, time.monotonic())
        for out in relayed:
            call.relay_output(out)
        if relayed and o.sent_ns:
            self.metrics.reply_lag.observe(max(0.0, (time.time_ns() - o.sent_ns) / 1e9))
        if call.fin is not None and call.relay.complete:
            self.tasks.spawn(self._finish(call))

    async def _on_reconnect(self) -> None:
        """Outputs and fins published while we were disconnected: read them from the stream."""
        log.warning("reconnected to NATS: recovering the outputs of %d calls", len(self.calls))
        for call in list(self.calls.values()):
            self._recover_outputs(call)

    def _recover_outputs(self, call: RelayedCall) -> None:
        """Outputs not relayed yet, lost in transit (a gap, or fewer than the fin counts) or
        not taken while the client had no room: every output is in the stream, so read the
        call's outputs from there and relay the missing ones, as long as the client has room.
        Each read starts where the last one ended: what was stored before that has been
        relayed (or held), so a missing output is stored later."""
        if call.recovering or call.cid not in self.calls:
            return
        call.recovering = True

        async def recover() -> None:
            stopped = False
            try:
                while call.cid in self.calls:
                    drops = call.relay.drops
                    if not await self._read_outputs(call):
                        stopped = True
                        return
                    call.relay.caught_up()
                    if call.relay.drops == drops:
                        return
                    # Live outputs were not taken during the read: those stored after its end
                    # are read now.
            except Exception:
                log.exception("recovering the outputs of %s failed", call.cid)
            finally:
                call.recovering = False
                if stopped:
                    self._fall_behind(call)  # read on once the client has room
                    if call.sink.has_room():  # it drained while the read was being closed
                        self._recover_outputs(call)

        self.tasks.spawn(recover())

    async def _read_outputs(self, call: RelayedCall) -> bool:
        """One read of the call's stored outputs and fin, from where the relay is; False where
        it stopped because the client had no room for more."""
        filters = [subjects.out(call.cid), subjects.fin(call.cid)]
        async with contextlib.aclosing(self.bus.read_stored(filters, after=call.relay.read_to)) as stored:
            async for subject, body, seq in stored:
                if subjects.parse(subject).kind == subjects.FIN:
                    call.relay.read(seq)
                    await self._accept_fin(call, body)
                elif not call.sink.has_room():
                    return False
                else:
                    call.relay.read(seq)
                    self._accept_output(call, body)
        return True

    def _on_fin(self, m: BusMsg) -> None:
        call = self.calls.get(subjects.parse(m.subject).cid)
        if call is not None:
            self.tasks.spawn(self._accept_fin(call, m.data))

    async def _accept_fin(self, call: RelayedCall, body: bytes) -> None:
        """A fin that counts outputs not relayed yet waits for them (`_check_timeouts` reads
        the stream for them, and gives up on them after a while)."""
        if call.fin is not None:
            return
        try:
            call.fin = wire.decode_as(body, wire.Fin)
        except DuplexError:
            return
        call.relay.fin(call.fin.outputs, time.monotonic())
        if call.fin.status != 200 or call.relay.complete:
            await self._finish(call)

    async def _finish(self, call: RelayedCall) -> None:
        if call.cid not in self.calls or call.fin is None:
            return
        fin = call.fin
        self._ended(call, "completed" if fin.status == 200 else "failed", fin.status)
        if fin.reason == "overloaded":  # refused by the conductor's admission
            self.metrics.refusals.labels(str(fin.status)).inc()
        if fin.status == 200:
            if not call.relay.complete:
                log.warning("call %s finished with outputs missing", call.cid)
            await self._cleanup(
                call,
                {
                    "finish": {
                        "reason": fin.reason,
                        "usage": fin.usage,
                        "usage_by_partition": fin.usage_by_partition,
                        "call_id": call.cid,
                    }
                },
            )
        else:
            await self._cleanup(call, {"error": fin.error or fin.reason, "status": fin.status})

    def _ended(self, call: RelayedCall, outcome: str, status: int) -> None:
        self.metrics.calls.labels(outcome, str(status)).inc()
        event(
            log,
            "call finished",
            cid=call.cid,
            request_id=call.request_id,
            model=call.input.model.name,
            outcome=outcome,
            status=status,
            duration_s=round(time.monotonic() - call.opened, 3),
            outputs=call.relay.relayed,
        )

    async def _check_timeouts(self) -> None:
        now = time.monotonic()
        limit = self.config.request_timeout_s
        for call in list(self.calls.values()):
            if call.relay.give_up_due(now, reading=call.recovering):
                await self._finish(call)
                continue
            if not call.recovering and call.relay.read_due(now, call.sink.has_room()):
                self._recover_outputs(call)
            if call.input.state is InputState.OPEN and call.input.idle_for(now) > limit:
                err = CallTimeout(f"no input for {limit:g}s (request_timeout_s)")
                await self.abort(call, err.message, err.status, tell_client=True)
