"""Which of a durable consumer's deliveries reached this client (pure: no I/O; the shell is
durable.py).

The server numbers every delivery of a consumer (its consumer sequence, redeliveries
included), and one client's pulls get them in that order. A number skipped is a delivery
lost on its way: sent to a pull request of a connection that was dropped (a node paused or
cut off, the client reconnecting elsewhere), or to a route that went down. The server sends
a lost delivery again only after ack_wait (the conductor's is 30 s, so that a slow conductor
is not sent its backlog twice); a consumer reset (ADR-60, nats-server 2.14) sends every
unacknowledged message again at once. A loss at the tail leaves no gap: then the server's
count of deliveries is ahead of the last one received, with messages unacknowledged, at two
looks in a row with nothing received in between (a delivery on its way is received by then)."""

from __future__ import annotations


class Deliveries:
    def __init__(self) -> None:
        self.last: int | None = None  # the last consumer sequence received (None: none since the start or a reset)
        self.gap = False  # a consumer sequence was skipped
        self._ahead: tuple[int, int] | None = None  # (the server's count, ours) at the last look where it was ahead

    def received(self, seq: int) -> None:
        """A delivery with consumer sequence `seq` came. One lower than the last is taken as
        the new start (a consumer leader that took over numbers from its own state)."""
        if self.last is not None and seq > self.last + 1:
            self.gap = True
        self.last = seq
        self._ahead = None

    def looked(self, delivered: int, unacked: int) -> bool:
        """The server's count of deliveries and of unacknowledged messages (consumer info),
        looked at while no pull brought anything. True when deliveries are lost and the
        consumer is to be reset."""
        if self.gap:
            return True
        mine = self.last or 0
        if delivered <= mine or unacked == 0:  # nothing is missing, or nothing missing is owed
            self._ahead = None
            return False
        seen = (delivered, mine)
        if self._ahead == seen:
            return True
        self._ahead = seen
        return False

    def reset(self) -> None:
        """The consumer was reset: its numbering starts again at 1."""
        self.last = None
        self.gap = False
        self._ahead = None
