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
        self._alive: dict[str, tuple[int, float]] = {}  # key -> (latest revision, when it came by the local clock)
        self._lost: dict[str, int] = {}  # lost key -> its last revision, oldest loss first

    def __contains__(self, key: str) -> bool:
        return key in self._alive

    def saw(self, key: str, revision: int, now: float) -> bool:
        """A put of `key` came at `now`: True where it is a new heartbeat, False for a replay."""
        last = self._alive[key][0] if key in self._alive else self._lost.get(key, 0)
        if revision <= last:
            return False
        self._lost.pop(key, None)
        self._alive[key] = (revision, now)
        return True

    def left(self, key: str) -> bool:
        """The key was deleted (a clean exit): True where it was alive until now."""
        self._lost.pop(key, None)  # a deleted key starts again with a higher revision
        return self._alive.pop(key, None) is not None

    def expired(self, now: float) -> list[str]:
        """Keys with no new heartbeat for more than liveness_s: lost from now on."""
        lost = [k for k, (_, t) in self._alive.items() if now - t > self.liveness_s]
        for k in lost:
            self._lost[k] = self._alive.pop(k)[0]
        while len(self._lost) > FORGOTTEN_MAX:
            del self._lost[next(iter(self._lost))]
        return lost
