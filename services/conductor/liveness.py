"""Which processes are alive, from their heartbeats (pure: the caller gives the time).

A heartbeat is a KV put, and each put has a new revision. A process is alive while new
revisions of its key keep coming, by this process's own clock: comparing the time the
server stored an entry with the local clock would make clock skew between machines larger
than `liveness_s` count live processes as dead (or dead ones as live). A restarted watcher
replays each key's last entry; its revision is not new, so it revives nothing, not even a
process already declared lost.
"""

from __future__ import annotations

FORGOTTEN_MAX = 10_000  # lost keys whose last revision is kept, so a replay does not revive them


class Liveness:
    def __init__(self, liveness_s: float) -> None:
        self.liveness_s = liveness_s
        self._alive: dict[str, float] = {}  # key -> when its latest new revision came (local clock)
        self._revision: dict[str, int] = {}  # key -> the latest revision seen, alive or lost

    def __contains__(self, key: str) -> bool:
        return key in self._alive

    def saw(self, key: str, revision: int, now: float) -> bool:
        """A put of `key` came at `now`: True where it is a new heartbeat, False for a replay."""
        if revision <= self._revision.get(key, 0):
            return False
        self._revision[key] = revision
        self._alive[key] = now
        return True

    def left(self, key: str) -> bool:
        """The key was deleted (a clean exit): True where it was alive until now."""
        self._revision.pop(key, None)  # a deleted key starts again with a higher revision
        return self._alive.pop(key, None) is not None

    def expired(self, now: float) -> list[str]:
        """Keys with no new heartbeat for more than liveness_s: lost from now on."""
        lost = [k for k, t in self._alive.items() if now - t > self.liveness_s]
        for k in lost:
            del self._alive[k]
        while len(self._revision) - len(self._alive) > FORGOTTEN_MAX:
            oldest_lost = next(k for k in self._revision if k not in self._alive)
            del self._revision[oldest_lost]
        return lost
