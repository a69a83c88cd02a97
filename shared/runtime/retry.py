"""Waiting out the bus: one way to try an operation again, and one way to say so.

`retrying(op, outage)` runs `op` until it returns. A `BusError` that may work later
(`recoverable`: a timeout, a server restarting) is tried again after a pause that doubles
up to a bound (`Backoff`); one that will not (a permission, a request the server refuses)
and any other exception (a bug) are raised at once, so neither is retried in silence. The
`Outage` says what happened once: a warning when the failures begin, a reminder a minute
while they last, one line when it works again with how long it took, not a line per try.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.runtime.errors import BusError

log = logging.getLogger(__name__)

T = TypeVar("T")


class Outage:
    """A failure that repeats while its cause lasts (a round trip each period while NATS is
    away) is logged when it starts, every `remind_s` while it lasts, and when it ends, not at
    each try: a line a second that says the same thing buries what else happens meanwhile."""

    def __init__(self, what: str, logger: logging.Logger = log, remind_s: float = 60.0) -> None:
        self.what = what
        self._log = logger
        self.remind_s = remind_s
        self.since: float | None = None  # when the outage began (None: none now)
        self.failures = 0  # failed tries in it
        self._logged = 0.0

    def failed(self, error: BaseException, now: float) -> None:
        self.failures += 1
        if self.since is None:
            self.since = self._logged = now
            self._log.warning("%s failed: %s; trying again", self.what, error)
        elif now - self._logged >= self.remind_s:
            self._logged = now
            self._log.warning("%s still fails after %.0f s (%d tries): %s", self.what, now - self.since, self.failures, error)

    def ok(self, now: float) -> None:
        # INFO: the warning that began it already asked for attention; this closes it.
        if self.since is not None:
            self._log.info("%s works again after %.1f s (%d failed tries)", self.what, now - self.since, self.failures)
        self.since, self.failures = None, 0


class Backoff:
    """Pauses between tries that double from `first_s` up to `max_s` (pure: the caller sleeps)."""

    def __init__(self, first_s: float = 0.05, max_s: float = 2.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def pause(self) -> float:
        pause = self._next
        self._next = min(2 * pause, self.max_s)
        return pause

    def reset(self) -> None:
        self._next = self.first_s


async def retrying(
    op: Callable[[], Awaitable[T]],
    outage: Outage,
    *,
    backoff: Backoff | None = None,
    give_up_s: float | None = None,
) -> T:
    """`await op()` until it returns, and its result. A recoverable BusError is tried again
    after `backoff`'s pause; past `give_up_s` (None: never) the last one is raised instead,
    as is at once a BusError that is not recoverable and any other exception. `outage` is
    told of each failure tried again and of the success that ends them (so it logs them)."""
    backoff = backoff or Backoff()
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    while True:
        try:
            result = await op()
        except BusError as e:
            now = time.monotonic()
            if not e.recoverable or (deadline is not None and now >= deadline):
                raise
            outage.failed(e, now)
            pause = backoff.pause()
            await asyncio.sleep(pause if deadline is None else min(pause, deadline - now))
            continue
        outage.ok(time.monotonic())
        return result
