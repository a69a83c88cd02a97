"""Whether `duplexbus up` replaces a child that is running: pure, fed the answers of its `/livez`.

A child that exits is restarted by the supervision loop. One that is there but does not
answer (frozen by SIGSTOP, a loop stuck, a machine swapping) would go on holding what it
holds: a frontend its share of the one listening port, where the kernel keeps handing it
new sockets that nobody accepts. `LivenessJudge` decides, from one child's probes:

- **starting**: its `/livez` has not answered 200 yet. A new process has a grace (a worker
  loads its model before it serves /livez: `up`'s ready timeout); silent `bound_s` past it,
  it is replaced;
- **live**: it answered 200;
- **silent**: no answer since its last 200; silent for `bound_s`, it is replaced;
- **replacing**: the supervisor kills it (SIGKILL: a frozen process ignores anything else)
  and starts it again; the new process starts over as starting.

A 503 is an answer that says the process cannot mend itself (its bus connection is lost
for good: shared/bus/link.py): it is replaced at once, whatever the state.
"""

from __future__ import annotations

import enum

from shared.runtime.states import checked


class Probe(enum.Enum):
    LIVE = "live"  # 200
    FAILING = "failing"  # answered, not 200: it says it cannot mend itself
    SILENT = "silent"  # no answer within the probe's timeout (refused, reset, timed out)


class Life(enum.Enum):
    STARTING = "starting"
    LIVE = "live"
    SILENT = "silent"
    REPLACING = "replacing"


# Any state goes to STARTING: a child may exit by itself, and be restarted, whatever it was judged.
_TRANSITIONS = {
    Life.STARTING: {Life.STARTING, Life.LIVE, Life.REPLACING},
    Life.LIVE: {Life.STARTING, Life.LIVE, Life.SILENT, Life.REPLACING},
    Life.SILENT: {Life.STARTING, Life.LIVE, Life.SILENT, Life.REPLACING},
    Life.REPLACING: {Life.STARTING},
}


class LivenessJudge:
    """One child's liveness: `started` at each (re)start, `heard` each probe's result."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.state = Life.STARTING
        self.why = ""  # why it is being replaced
        self._last_live = 0.0  # when it last answered 200

    def started(self, now: float, grace_s: float = 0.0) -> None:
        """A new process: its silence counts from `grace_s` after `now`, or from its first answer."""
        self._to(Life.STARTING)
        self._last_live = now + grace_s

    def heard(self, probe: Probe, now: float) -> Life:
        if self.state is Life.REPLACING:
            return self.state  # the answer of the process being killed: nothing to add
        if probe is Probe.LIVE:
            self._last_live = now
            self._to(Life.LIVE)
        elif probe is Probe.FAILING:
            self.why = "its /livez says it cannot recover by itself"
            self._to(Life.REPLACING)
        else:
            silent_s = now - self._last_live
            if silent_s >= self.bound_s:
                never = " (not once since it started)" if self.state is Life.STARTING else ""
                self.why = f"its /livez has not answered for {silent_s:.1f} s{never}"
                self._to(Life.REPLACING)
            elif self.state is not Life.STARTING:
                self._to(Life.SILENT)
        return self.state

    def _to(self, state: Life) -> None:
        self.state = checked("child liveness", self.state, state, _TRANSITIONS)
