"""Which processes are alive, from their heartbeats (pure: the caller gives the time).

A heartbeat is a KV put, and each put has a new revision. A process is alive while new
revisions of its key keep coming, by this process's own clock: comparing the time the
server stored an entry with the local clock would make clock skew between machines larger
than `liveness_s` count live processes as dead (or dead ones as live). A restarted watcher
replays each key's last entry; its revision is not new, so it revives nothing, not even a
process already declared lost.

Silence is counted only over time this process was listening (`ListeningClock`): awake,
connected and with a working watch. A conductor frozen (SIGSTOP, a long GC pause, CPU
starvation) or cut off from NATS for longer than `liveness_s` has heartbeats it has not
read yet; judged by the wall of time it missed, every live worker and frontend would be
"lost" and every call aborted. A judge that has not been listening does not convict.
"""

from __future__ import annotations

FORGOTTEN_MAX = 10_000  # lost keys whose last revision is kept, so a replay does not revive them


class ListeningClock:
    """Seconds spent listening: real time, less any stretch this process was deaf.

    It advances on every `read(now)`. A gap between two reads longer than `max_gap_s` means
    the process itself did not run (its caller reads at least every tick): only `max_gap_s`
    of it counts. A stretch that began or ended while not listening counts nothing."""

    def __init__(self, max_gap_s: float) -> None:
        self.max_gap_s = max_gap_s
        self.value = 0.0
        self.listening = True
        self._last: float | None = None
        self._listened_since_last = True

    def hear(self, listening: bool, now: float) -> None:
        """Whether this process can hear heartbeats from now on (connected, watching)."""
        self.read(now)
        self.listening = listening
        self._listened_since_last = self._listened_since_last and listening

    def read(self, now: float) -> float:
        if self._last is not None and self._listened_since_last:
            self.value += min(max(now - self._last, 0.0), self.max_gap_s)
        self._last = now
        self._listened_since_last = self.listening
        return self.value


class Liveness:
    def __init__(self, liveness_s: float, max_gap_s: float = 1.0) -> None:
        self.liveness_s = liveness_s
        self.clock = ListeningClock(max_gap_s)
        self._alive: dict[str, tuple[int, float]] = {}  # key -> (latest revision, when it came by the listening clock)
        self._lost: dict[str, int] = {}  # lost key -> its last revision, oldest loss first

    def __contains__(self, key: str) -> bool:
        return key in self._alive

    def hear(self, listening: bool, now: float) -> None:
        self.clock.hear(listening, now)

    def saw(self, key: str, revision: int, now: float) -> bool:
        """A put of `key` came at `now`: True where it is a new heartbeat, False for a replay."""
        at = self.clock.read(now)
        last = self._alive[key][0] if key in self._alive else self._lost.get(key, 0)
        if revision <= last:
            return False
        self._lost.pop(key, None)
        self._alive[key] = (revision, at)
        return True

    def left(self, key: str) -> bool:
        """The key was deleted (a clean exit): True where it was alive until now."""
        self._lost.pop(key, None)  # a deleted key starts again with a higher revision
        return self._alive.pop(key, None) is not None

    def expired(self, now: float) -> list[str]:
        """Keys with no new heartbeat for more than liveness_s of listening: lost from now on."""
        at = self.clock.read(now)
        lost = [k for k, (_, t) in self._alive.items() if at - t > self.liveness_s]
        for k in lost:
            self._lost[k] = self._alive.pop(k)[0]
        while len(self._lost) > FORGOTTEN_MAX:
            del self._lost[next(iter(self._lost))]
        return lost
