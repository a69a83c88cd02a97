"""Whether the frontend takes more client input now, judged by its bus connection's round trip.

A frontend takes client input as fast as its sockets deliver it; the bus takes it only as
fast as nats-server stores and forwards it. Twenty uploads sent as fast as possible put
hundreds of megabytes through one connection: the frontend's queue towards the server grew,
and everything else on that connection waited behind it, the heartbeat included, until the
conductor took the frontend for dead and aborted its calls (499 "frontend lost"), and the
server cut the connection as a slow consumer.

So a probe (a PING, answered by a PONG that comes back behind everything sent and received
before it) measures the connection's round trip, and past `slow_s` the frontend stops
taking input: the sockets are read no more, TCP slows the clients, and their input waits
on their side. Once a round trip is back under `fast_s` it takes input again. Ends of input,
aborts and outputs are never held; a live call in real time sends little and is held only as
long as the bus is that far behind. The pure rule is here; `probes.BusProbe` runs the probe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BusPressure:
    slow_s: float = 0.25  # a round trip this long: the connection is backed up, stop taking input
    fast_s: float = 0.05  # one this short again: take input
    settle_s: float = 1.0  # or one under slow_s this long after input was held
    taking: bool = True
    holds: int = 0  # times input was held, for the metrics and the log
    held_since: float | None = None

    def observed(self, rtt_s: float | None, now: float) -> bool:
        """A round trip's time, or None for one that has taken `slow_s` and not come back yet.
        Whether input is taken now."""
        if rtt_s is None or rtt_s > self.slow_s:
            if self.taking:
                self.taking, self.held_since = False, now
                self.holds += 1
        elif not self.taking and (
            rtt_s <= self.fast_s or (self.held_since is not None and now - self.held_since >= self.settle_s)
        ):
            # Under fast_s: the backlog is gone. Under slow_s for settle_s: a connection whose
            # round trip never gets that short (a server far away) is not held for ever.
            self.taking, self.held_since = True, None
        return self.taking
