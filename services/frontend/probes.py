"""The frontend's two probes, each a loop its service runs in a task of its own.

`BusProbe` times round trips on the bus connection and tells the input side whether to take
client input (the rule is the pure `pressure.BusPressure`); `LoopLagProbe` measures how late
the event loop runs a timer (`duplexbus_frontend_loop_lag_seconds`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.frontend.pressure import BusPressure
from shared.bus.connection import BusConnection
from shared.runtime.errors import BusError

log = logging.getLogger(__name__)

LOOP_PROBE_S = 0.1  # the loop's timer lag is measured this often
PROBE_EVERY_S = 0.25  # the bus connection's round trip measured this often (pressure.py)
PROBE_TIMEOUT_S = 10.0


class BusProbe:
    """Round trips on the bus connection, for `pressure.BusPressure` to judge: each 0.25 s
    while input is taken, back to back while it is held. An outage holds nothing (the
    connection's reconnect buffer and the calls' own timeouts see to that)."""

    def __init__(self, bus: Callable[[], BusConnection], take: Callable[[bool], None]) -> None:
        self._bus = bus
        self._take = take  # `inputs.InputPublisher.take`
        self.pressure = BusPressure()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            probe = loop.create_task(self._bus().round_trip(PROBE_TIMEOUT_S))
            try:
                if not (await asyncio.wait({probe}, timeout=self.pressure.slow_s))[0]:
                    self._take(self.pressure.observed(None, loop.time()))
                await probe
                self._take(self.pressure.observed(loop.time() - t0, loop.time()))
            except BusError as e:
                log.debug("bus probe: %s", e)
                self._take(True)
            finally:
                probe.cancel()
            if self.pressure.taking:
                await asyncio.sleep(PROBE_EVERY_S)


class LoopLagProbe:
    """How late the event loop runs a timer: work that holds the loop (TimeSlice) shows here
    before calls fail for it."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe  # the loop-lag histogram's

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_PROBE_S)
            self._observe(max(0.0, loop.time() - t0 - LOOP_PROBE_S))
