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

Nor does silence alone convict. A heartbeat is a write to a stream: it waits behind the
rest of its process's connection, and behind the server's disk. Twenty uploads sent as fast
as they can be, on a server whose disk is busy, delayed a frontend's heartbeats by over
5 s while it served every call. So a key silent past `liveness_s` is first asked directly
(core request/reply to the process: no disk, and a live process answers at once). An
answer is a sign of life; "no one subscribed" (a process that exited or was killed: its
connection is gone) is lost at once; no answer for `ask_s` of listening (frozen) is lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.runtime.states import checked

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


class Standing(enum.Enum):
    HEARD = "heard"  # its heartbeats come
    ASKED = "asked"  # silent past liveness_s: asked directly, its answer awaited


MOVES = {Standing.HEARD: {Standing.ASKED}, Standing.ASKED: {Standing.HEARD}}


@dataclass
class Beat:
    revision: int  # its latest heartbeat's
    at: float  # the listening clock at its last sign of life (a heartbeat or an answer)
    standing: Standing = Standing.HEARD
    asked_at: float = 0.0  # the listening clock when it was asked

    def move(self, key: str, to: Standing) -> None:
        self.standing = checked(f"liveness of {key}", self.standing, to, MOVES)


class Liveness:
    def __init__(self, liveness_s: float, max_gap_s: float = 1.0, ask_s: float = 1.0) -> None:
        self.liveness_s = liveness_s
        self.ask_s = ask_s
        self.clock = ListeningClock(max_gap_s)
        self._alive: dict[str, Beat] = {}
        self._lost: dict[str, int] = {}  # lost key -> its last revision, oldest loss first

    def __contains__(self, key: str) -> bool:
        return key in self._alive

    def hear(self, listening: bool, now: float) -> None:
        self.clock.hear(listening, now)

    def saw(self, key: str, revision: int, now: float) -> bool:
        """A put of `key` came at `now`: True where it is a new heartbeat, False for a replay."""
        at = self.clock.read(now)
        beat = self._alive.get(key)
        last = beat.revision if beat is not None else self._lost.get(key, 0)
        if revision <= last:
            return False
        self._lost.pop(key, None)
        self._alive[key] = Beat(revision, at)
        return True

    def left(self, key: str) -> bool:
        """The key was deleted (a clean exit): True where it was alive until now."""
        self._lost.pop(key, None)  # a deleted key starts again with a higher revision
        return self._alive.pop(key, None) is not None

    def overdue(self, now: float) -> list[str]:
        """Keys heard from until now with no sign of life for more than liveness_s of
        listening: the caller asks each directly, until `answered`, `absent` or `expired`."""
        at = self.clock.read(now)
        due = [k for k, b in self._alive.items() if b.standing is Standing.HEARD and at - b.at > self.liveness_s]
        for k in due:
            self._alive[k].move(k, Standing.ASKED)
            self._alive[k].asked_at = at
        return due

    def asked(self, key: str) -> bool:
        """Whether `key` is asked now (its answer still counts)."""
        beat = self._alive.get(key)
        return beat is not None and beat.standing is Standing.ASKED

    def answered(self, key: str, now: float) -> bool:
        """An asked process answered: alive, as if it had just sent a heartbeat."""
        if not self.asked(key):
            return False  # a heartbeat came first, or it is lost already
        beat = self._alive[key]
        beat.move(key, Standing.HEARD)
        beat.at = self.clock.read(now)
        return True

    def absent(self, key: str) -> bool:
        """Nobody is subscribed to an asked process's subject (its connection is gone): lost
        now. True where it was asked until now."""
        if not self.asked(key):
            return False
        self._forget([key])
        return True

    def expired(self, now: float) -> list[str]:
        """Asked keys with no answer for more than ask_s of listening: lost from now on."""
        at = self.clock.read(now)
        lost = [k for k, b in self._alive.items() if b.standing is Standing.ASKED and at - b.asked_at >= self.ask_s]
        self._forget(lost)
        return lost

    def _forget(self, keys: list[str]) -> None:
        for k in keys:
            self._lost[k] = self._alive.pop(k).revision
        while len(self._lost) > FORGOTTEN_MAX:
            del self._lost[next(iter(self._lost))]
