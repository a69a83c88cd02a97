"""Is a worker that cannot take calls stuck? Pure: the shell samples its figures and the time.

A worker's slots can be held by what will never end: per-call state a model leaked (its
partition refuses calls the worker has room for), calls that never finish, a step that
never returns. Such a worker is alive (its loop answers, its heartbeats go on) and serves
nothing. `StuckWatch` tells it apart from a worker that is merely busy:

- **capacity**: for `stuck_s`, calls were refused for want of room (or the worker was full)
  and nothing moved: no call taken, none let go, no step done. A busy worker steps its calls,
  and every call ends by `max_call_duration_s` at the latest; a call whose client is quiet
  ends by `request_timeout_s` (keep `stuck_s` above it).
- **step**: one step has run for `stuck_s`.

Stuck, the worker is not ready (`/readyz` 503, no free slots in its heartbeat, so the
conductor places no call there); stuck for `replace_s` more, it stops so that its
supervisor starts a new one. Anything that moves makes it ready again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.runtime.states import checked


@dataclass(frozen=True)
class Sample:
    """The worker's figures at one moment; the counters only grow."""

    moved: int  # calls added to and gone from its engines so far
    steps: int  # steps done so far
    refusals: int  # calls refused for want of room so far (the worker full, or a partition's Overloaded)
    full: bool  # it holds as many calls as it may
    step_since: float | None  # when the longest step under way began (None: none)


class Health(enum.Enum):
    SERVING = "serving"
    STUCK = "stuck"  # not ready; it may come back
    REPLACING = "replacing"  # stopping for good, for its supervisor to start a new one


_TRANSITIONS = {
    Health.SERVING: {Health.STUCK},
    Health.STUCK: {Health.SERVING, Health.REPLACING},
    Health.REPLACING: set(),
}


class StuckWatch:
    """`observe` a Sample every so often; `state` and `why` say what it makes of them."""

    def __init__(self, stuck_s: float, replace_s: float) -> None:
        self.stuck_s = stuck_s
        self.replace_s = replace_s  # 0: never replaced
        self.state = Health.SERVING
        self.why = ""  # what made it stuck
        self._last: Sample | None = None
        self._moved_at = 0.0  # when something last moved (a call taken or let go, a step)
        self._blocked_since: float | None = None  # refusing (or full) since, with no call taken or let go
        self._stuck_since = 0.0

    @property
    def ready(self) -> bool:
        return self.state is Health.SERVING

    def observe(self, now: float, s: Sample) -> Health:
        last = self._last
        if last is None or s.moved != last.moved:
            self._moved_at = now
            self._blocked_since = None  # a call came or went: there was room, or there is now
        elif s.steps != last.steps:
            self._moved_at = now
        if self._blocked_since is None and (s.full or (last is not None and s.refusals != last.refusals)):
            self._blocked_since = now
        self._last = s
        why = self._why(now, s)
        if why and self.state is Health.SERVING:
            self._move(Health.STUCK)
            self._stuck_since = now
        elif not why and self.state is Health.STUCK:
            self._move(Health.SERVING)
        self.why = why
        if self.state is Health.STUCK and self.replace_s > 0 and now - self._stuck_since >= self.replace_s:
            self._move(Health.REPLACING)
        return self.state

    def _why(self, now: float, s: Sample) -> str:
        if s.step_since is not None and now - s.step_since >= self.stuck_s:
            return f"a step has run for {now - s.step_since:.0f} s"
        blocked = self._blocked_since
        if blocked is not None and now - blocked >= self.stuck_s and now - self._moved_at >= self.stuck_s:
            return f"calls refused for want of room for {now - blocked:.0f} s, and no call or step moved"
        return ""

    def _move(self, to: Health) -> None:
        self.state = checked("worker", self.state, to, _TRANSITIONS)
