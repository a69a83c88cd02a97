"""Which finished calls leave the stream, and when it is too full for new ones (pure).

The stream has no byte limit of its own: nats-server would drop the oldest messages, and a
call that has run longer than the window the bytes allow (two hours of audio, say, under a
busy stream) would lose its start; a worker that then took it over would wait for item 0
forever. The conductor knows which calls are live, so it is the one that removes calls:

- a finished call goes once it started more than `max_age_s` ago (the replay window);
- while the stream holds more than `max_bytes`, finished calls go, oldest first, sooner;
- past `hard_max_bytes` (live calls alone fill it, or removal lags) new calls are refused
  with 503; live calls go on.

A call is removable `GRACE_S` after its finish, so that a message still on the way (a
worker's last output, a frontend's last append) is not left behind alone. Calls are
ordered by their id, which starts with the time the call began (subjects.new_cid).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

GRACE_S = 5.0
BATCH = 256  # removals per round at most


def started_s(cid: str) -> float:
    """When the call began, from its id (0 for an id of another form: removed first)."""
    try:
        return int(cid[:12], 16) / 1000
    except ValueError:
        return 0.0


class Janitor:
    def __init__(self, max_age_s: float, max_bytes: int, hard_max_bytes: int) -> None:
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.hard_max_bytes = hard_max_bytes
        self._recent: deque[tuple[float, str]] = deque()  # (finished at, cid), within GRACE_S
        self._ready: list[str] = []  # a heap: removable calls, the oldest first
        self._known: set[str] = set()

    def __len__(self) -> int:
        """Finished calls the stream still holds, as far as this janitor knows."""
        return len(self._known)

    def ended(self, cid: str, now: float) -> None:
        """Call `cid` finished at `now` (a monotonic clock); its fin is stored."""
        if cid not in self._known:
            self._known.add(cid)
            self._recent.append((now, cid))

    def found(self, cids: list[str], now: float) -> None:
        """Finished calls found in the stream at start (those of a conductor before this one)."""
        for cid in cids:
            self.ended(cid, now)

    def again(self, cids: list[str]) -> None:
        """Removals that failed: tried again in a later round."""
        for cid in cids:
            if cid not in self._known:
                self._known.add(cid)
                heapq.heappush(self._ready, cid)

    def full(self, stream_bytes: int) -> bool:
        return stream_bytes >= self.hard_max_bytes

    def plan(self, stream_bytes: int, live_calls: int, now_wall: float, now: float) -> list[str]:
        """The calls to remove this round: those past max_age_s, then, while the stream is
        over max_bytes, enough of the oldest to bring it under (by the average size of the
        calls it holds; the next round corrects the estimate)."""
        while self._recent and now - self._recent[0][0] >= GRACE_S:
            heapq.heappush(self._ready, self._recent.popleft()[1])
        out: list[str] = []
        oldest_kept = now_wall - self.max_age_s
        while self._ready and len(out) < BATCH and started_s(self._ready[0]) < oldest_kept:
            out.append(heapq.heappop(self._ready))
        over = stream_bytes - self.max_bytes
        if over > 0 and self._ready:
            per_call = stream_bytes / max(1, len(self._known) + live_calls)
            wanted = len(out) + max(1, math.ceil(over / per_call))
            while self._ready and len(out) < min(BATCH, wanted):
                out.append(heapq.heappop(self._ready))
        self._known.difference_update(out)
        return out
