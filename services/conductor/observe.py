"""What the conductor's events and actions say to an operator: Prometheus metrics and one log
line per call placed. Fed by the service with each event and the actions the core answered
with; no I/O but the log line."""

from __future__ import annotations

import logging

from services.conductor import core
from shared.runtime.metrics import ConductorMetrics
from shared.runtime.process import event

log = logging.getLogger(__name__)

PLACED = (core.CallState.RUNNING, core.CallState.INPUT_ENDED)


class Observer:
    def __init__(self, conductor: core.Conductor, metrics: ConductorMetrics) -> None:
        self.core = conductor
        self.metrics = metrics
        self.placing_since: dict[str, float] = {}  # calls opened and not yet placed (bounded by the calls held)
        metrics.live_calls.set_function(lambda: conductor.active)
        metrics.workers_alive.set_function(lambda: len(conductor.workers))

    def after(self, ev: core.Event, actions: list[core.Action], now: float) -> None:
        if isinstance(ev, core.Opened) and ev.msg.cid in self.core.calls:
            self.placing_since.setdefault(ev.msg.cid, now)
        for a in actions:
            if isinstance(a, core.SendAssign):
                self.metrics.placements.inc(len(a.msg.partitions))
            elif isinstance(a, core.PublishFin):
                self.placing_since.pop(a.cid, None)
                if a.msg.error == core.LET_GO:  # its abort lost, or read before its open: worth a look
                    log.warning("call %s ended: its frontend no longer holds it (%s)", a.cid, type(ev).__name__)
        if isinstance(ev, core.AssignResult) and ev.ok:
            call = self.core.calls.get(ev.cid)
            since = self.placing_since.get(ev.cid)
            if call is not None and since is not None and call.state in PLACED:
                del self.placing_since[ev.cid]
                wait = now - since
                self.metrics.placement_wait.observe(wait)
                event(
                    log, "call placed", cid=call.cid, request_id=call.request_id, placement=call.placement, wait_s=round(wait, 4)
                )
