"""The worker's assignments: the conductor's `ctl.worker.{id}.assign` requests, answered.

An assigned call's partitions here are added to their engines, then handed to the intake
(`Intake.placed`), which takes their input. The answer carries no internal error's text:
the conductor passes a refusal's reason on to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.worker.calls import Context
from services.worker.intake import Intake
from shared.bus import subjects, wire
from shared.bus.connection import BusMsg
from shared.runtime.errors import BusError, DuplexError, Overloaded

log = logging.getLogger(__name__)

# What the conductor (and so the client) is told where taking the call failed for a reason
# that is not the client's to read (a model's exception, the bus): the worker's log has why.
TAKE_FAILED = "internal error: the worker could not take the call"


class Assignment:
    """Answers assignments; it starts no task of its own (`Intake.placed` does)."""

    def __init__(
        self,
        ctx: Context,
        intake: Intake,
        accepting: Callable[[], bool],
        capacity: Callable[[], int],
    ) -> None:
        self.ctx = ctx
        self.intake = intake
        self._accepting = accepting
        self._capacity = capacity
        self.refusals = 0  # calls refused for want of room (full, or a partition's own bound): the stuck watch counts them

    async def on_assign(self, msg: BusMsg) -> None:
        reply = await self.answer(msg.data)
        try:
            await self.ctx.bus.answer(msg, wire.encode(reply))
        except BusError as e:
            # The conductor hears nothing, takes that for a refusal ("no reply") and aborts the call:
            # its abort reaches the intake here, which lets the call go. Nothing is left to undo.
            log.warning("the answer to an assignment was not sent: %s", e)

    async def answer(self, data: bytes) -> wire.AssignReply:
        """Take the call an Assign names, and say whether it was taken."""
        try:
            await self.assign(wire.decode_as(data, wire.Assign))
        except BusError:  # a DuplexError, but its text names servers and subjects: for the log only
            log.exception("assign failed on the bus")
            return wire.AssignReply(ok=False, error=TAKE_FAILED)
        except DuplexError as e:  # ours, worded for the client: full, stopping, a bad message
            if isinstance(e, Overloaded):
                self.refusals += 1
            return wire.AssignReply(ok=False, error=e.message)
        except Exception:  # a model's open_call raised: a model's exception must not end the worker
            log.exception("assign failed")
            return wire.AssignReply(ok=False, error=TAKE_FAILED)
        return wire.AssignReply(ok=True)

    async def assign(self, a: wire.Assign) -> None:
        """Take the call's partitions that run here. A call may come back for more of its
        partitions (another worker of one of them died and it was placed here): only the new
        ones are added; an assignment repeated by the conductor changes nothing."""
        if not self._accepting():
            raise Overloaded("worker is shutting down")
        call = self.intake.calls.get(a.cid)
        mine = [p for p in a.partitions if p in self.ctx.runners and (call is None or p not in call.partitions)]
        if call is not None and not mine:
            return
        if call is None and len(self.intake.calls) >= self._capacity():
            raise Overloaded(f"worker {self.ctx.worker_id} is full ({self._capacity()} calls)")
        kwargs = await self._kwargs_from_open(a.cid) if a.kwargs_in_open else a.model_kwargs
        added: list[str] = []
        try:
            for p in mine:
                r = self.ctx.runners[p]
                async with r.lock:
                    r.engine.add_call(a.cid, kwargs)
                added.append(p)
        except BaseException:
            for p in added:  # a partition refused it (its own capacity, bad kwargs): leave no trace
                async with self.ctx.runners[p].lock:
                    self.ctx.runners[p].engine.drop_call(a.cid)
            raise
        if call is None:
            call = self.intake.open(a.cid)
            call.binary, call.read_after = a.binary, a.read_after
        await self.intake.placed(call, mine)

    async def _kwargs_from_open(self, cid: str) -> dict[str, Any]:
        stored = await self.ctx.bus.last_stored(subjects.open_(cid))
        return dict(wire.decode_as(stored, wire.Open).model_kwargs)
