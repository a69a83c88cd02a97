"""The frontend's bus side: opens calls, ends them, and keeps them while they live.

Clients reach it through `app.py`. Each call's server -> client messages go to its
connection's `Outbox` (bounded). The work is split by job: `inputs.InputPublisher`
publishes a call's input, `outputs.Outputs` relays its outputs and fin, `probes` measure the
bus connection (holding client input while it is backed up) and the event loop. What is
logic and needs no bus is in pure pieces (`calls.CallInput`, `relay.OutputRelay`,
`pressure.BusPressure`). This module keeps the calls, their opening and ending, and the
service's lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from models.registry import get_model, served_model
from services.frontend import moves
from services.frontend.calls import CallInput, InputState, Prepared
from services.frontend.heartbeat import Beats
from services.frontend.inputs import InputPublisher
from services.frontend.outputs import Outputs
from services.frontend.probes import BusProbe, LoopLagProbe
from services.frontend.protocol import Append, EndInput, Opening
from services.frontend.relayed_call import RelayedCall, Sink
from services.frontend.socket_session import told
from shared.bus import subjects, wire
from shared.bus.connection import STORE_PATIENCE_S, BusConnection, BusSubscription
from shared.bus.kv import Bucket
from shared.bus.life import SignsOfLife
from shared.bus.readiness import Readiness
from shared.runtime.config import ServingConfig
from shared.runtime.errors import (
    BusError,
    BusUnavailable,
    CallTimeout,
    Conflict,
    DuplexError,
    KeyTaken,
    Overloaded,
    ProtocolError,
)
from shared.runtime.metrics import FrontendMetrics
from shared.runtime.process import TaskSet, event, every
from shared.runtime.retry import Backoff, Outage, retrying
from shared.sdk.model import Model

log = logging.getLogger(__name__)

# A stop's bounds past the drain (the whole stop: process.stop_bound_s, server.FrontendServer):
ABORTS_S = 3.0  # the aborts of the calls still live, published at once, all within this
LEAVE_S = 3.0  # then the heartbeat key's delete and the bus's close
CONDUCTOR_POLL_S = 0.2  # at start-up, how often the conductor's consumer is looked for
# A call let go to another frontend is listed in this one's heartbeats until the taker says
# its own heartbeat lists it; at most this long (a taker that died meanwhile: the conductor
# ends the call once neither lists it).
LEND_S = 10.0


class FrontendService:
    def __init__(self, config: ServingConfig, frontend_id: str | None = None) -> None:
        self.config = config
        self.frontend_id = frontend_id or subjects.new_process_id("frontend")
        self.calls: dict[str, RelayedCall] = {}  # cid -> call
        self.beats = Beats(self.frontend_id, self.calls)  # each heartbeat lists the calls held (reconciliation)
        self.life: SignsOfLife | None = None  # the heartbeats' connection, once connected
        self._bus: BusConnection | None = None
        self.ready = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        # Openings under way (past the readiness check, not yet in `calls`: the request_id's
        # round trip, the open's store): a drain waits for them as for the calls.
        self._opening = 0
        # Endings under way (out of `calls`, the request_id's release awaited, the reply not
        # yet sent): a drain that ended here would close the socket before the call's finish.
        self._ending = 0
        self.tasks = TaskSet()  # heartbeat, probes, timeouts, unsubscribing, aborts
        self._limits: dict[str, dict[str, int | None]] = {}
        self.default_model = config.model
        self.metrics = FrontendMetrics()
        self.readiness = Readiness(config.heartbeat_s)
        self.inputs = InputPublisher(lambda: self.bus, self.metrics)
        self.outputs = Outputs(self.calls, lambda: self.bus, self.metrics, self._end)
        # Client input waits while the bus connection is backed up.
        self.bus_probe = BusProbe(lambda: self.bus, self.inputs.take)
        self.loop_probe = LoopLagProbe(self.metrics.loop_lag.observe)
        self.metrics.live_calls.set_function(lambda: len(self.calls))
        # Load the served model and check the config's client_streams against it now, so a
        # bad name or bound stops the process at start-up with an error naming the key.
        self.served = served_model(self.default_model)
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
                reconnected=self.outputs.on_reconnect,
            )
        except BusError as e:  # refused (credentials, permissions): it stays not ready, and says why
            log.error("frontend %s cannot use the bus: %s", self.frontend_id, e)
            raise
        self.readiness.conn = self._bus
        self.life = SignsOfLife(self.config, subjects.KV_FRONTENDS, self.frontend_id, self.beats.next, self.config.heartbeat_s)
        self.tasks.spawn(self.life.run())
        self.tasks.spawn(every(0.25, self._check_timeouts, "timeouts"))
        self.tasks.spawn(self.bus_probe.run())
        self.tasks.spawn(self.loop_probe.run())
        await self._wait_for_conductor()

    async def _wait_for_conductor(self) -> None:
        """Opens are only published once the conductor's durable consumer exists (it starts at
        NEW). Its absence is polled quietly (a conductor starting beside the frontend is no
        fault); a bus failure is retried and logged once while it lasts (`retrying`), and one
        that waiting will not mend (permissions) stops the wait loudly."""
        outage = Outage("looking for the conductor's consumer", log)
        backoff = Backoff(CONDUCTOR_POLL_S, CONDUCTOR_POLL_S)
        try:
            while not await retrying(lambda: self.bus.has_consumer(subjects.CONDUCTOR_DURABLE), outage, backoff=backoff):
                await asyncio.sleep(CONDUCTOR_POLL_S)
        except BusError as e:
            log.error("frontend %s cannot start serving: %s", self.frontend_id, e)
            raise
        if self.stopping:  # stopped before it was ready: it stays not ready
            return
        with contextlib.suppress(BusError):  # its first calls then say where they start (wire.Open.read_after)
            await self.bus.note_tail()
        self.ready.set()
        log.info("frontend %s ready", self.frontend_id)

    @property
    def stopping(self) -> bool:
        return self._drain_task is not None

    def drain(self) -> asyncio.Task[None]:
        """Stop intake and let live calls end, for at most `shutdown_drain_s`; then end the
        rest with 503 (told to their clients). One drain however often it is asked for: the
        WebSocket connections ask when the server starts to stop, the lifespan at the end."""
        if self._drain_task is None:
            self.ready.clear()  # now, not a turn later: from here no opening passes the check
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return self._drain_task

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.shutdown_drain_s
        while (self.calls or self._opening or self._ending) and time.monotonic() < deadline:
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
        what is not done by then the bus does without, the heartbeat key by its TTL). The
        outputs' tasks first: a finish among them hands its unsubscribing to `tasks`."""
        await self.drain()
        await self.outputs.close()
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
        """The model a client asks for (None: the served one), its limits kept by its own name:
        the served model may be asked for by the name or path it was configured with, or by its name."""
        m = get_model(name or self.default_model)
        if m.name not in self._limits:
            # Only the served model's limits come from the config's client_streams.
            self._limits[m.name] = (
                m.topology.stream_limits(self.config.max_items_overrides)
                if m is self.served
                else {e: c.limits.max_items if c.limits else None for e, c in m.topology.client_edges().items()}
            )
        return m

    def stream_limits(self, name: str) -> dict[str, int | None]:
        """max_items per client stream of model `name`, as calls of it are bounded."""
        return self._limits[self.model(name).name]

    # -- calls -----------------------------------------------------------------
    async def open_call(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None = None) -> RelayedCall:
        """Open a call whose messages go to `sink`; `on_end` runs once when it ends, after its
        last message went to the sink."""
        try:
            call = await self._counted_opening(o, sink, on_end)
        except DuplexError as e:
            if e.status in (409, 503):  # taken, or no room: refused admission (a 400 is the client's)
                self.metrics.refusals.labels(str(e.status)).inc()
            raise
        event(log, "call opened", cid=call.cid, request_id=call.request_id, model=call.input.model.name, live=call.live)
        return call

    async def _counted_opening(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None) -> RelayedCall:
        """`_open_call`, counted from its readiness check on: a drain that starts while the
        request_id's round trip is under way would otherwise see no call, end at once, and
        close the socket (1012) under a call that then opens and streams."""
        if not self.ready.is_set():
            raise Overloaded("the frontend is stopping" if self.stopping else "the frontend is starting (no conductor yet)")
        self._opening += 1
        try:
            return await self._open_call(o, sink, on_end)
        finally:
            self._opening -= 1

    async def _open_call(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None) -> RelayedCall:
        model = self.model(o.model)
        model_name = model.name  # on the wire: the name workers heartbeat, however it was asked for
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
        call = RelayedCall(
            cid, o.request_id, inp, sink, live, revision, on_end=on_end, binary=o.binary, binary_fields=model.binary_fields
        )
        beat = self.beats.taken()  # with no await before the call is held: later heartbeats list it
        self.calls[cid] = call
        read_after = self.bus.stored_to()  # before the call's first message: all of it is stored after
        try:
            call.subs.append(await self.bus.subscribe_direct(subjects.out(cid), self.outputs.on_out))
            call.subs.append(await self.bus.subscribe_direct(subjects.fin(cid), self.outputs.on_fin))
            await self.inputs.items(cid, prepared)
        except BaseException:
            await self._cleanup(call)
            raise
        opened = wire.Open(
            cid=cid,
            request_id=o.request_id or "",
            model=model_name,
            frontend_id=self.frontend_id,
            model_kwargs=o.input.model_kwargs,
            open_streams=sorted(inp.open_streams),
            published=dict(inp.published),
            live=live,
            request_id_revision=revision,
            frontend_beat=beat,
            binary=o.binary,
            read_after=read_after,
        )
        if not live:
            try:
                await self._announce(cid, opened, prepared)
            except BaseException:
                await self._cleanup(call)
                raise
            return call
        # A live call's input flows from here on while its open is stored (a round trip that,
        # in an open storm, waits behind hundreds of others): its appends are in the stream
        # when a worker reads it at placement. Its ends of input wait for the open (inputs.py),
        # so the conductor reads the open first; an abort may come first, and wins there.
        call.announced = self.tasks.spawn(self._announce_aside(call, opened, prepared))
        return call

    async def _announce(self, cid: str, opened: wire.Open, prepared: Prepared) -> None:
        """Store the call's open, then its opening's ends of input."""
        await self.bus.store_once(subjects.open_(cid), wire.encode(opened), STORE_PATIENCE_S)
        await self.inputs.ends(cid, prepared)

    async def _announce_aside(self, call: RelayedCall, opened: wire.Open, prepared: Prepared) -> None:
        """`_announce` for a live call already held: where the open cannot be stored, the call
        ends with the error its opening would have had (told to its client, as a refusal of
        the conductor's is)."""
        try:
            await self._announce(call.cid, opened, prepared)
        except DuplexError as e:
            if call.cid in self.calls:
                await self._end(call, "error", e.status, {"error": told(e), "status": e.status})
            else:
                log.info("call %s: its open was not stored (%s); it had ended meanwhile", call.cid, e)

    async def append(self, call: RelayedCall, a: Append) -> None:
        """An append; raises for a rejected append (the caller ends the call with its error)."""
        await self.inputs.append(call, a)

    async def end_input(self, call: RelayedCall, e: EndInput) -> None:
        await self.inputs.end_input(call, e)

    async def abort(self, call: RelayedCall, reason: str, status: int, tell_client: bool = False) -> None:
        """End a call from this side (socket closed, timeout, refused append)."""
        if call.cid not in self.calls:
            return
        await self._end(call, "aborted", status, {"error": reason, "status": status} if tell_client else None)
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

    async def _end(self, call: RelayedCall, outcome: str, status: int, reply: dict[str, Any] | None) -> None:
        """Count and log the call's end, then `_cleanup` (an abort, or `outputs` on a fin)."""
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
        await self._cleanup(call, reply)

    async def _cleanup(self, call: RelayedCall, reply: dict[str, Any] | None = None) -> None:
        """Forget the call, free its request_id, then send `reply` and tell its owner (so a
        client that reads the call's last message may reuse the request_id at once), then
        drop its subscriptions."""
        self.calls.pop(call.cid, None)
        call.input.close()
        self._ending += 1
        try:
            if call.request_id is not None and self._bus is not None:
                await self.rids.release(call.request_id, call.cid.encode(), call.request_id_revision)
            self._let_go(call, reply)
        finally:
            self._ending -= 1

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

    # -- calls that move to another frontend (a realtime session resumed there) ----------
    async def hand_over(self, call: RelayedCall) -> None:
        """The call moves to another frontend: it is held here no more (its outputs are not
        relayed, its input is not published, its owner's `on_end` runs) but not ended: no
        abort, and its request_id stays reserved for the taker to free. Its cid stays in this
        frontend's heartbeats until the taker says its own list it (`subjects.realtime_taken`),
        for LEND_S at most: the conductor learns of the move from the taker's heartbeat, and
        must never read one of each that both leave the call out. (What the taker gets,
        `moves.hand_over`, the caller takes just before, with no await between.)"""
        if self.calls.pop(call.cid, None) is None:
            return
        self.beats.lend(call.cid)
        call.input.close()
        call.ended.set()
        if call.on_end is not None:
            call.on_end(call)
        subs, call.subs = call.subs, []
        self.tasks.spawn(BusConnection.unsubscribe_all(subs))
        taken: list[BusSubscription] = []

        def returned() -> None:
            timer.cancel()
            if self.beats.returned(call.cid):
                self.tasks.spawn(BusConnection.unsubscribe_all(taken))

        timer = asyncio.get_running_loop().call_later(LEND_S, returned)
        try:
            taken.append(await self.bus.subscribe_direct(subjects.realtime_taken(call.cid), lambda _: returned()))
        except BusError as e:  # listed for LEND_S all the same
            log.warning("call %s: not told when its taker holds it (%s); listed for %g s", call.cid, e, LEND_S)
        event(log, "call handed over", cid=call.cid, request_id=call.request_id, outputs=call.relay.relayed)

    async def adopt(self, cid: str, move: wire.RealtimeMove, sink: Sink) -> RelayedCall:
        """Hold call `cid`, which another frontend let go (`move`): its outputs relayed from
        where that one stopped (the stream is read at once for what it did not relay), its
        input published on from where it stood, listed as adopted in this frontend's
        heartbeats (its owner sets its `on_end`). Where it cannot be held here (the frontend
        is stopping, a move that does not fit the model, the bus failing) the call is
        aborted, since nobody else holds it any more, and the error raised."""
        try:
            if not self.ready.is_set():
                raise Overloaded("the frontend is stopping" if self.stopping else "the frontend is starting (no conductor yet)")
            model = self.model(move.model)
            inp = CallInput(model, self._limits[model.name], self.config.max_call_input_bytes, time.monotonic())
            taken = moves.take_over(inp, move)
        except (DuplexError, ValueError) as e:
            await self.abort_unheld(cid, f"the frontend a session was resumed on could not take its call: {e}")
            raise
        call = RelayedCall(
            cid,
            taken.request_id,
            inp,
            sink,
            True,
            taken.request_id_revision,
            relay=taken.relay,
            binary_fields=model.binary_fields,
            moves=taken.moves,
        )
        self.calls[cid] = call
        try:
            call.subs.append(await self.bus.subscribe_direct(subjects.out(cid), self.outputs.on_out))
            call.subs.append(await self.bus.subscribe_direct(subjects.fin(cid), self.outputs.on_fin))
        except BaseException:
            await self.abort(call, "the frontend a session was resumed on could not subscribe to its call", 503)
            raise
        self.outputs.recover(call)  # what was stored after the other frontend's relay stopped
        event(log, "call taken over", cid=cid, request_id=call.request_id, moves=call.moves, from_frontend=move.frontend_id)
        return call

    async def abort_unheld(self, cid: str, reason: str) -> None:
        """Abort a call that no frontend holds any more (one let go to this one, which could
        not take it up): 503, for the conductor and its workers."""
        try:
            await self.bus.store(subjects.abort(cid), wire.encode(wire.Abort(reason=reason, status=503)))
        except BusError as e:  # the conductor ends it once no heartbeat lists it
            log.error("call %s: its abort (%s) was not published: %s", cid, reason, e)

    async def beat_now(self) -> None:
        """A heartbeat now, stored when this returns (it lists every call held now)."""
        if self.life is None:
            raise BusUnavailable("a heartbeat out of turn", "not connected yet")
        await self.life.beat()

    async def _check_timeouts(self) -> None:
        now = time.monotonic()
        limit = self.config.request_timeout_s
        for call in list(self.calls.values()):
            if await self.outputs.check(call, now):
                continue
            if call.input.state is InputState.OPEN and call.input.idle_for(now) > limit:
                err = CallTimeout(f"no input for {limit:g}s (request_timeout_s)")
                await self.abort(call, err.message, err.status, tell_client=True)
