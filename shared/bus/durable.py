"""A durable pull consumer (the conductor's) as services hold it: fetch a batch, and
deliveries lost on their way sent again within seconds, not after ack_wait (deliveries.py)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nats.js import JetStreamContext

from shared.bus import subjects
from shared.bus.deliveries import Deliveries
from shared.bus.failures import Denials, mapped
from shared.runtime.errors import BusError, BusTimeout

if TYPE_CHECKING:
    from shared.bus.connection import BusMsg

log = logging.getLogger(__name__)

# A look or a reset waits this long at most: the fetches wait behind it (an API answering
# slowly during an election must not keep the conductor from reading).
LOOK_TIMEOUT_S = 1.0
RESET_RETRY_S = 2.0
RESET_EVERY_S = 5.0
RESET_REFUSED_PAUSE_S = 30.0  # a server that refused a reset (older than 2.14, say) is not asked again sooner


class Durable:
    def __init__(self, js: JetStreamContext, sub: JetStreamContext.PullSubscription, name: str, denials: Denials) -> None:
        self._js = js
        self._sub = sub
        self.name = name
        self._denials = denials
        self.deliveries = Deliveries()
        self.resets = 0  # times deliveries were found lost and the consumer reset
        self._refused_until = 0.0  # no reset is asked for before this (time.monotonic)

    async def fetch(self, batch: int, timeout: float) -> list[BusMsg]:
        """Up to `batch` messages; [] when none came within `timeout` (and then the server's
        count of deliveries is looked at: a lost one at the tail leaves no gap)."""
        try:
            with mapped(f"fetching from consumer {self.name}", self._denials):
                msgs = await self._sub.fetch(batch, timeout=timeout)
        except BusTimeout:
            await self._look()
            return []
        for m in msgs:
            self.deliveries.received(m.metadata.sequence.consumer)
        if self.deliveries.gap:
            await self._reset()
        return list(msgs)  # nats-py's Msg is a BusMsg; the list is the caller's

    async def _look(self) -> None:
        try:
            with mapped(f"looking at consumer {self.name}", self._denials):
                info = await self._js.consumer_info(subjects.STREAM, self.name, timeout=LOOK_TIMEOUT_S)
        except BusError as e:  # the next fetch meets the same outage, and says so
            log.debug("looking at consumer %s: %s", self.name, e)
            return
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if self.deliveries.looked(delivered or 0, info.num_ack_pending or 0):
            await self._reset()

    async def _reset(self) -> None:
        """Every message above the ack floor sent again now (ADR-60's consumer reset): those
        lost on their way, and those this client holds or acknowledged above the floor (handled
        twice: the conductor's core takes a message again as it does after a restart)."""
        if time.monotonic() < self._refused_until:
            return
        try:
            with mapped(f"resetting consumer {self.name}", self._denials):
                await self._js.reset_consumer(subjects.STREAM, self.name, timeout=LOOK_TIMEOUT_S)
        except BusError as e:
            log.warning("consumer %s lost deliveries and could not be reset (%s): they come after its ack_wait", self.name, e)
            # a timeout (an election, say) is asked again soon; a refusal not for a while
            self._refused_until = time.monotonic() + (RESET_RETRY_S if e.recoverable else RESET_REFUSED_PAUSE_S)
            return
        self.deliveries.reset()
        self.resets += 1
        # At most one reset every RESET_EVERY_S: a second client pulling from the consumer (a
        # second conductor, which a deployment should not run) makes every fetch look lossy.
        self._refused_until = time.monotonic() + RESET_EVERY_S
        log.warning("consumer %s lost deliveries on their way: reset, its unacknowledged messages come again now", self.name)
