"""The frontend's input side on the bus: a call's items published, its ends of input stored.

What an opening, append or end_input turns into is decided by the pure `calls.CallInput`;
this publishes it. Items go by core publish, ends of input are stored with an ack. Client
input waits while the bus connection is backed up (`take`, told so by `probes.BusProbe`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from services.frontend.calls import Prepared
from services.frontend.protocol import Append, EndInput
from services.frontend.relayed_call import RelayedCall
from shared.bus import subjects, wire
from shared.bus.connection import STORE_PATIENCE_S, BusConnection
from shared.runtime.metrics import FrontendMetrics
from shared.runtime.process import TimeSlice

log = logging.getLogger(__name__)


class InputPublisher:
    """Publishes every call's input on the frontend's one bus connection."""

    def __init__(self, bus: Callable[[], BusConnection], metrics: FrontendMetrics) -> None:
        self._bus = bus  # the service's connection, once it has one
        self.metrics = metrics
        self._taking = asyncio.Event()
        self._taking.set()
        # Publishing gives the loop back every few ms, one slice for every call (a one-shot's
        # thousands of items), so the hot path makes no object per append.
        self._turn = TimeSlice()

    @property
    def taking(self) -> bool:
        return self._taking.is_set()

    def take(self, taking: bool) -> None:
        """Take client input (True), or hold it until told again (False)."""
        if taking == self._taking.is_set():
            return
        if taking:
            self._taking.set()
            log.debug("the bus caught up: taking client input again")
        else:
            self._taking.clear()
            self.metrics.input_holds.inc()
            log.debug("the bus connection is backed up: client input waits")

    async def append(self, call: RelayedCall, a: Append) -> None:
        """An append; raises for a rejected append (the caller ends the call with its error)."""
        prepared = call.input.accept(a.input, opening=False, end=a.end_input, now=time.monotonic())
        await self.publish(call, prepared)

    async def end_input(self, call: RelayedCall, e: EndInput) -> None:
        await self.publish(call, call.input.end_input(e.end_input, time.monotonic()))

    async def publish(self, call: RelayedCall, p: Prepared) -> None:
        """An append's or end_input's items, then its ends; the late-append reply if any."""
        await self.items(call.cid, p)
        if p.ended and call.announced is not None and not call.announced.done():
            # After the open: the conductor reads a call's ends of input after its open. Shielded:
            # a caller cancelled (its client gone) does not cancel the open's store.
            await asyncio.shield(call.announced)
            if call.ended.is_set():  # the open was not stored: the call ended with its error
                return
        await self.ends(call.cid, p)
        reply = late_reply(p)
        if reply is not None:
            call.reply(reply)

    async def items(self, cid: str, p: Prepared) -> None:
        self.metrics.appends.inc(len(p.items))
        bus = self._bus()
        for edge, seq, item in p.items:
            await self._turn.due()
            if not self._taking.is_set():
                await self._taking.wait()
            body = wire.encode(wire.InputItem(seq=seq, item=wire.WireItem.from_item(item), sent_ns=time.time_ns()))
            # Core publish: the stream stores it all the same, with no round trip per append.
            # No Nats-Msg-Id: consumers deduplicate items by seq, and the server's duplicate
            # window would track every item (measured: docs/performance.md).
            await bus.publish(subjects.input_(cid, edge), body)

    async def ends(self, cid: str, p: Prepared) -> None:
        for edge, total in p.ended.items():
            await self._bus().store_once(subjects.eoi(cid, edge), wire.encode(wire.EndOfInput(total=total)), STORE_PATIENCE_S)


def late_reply(p: Prepared) -> dict[str, Any] | None:
    """The late-append reply: input for (or an end of) streams the client had already ended.
    Nothing of it was charged or sent; the call goes on. None where there was none."""
    if not p.late and not p.already_ended:
        return None
    late = sorted(set(p.late) | set(p.already_ended))
    what = []
    if p.late:
        what.append(f"input routed to stream(s) {p.late} was neither charged nor sent")
    if p.already_ended:
        what.append(f"end_input named stream(s) {p.already_ended} again")
    error = f"stream(s) {late} already ended: " + "; ".join(what)
    return {"append": True, "error": error, "status": 409, "late": late}
