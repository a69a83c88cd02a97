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

How they go (`head`): a purge of one call's subjects costs the server about 19 ms on a
stream of 2 GB whose calls interleave (each block holds messages of hundreds of calls), so
300 calls ending every 10 s keep half a core purging, and each purge holds the stream up
while it runs (2 s and more, seen under load). A purge of the stream's head (every message
below a sequence) drops whole blocks: 100,000 messages in 73 ms. So the calls to remove go
with the head where they can: below the cut, the lowest sequence any call still kept may
have a message at (each call's `read_after` floor: wire.Open.read_after), as high as this
round's calls need. Calls interleave, so other finished calls begun beside them straddle
the cut: they go with it too, their heads now and the rest with a later cut (the stream is
trimmed from its head as a queue). A call of the round above the cut (a kept call begun
earlier holds it below) is purged by subject as before. A call not
yet known (its open not read) may have messages anywhere after its frontend's floor, so the
cut also stays above no message stored in the last `HEAD_LAG_S`, and is made only while the
conductor has read every open stored `HEAD_LAG_S - OPEN_WITHIN_S` ago and before: a call's
open is stored within OPEN_WITHIN_S of its first message (the frontend's patience), so any
call with a message below the cut is known. A call whose floor is not known (a frontend
before wire 1.5) holds the cut where it is while it is kept; one found in the stream at
start is purged by subject.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

GRACE_S = 5.0
BATCH = 256  # removals per round at most
HEAD_LAG_S = 60.0  # the head is never cut above a message stored this recently
OPEN_WITHIN_S = 40.0  # a call's open is stored within this of its first message (bus STORE_PATIENCE_S, 30 s, and more)


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
        self._floors: dict[str, int] = {}  # finished call -> its messages are above this (0: not known)
        self._lasts: dict[str, int] = {}  # finished call -> its fin's stream sequence (0: not known)
        self._marks: deque[tuple[float, int]] = deque()  # (monotonic time, the stream's last sequence then)
        self._going: set[str] = set()  # this round's plan
        self.held_by = ""  # why the last round's cut was none (for the conductor's report)

    def __len__(self) -> int:
        """Finished calls the stream still holds, as far as this janitor knows."""
        return len(self._known)

    def ended(self, cid: str, now: float, floor: int = 0, last: int = 0) -> None:
        """Call `cid` finished at `now` (a monotonic clock); its fin is stored (at `last`), and
        its messages are above `floor` (0: either not known)."""
        if cid not in self._known:
            self._known.add(cid)
            self._recent.append((now, cid))
            self._floors[cid], self._lasts[cid] = floor, last

    def ending(self, cid: str, floor: int) -> None:
        """Call `cid` is ending (its fin on its way to the stream): the head is not cut above
        its floor meanwhile, as it was not while the conductor held it."""
        if cid not in self._known:
            self._floors[cid] = floor

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

    def removed(self, cids: list[str]) -> None:
        """These calls are gone from the stream: their floors hold the cut no more."""
        for cid in cids:
            self._floors.pop(cid, None)
            self._lasts.pop(cid, None)

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
        self._going = set(out)
        return out

    def mark(self, now: float, last_seq: int) -> None:
        """The stream's last sequence at `now`, once a round: the marks the cut is bounded by."""
        self._marks.append((now, last_seq))
        while len(self._marks) > 1 and self._marks[1][0] <= now - HEAD_LAG_S:
            self._marks.popleft()  # the oldest kept is the newest at least HEAD_LAG_S old

    def _mark_before(self, t: float) -> int | None:
        """The stream's last sequence at the newest mark taken at or before `t`."""
        found = None
        for at, seq in self._marks:
            if at > t:
                break
            found = seq
        return found

    def head(self, live_floor: int | None, read_to: int, now: float) -> tuple[int, list[str], list[str]]:
        """For the calls of this round's plan: where the stream's head is cut (every message
        below that sequence goes; 0: not this round), those of them still to purge by subject
        (above the cut), and the other removable calls that go with the cut.

        The cut goes as high as the plan's calls need (their fins), no higher than the calls
        kept allow (`_limit`). Calls interleave, so other finished calls past their grace begun
        beside the plan's straddle it: they go too, their messages below the cut with it and
        the rest with a later cut (the stream is trimmed from its head, as a queue, while no
        call kept is in the way). `live_floor`: the lowest floor of the calls the conductor
        holds (None: it holds none; 0: one not known); `read_to`: the conductor has read its
        consumer up to this sequence."""
        going, self._going = self._going, set()
        removable = going | set(self._ready)
        limit = self._limit(removable, live_floor, read_to, now)
        cut = min(limit, max((self._lasts.get(cid, 0) for cid in going), default=0) + 1)
        if cut <= 1:
            return 0, sorted(going), []
        # A call whose floor is not known may have every message above the cut: not cut.
        below = {cid for cid in removable if 0 < self._floors.get(cid, 0) < cut - 1}
        besides = below - going
        if besides:
            self._ready = [cid for cid in self._ready if cid not in besides]
            heapq.heapify(self._ready)
            self._known.difference_update(besides)
        return cut, sorted(going - below), sorted(besides)

    def _limit(self, removable: set[str], live_floor: int | None, read_to: int, now: float) -> int:
        """The highest cut the calls kept (all but `removable`) allow (0: none this round,
        `held_by` says why)."""
        old = self._mark_before(now - HEAD_LAG_S)
        opened = self._mark_before(now - HEAD_LAG_S + OPEN_WITHIN_S)
        if old is None or opened is None:
            self.held_by = f"the stream's size is not known from {HEAD_LAG_S:g} s back yet"
            return 0
        if read_to < opened:  # a call with a message below it may not be known yet
            self.held_by = f"the conductor has read its consumer to {read_to}, not yet to {opened}"
            return 0
        kept = [f for cid, f in self._floors.items() if cid not in removable]  # ending, in their grace
        if live_floor == 0 or 0 in kept:
            self.held_by = "a call whose messages' floor is not known"
            return 0
        self.held_by = ""
        return min([old, *kept, *([live_floor] if live_floor is not None else [])]) + 1
