"""Does a bus connection still hear? Pure: the connection's shell samples the client and the time.

nats-py can be left connected and deaf: its read loop dies on an exception it does not
handle (docs/reliability.md, *A NATS pause*), the client still says it is connected and
still writes, and nothing is read until its stale-connection check fires. `LinkWatch` tells
the states apart from what the client shows:

- **up**: connected, its read loop running.
- **down**: nats-py is reconnecting (a server gone, restarting, or found stale by its
  pings): it mends itself once a server answers, however long that takes.
- **deaf**: it says it is connected but its read loop has ended. The shell forces a
  reconnect at once (a new read loop comes with it), and again every `retry_s`.
- **lost**: deaf past `deaf_bound_s` whatever was tried, or closed by nats-py itself: the
  process cannot recover by itself, so its `/livez` fails and its supervisor replaces it.
  Nothing leaves this state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.runtime.states import checked

DEAF_BOUND_S = 10.0  # deaf this long despite reconnects: the process is past mending itself
RETRY_S = 2.0  # a reconnect forced on a deaf connection is forced again after this


@dataclass(frozen=True)
class LinkSample:
    """The client as it is at one moment."""

    connected: bool  # nats-py says it is connected
    reading: bool  # its read loop runs
    closed: bool  # closed, and not by this process's own close


class Link(enum.Enum):
    UP = "up"
    DOWN = "down"
    DEAF = "deaf"
    LOST = "lost"


_ANY = set(Link)
_TRANSITIONS = {Link.UP: _ANY, Link.DOWN: _ANY, Link.DEAF: _ANY, Link.LOST: {Link.LOST}}  # lost stays lost


class LinkWatch:
    """`observe` a LinkSample every so often: True when the shell must force a reconnect now."""

    def __init__(self, deaf_bound_s: float = DEAF_BOUND_S, retry_s: float = RETRY_S) -> None:
        self.deaf_bound_s = deaf_bound_s
        self.retry_s = retry_s
        self.state = Link.UP  # a connection is watched once open
        self.why = ""  # what made it lost
        self._deaf_since: float | None = None
        self._forced_at: float | None = None

    @property
    def lost(self) -> bool:
        return self.state is Link.LOST

    def observe(self, s: LinkSample, now: float) -> bool:
        if self.state is Link.LOST:
            return False
        if s.closed:
            self._to(Link.LOST, "the connection was closed and will not reconnect")
            return False
        if not s.connected:
            self._to(Link.DOWN)
            return False
        if s.reading:
            self._to(Link.UP)
            return False
        return self._deaf(now)

    def _deaf(self, now: float) -> bool:
        if self._deaf_since is None:
            self._deaf_since = now
        self._to(Link.DEAF)
        if now - self._deaf_since >= self.deaf_bound_s:
            self._to(Link.LOST, f"connected but reading nothing for {now - self._deaf_since:.1f} s, reconnects forced in vain")
            return False
        if self._forced_at is None or now - self._forced_at >= self.retry_s:
            self._forced_at = now
            return True
        return False

    def _to(self, state: Link, why: str = "") -> None:
        self.state = checked("bus link", self.state, state, _TRANSITIONS)
        if state is not Link.DEAF:
            self._deaf_since = self._forced_at = None
        if why:
            self.why = why
