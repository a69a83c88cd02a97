"""The frontend's output side: each call's outputs relayed to its client, in order, and its fin.

Outputs come on core subscriptions, straight from the read loop (`on_out`); what goes to the
client when is the pure `relay.OutputRelay`'s to decide. This does the reading (live, and
from the stream for what was lost or not taken while the client had no room) and the
sending. A fin whose counts are met finishes the call; the service ends it (`End`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.frontend.relayed_call import RelayedCall
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg
from shared.runtime.errors import BusError, DuplexError
from shared.runtime.metrics import FrontendMetrics
from shared.runtime.process import TaskSet

log = logging.getLogger(__name__)

End = Callable[[RelayedCall, str, int, dict[str, Any]], Awaitable[None]]
"""The service's end of a call: (call, outcome, status, the client's last message)."""


class Outputs:
    """The outputs and fins of every live call of the service (`calls`, which the service owns)."""

    def __init__(
        self, calls: dict[str, RelayedCall], bus: Callable[[], BusConnection], metrics: FrontendMetrics, end: End
    ) -> None:
        self.calls = calls
        self._bus = bus  # the service's connection, once it has one
        self.metrics = metrics
        self._end = end
        self.tasks = TaskSet()  # large outputs' reads, reads from the stream, fins, finishes

    async def close(self) -> None:
        await self.tasks.close()

    # -- from the bus ----------------------------------------------------------
    def on_out(self, m: BusMsg) -> None:
        """Straight from the read loop (BusConnection.subscribe_direct): an output goes to the socket
        with no task in between; only a large one (in the Object Store) needs one."""
        call = self.calls.get(subjects.parse(m.subject).cid)
        if call is None:
            return
        if call.relay.behind or not call.sink.has_room():
            self._fall_behind(call)  # the client is slower than its outputs: this one waits in the stream
        elif self._bus().is_stored(m):
            self.tasks.spawn(self._accept_stored(call, m))
        else:
            self._accept(call, m.data)

    def on_fin(self, m: BusMsg) -> None:
        call = self.calls.get(subjects.parse(m.subject).cid)
        if call is not None:
            self.tasks.spawn(self._accept_fin(call, m.data))

    async def on_reconnect(self) -> None:
        """Outputs and fins published while we were disconnected: read them from the stream."""
        log.warning("reconnected to NATS: recovering the outputs of %d calls", len(self.calls))
        for call in list(self.calls.values()):
            self.recover(call)

    async def check(self, call: RelayedCall, now: float) -> bool:
        """The relay's clocks (the service's timeouts pass): a read of the stream that is due,
        or a fin whose missing outputs it gives up on. True where the call finished."""
        if call.relay.give_up_due(now, reading=call.recovering):
            await self._finish(call)
            return True
        if not call.recovering and call.relay.read_due(now, call.sink.has_room()):
            self.recover(call)
        return False

    # -- relaying ----------------------------------------------------------------
    async def _accept_stored(self, call: RelayedCall, m: BusMsg) -> None:
        self._accept(call, await self._bus().body(m))

    def _fall_behind(self, call: RelayedCall) -> None:
        """Live outputs are not taken until the client has room; then they are read from the
        stream (`recover`), from where the relay is."""
        call.relay.fall_behind()
        call.sink.when_room(call.cid, lambda: self.recover(call))

    def _accept(self, call: RelayedCall, body: bytes) -> None:
        """Relay what the relay lets through now (`relay.OutputRelay`). The last output a fin
        counts finishes the call."""
        try:
            o = wire.decode_as(body, wire.OutputMsg)
            event = call.event_body(o)
        except DuplexError:
            return
        relayed = call.relay.accept(o.partition, o.seq, event, time.monotonic())
        for out in relayed:
            call.relay_output(out)
        if relayed and o.sent_ns:
            self.metrics.reply_lag.observe(max(0.0, (time.time_ns() - o.sent_ns) / 1e9))
        if call.fin is not None and call.relay.complete:
            self.tasks.spawn(self._finish(call))

    def recover(self, call: RelayedCall) -> None:
        """Outputs not relayed yet, lost in transit (a gap, or fewer than the fin counts) or
        not taken while the client had no room: every output is in the stream, so read the
        call's outputs from there and relay the missing ones, as long as the client has room.
        Each read starts where the last one ended: what was stored before that has been
        relayed (or held), so a missing output is stored later."""
        if call.recovering or call.cid not in self.calls:
            return
        call.recovering = True
        self.tasks.spawn(self._recover(call))

    async def _recover(self, call: RelayedCall) -> None:
        stopped = False
        try:
            while call.cid in self.calls:
                drops = call.relay.drops
                if not await self._read(call):
                    stopped = True
                    return
                call.relay.caught_up()
                if call.relay.drops == drops:
                    return
                # Live outputs were not taken during the read: those stored after its end
                # are read now.
        except BusError as e:  # `check` reads again when the next read is due; a bug is the TaskSet's to log
            log.warning("recovering the outputs of %s failed: %s", call.cid, e)
        finally:
            call.recovering = False
            if stopped:
                self._fall_behind(call)  # read on once the client has room
                if call.sink.has_room():  # it drained while the read was being closed
                    self.recover(call)

    async def _read(self, call: RelayedCall) -> bool:
        """One read of the call's stored outputs and fin, from where the relay is; False where
        it stopped because the client had no room for more."""
        filters = [subjects.out(call.cid), subjects.fin(call.cid)]
        async with contextlib.aclosing(self._bus().read_stored(filters, after=call.relay.read_to)) as stored:
            async for subject, body, seq in stored:
                if subjects.parse(subject).kind == subjects.FIN:
                    call.relay.read(seq)
                    await self._accept_fin(call, body)
                elif not call.sink.has_room():
                    return False
                else:
                    call.relay.read(seq)
                    self._accept(call, body)
        return True

    # -- the fin -----------------------------------------------------------------
    async def _accept_fin(self, call: RelayedCall, body: bytes) -> None:
        """A fin that counts outputs not relayed yet waits for them (`check` reads the stream
        for them, and gives up on them after a while)."""
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
        if fin.reason == "overloaded":  # refused by the conductor's admission
            self.metrics.refusals.labels(str(fin.status)).inc()
        if fin.status != 200:
            await self._end(call, "failed", fin.status, {"error": fin.error or fin.reason, "status": fin.status})
            return
        if not call.relay.complete:
            log.warning("call %s finished with outputs missing", call.cid)
        finish = {"reason": fin.reason, "usage": fin.usage, "usage_by_partition": fin.usage_by_partition, "call_id": call.cid}
        await self._end(call, "completed", 200, {"finish": finish})
