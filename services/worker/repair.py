"""When a worker reads a call's input from the stream (pure: no I/O, the clock passed in).

Live input reaches a worker through core subscriptions, which miss what is published
before they exist, while a connection is down, or (rarely) in transit. Every item is
also in the stream, numbered, and the stream buffers drop repeats, so a read of the
stream is always safe; this module decides when one is needed and where it starts:

- **Placed.** A call (or another of its partitions) was just placed here and its input
  subscriptions are new: read its input from the start, behind a barrier (the shell
  stores one before reading, so whatever was published before the subscriptions is read).
- **Gap.** An item known to exist (a later one, or the end count, says so) has been
  missing for a whole period: read on from where the last read ended.
- **Stall.** A lost last item or end of stream leaves no gap: a call whose input is
  incomplete and that got nothing for `stall_s` is read again, the wait doubling (up to
  `stall_max_s`) while such reads bring nothing, for clients that are merely idle.
- **Reconnect.** The subscriptions missed whatever was published meanwhile: every call.
- **Paused.** The worker had no room for the call's input (flow control, `flow.py`): it
  stops taking the call's live input, which waits in the stream, and reads it on from
  there at the worker's pace. A read that reaches the end of the stream while the call is
  paused tells the shell to take live input again (`Next.RESUME`): subscribe, store a
  barrier, read on (what was dropped before the barrier is stored before it).

At most one read runs per call: a read of all the call's edges already under way covers
any other reason; one that started before the call gained an edge here does not, and is
replaced by a read from the start. Reads after the first go on from the stream sequence
earlier reads reached (`read_to`): everything stored before it was handed to the
engines, so an item still missing was stored after it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

REPAIR_PERIOD_S = 0.5  # how long an item may be missing before it is read from the stream
STALL_S = 2.0  # no input at all this long, streams not complete: read the stream (a lost end leaves no gap)
STALL_MAX_S = 16.0  # the wait doubles while such reads bring nothing, up to this

Gaps = tuple[tuple[str, int], ...]  # (edge, first missing seq) per edge with a gap


class Why(enum.Enum):
    PLACED = "placed"
    GAP = "gap"
    STALL = "stall"
    RECONNECT = "reconnect"
    PAUSED = "paused"


class Next(enum.Enum):
    """What follows a read that reached the end of the stream."""

    DONE = "done"  # live input covers the rest
    RESUME = "resume"  # the call is paused: take live input again, store a barrier, read on


@dataclass(frozen=True)
class StartRead:
    """Read the call's `edges` from the stream: from the start behind a barrier
    (`from_start`), else after stream sequence `after`. Any read of the call still running
    is cancelled first. `read_id` names it in `read_ended`."""

    cid: str
    read_id: int
    edges: tuple[str, ...]
    from_start: bool
    after: int
    why: Why
    detail: str = ""


@dataclass
class _Call:
    edges: frozenset[str] = frozenset()  # input edges of the call's partitions here
    covered: frozenset[str] = frozenset()  # edges a read from the start (behind a barrier) has covered
    reading: int | None = None  # the running read's id
    read_to: int = 0  # the stream sequence reads of `covered` have read to
    last_input: float = 0.0  # live input, or a stall read, last
    stall_s: float = STALL_S
    paused: bool = False  # live input is not taken: it waits in the stream for the running read


class InputReads:
    """Per worker: fed with the calls' edges, live input, read progress, the engines'
    gaps and the clock; answers with the reads to start."""

    def __init__(self, period_s: float = REPAIR_PERIOD_S, stall_s: float = STALL_S, stall_max_s: float = STALL_MAX_S) -> None:
        self.period_s = period_s  # the shell calls tick() this often
        self.stall_s = stall_s
        self.stall_max_s = stall_max_s
        self._calls: dict[str, _Call] = {}
        self._seen: dict[str, Gaps] = {}  # gaps at the last tick
        self._next_id = 0

    def __contains__(self, cid: str) -> bool:
        return cid in self._calls

    # -- events --------------------------------------------------------------
    def subscribed(self, cid: str, edges: Iterable[str], now: float) -> StartRead | None:
        """The call's partitions here (all of them, old and new) read `edges`, and the
        subscriptions for them are in place: read what the stream holds."""
        call = self._calls.get(cid)
        if call is None:
            call = self._calls[cid] = _Call(last_input=now, stall_s=self.stall_s)
        call.edges = frozenset(edges)
        return self._start(cid, call, Why.PLACED)

    def forget(self, cid: str) -> None:
        self._calls.pop(cid, None)
        self._seen.pop(cid, None)

    def live_input(self, cid: str, now: float) -> None:
        """Live input came for the call: its stall clock starts again, at the shortest wait."""
        call = self._calls.get(cid)
        if call is not None:
            call.last_input, call.stall_s = now, self.stall_s

    def read_progress(self, cid: str, read_id: int, seq: int) -> None:
        """The read handed on everything up to stream sequence `seq`."""
        call = self._calls.get(cid)
        if call is not None and call.reading == read_id:
            call.read_to = seq

    def read_to(self, cid: str) -> int:
        call = self._calls.get(cid)
        return 0 if call is None else call.read_to

    def read_ended(self, cid: str, read_id: int) -> None:
        """The read ended (read to the end, failed or cancelled); a replaced one is ignored."""
        call = self._calls.get(cid)
        if call is not None and call.reading == read_id:
            call.reading = None

    def reading(self, cid: str) -> bool:
        call = self._calls.get(cid)
        return call is not None and call.reading is not None

    def paused(self, cid: str) -> bool:
        """Live input for the call is to be dropped: it waits in the stream (hot path: one lookup)."""
        call = self._calls.get(cid)
        return call is not None and call.paused

    def pause(self, cid: str) -> tuple[bool, StartRead | None]:
        """No room for the call's input: stop taking it live. (Newly paused, and a read from
        where reads reached, unless one runs: it reads on past what is dropped from now.)"""
        call = self._calls.get(cid)
        if call is None or call.paused:
            return False, None
        call.paused = True
        return True, self._start(cid, call, Why.PAUSED)

    def at_end(self, cid: str, read_id: int) -> Next:
        """The read reached the end of what the stream holds. A call never paused since the
        read began took all its live input: done. A paused one resumes (see Next.RESUME)."""
        call = self._calls.get(cid)
        if call is None or call.reading != read_id:
            return Next.DONE
        if call.paused:
            return Next.RESUME
        call.reading = None
        return Next.DONE

    def resumed(self, cid: str, now: float) -> None:
        """Live input is taken again (the shell subscribed; it stores a barrier and reads on)."""
        call = self._calls.get(cid)
        if call is not None:
            call.paused = False
            call.last_input, call.stall_s = now, self.stall_s

    def reconnected(self) -> list[StartRead]:
        return [r for cid, call in self._calls.items() if (r := self._start(cid, call, Why.RECONNECT)) is not None]

    def tick(self, now: float, missing: Mapping[str, Gaps], awaiting: Iterable[str]) -> list[StartRead]:
        """Every `period_s`: `missing` are the engines' gaps per call (the same gaps as at the
        last tick: lost in transit), `awaiting` the calls whose input is not complete."""
        reads = []
        for cid, gaps in missing.items():
            call = self._calls.get(cid)
            if call is None or self._seen.get(cid) != gaps:
                continue
            detail = f"items {gaps} missing for {self.period_s:.1f}s"
            if (r := self._start(cid, call, Why.GAP, detail)) is not None:
                reads.append(r)
        self._seen = dict(missing)
        for cid in set(awaiting):
            call = self._calls.get(cid)
            if call is None or call.reading is not None or now - call.last_input < call.stall_s:
                continue
            detail = f"no input for {now - call.last_input:.1f}s"
            call.last_input, call.stall_s = now, min(2 * call.stall_s, self.stall_max_s)
            if (r := self._start(cid, call, Why.STALL, detail)) is not None:
                reads.append(r)
        return reads

    # -- rules ---------------------------------------------------------------
    def _start(self, cid: str, call: _Call, why: Why, detail: str = "") -> StartRead | None:
        """A read of all the call's edges, unless one is under way (one started before the
        call gained an edge here does not cover that edge's input: it is replaced)."""
        if call.reading is not None and call.edges <= call.covered:
            return None
        from_start = not call.edges <= call.covered  # new subscriptions: from the start, behind a barrier
        if from_start:
            call.read_to = 0
        call.covered = call.edges
        self._next_id += 1
        call.reading = self._next_id
        return StartRead(cid, self._next_id, tuple(sorted(call.edges)), from_start, call.read_to, why, detail)
