"""When a worker reads a call's input from the stream (pure: no I/O, the clock passed in).

Live input reaches a worker through core subscriptions, which miss what is published
before they exist, while a connection is down, or (rarely) in transit. Every item is
also in the stream, numbered, and the stream buffers drop repeats, so a read of the
stream is always safe; this module decides when one is needed and where it starts.

The unit is one partition of one call on this worker (its input edges): each takes its
input, and is read, at its own pace, so a partition that falls behind does not hold up
the call's other partitions here.

- **Placed.** A call's partition was just placed here and its input subscriptions are
  new: read its input from the start, behind a barrier (the shell stores one before
  reading, so whatever was published before the subscriptions is read).
- **Gap.** An item known to exist (a later one, or the end count, says so) has been
  missing for a whole period: read on from where the last read ended (the shell bounds
  the read by a barrier it stores first, as at placement).
- **Stall.** A lost last item or end of stream leaves no gap: a partition whose input is
  incomplete and that got nothing for `stall_s` is read again, the wait doubling (up to
  `stall_max_s`) while such reads bring nothing, for clients that are merely idle. Only
  input that can be lost is read so (`may_lose`): input that comes over the bus, or any
  input of a paused partition. Edges produced by the call's partitions on this worker are
  handed over in the process; a partition waiting on one of them that is behind is not
  stalled, and a read would only bring again what it already has.
- **Reconnect.** The subscriptions missed whatever was published meanwhile: every unit.
- **Paused.** The worker had no room for the partition's input (flow control, `flow.py`):
  it stops taking its live input, which waits in the stream, and reads it on from there
  at the worker's pace. A read that reaches the end of the stream while the unit is
  paused tells the shell to take live input again (`Next.RESUME`): subscribe, store a
  barrier, read on (what was dropped before the barrier is stored before it).

At most one read runs per unit, and it covers any other reason to read. Reads after the
first go on from the stream sequence earlier reads reached (`read_to`): everything stored
before it was handed to the engine, so an item still missing was stored after it.

The first read starts at the call's open (`floor`: the frontend publishes the open before the
call's input, on one connection, so the call's messages are stored after it), not at the
stream's start: a direct get of a subject from sequence 1 costs the server several times
one from near its messages, and an open storm makes hundreds. Should an item all the same
have been stored before the open (the open's store lost and sent again after the first
appends), gap reads from where reads reached cannot find it: once a unit's gap reads have
ended `DEEP_AFTER` times with the same gaps, its next one reads from the stream's start.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

REPAIR_PERIOD_S = 0.5  # how long an item may be missing before it is read from the stream
STALL_S = 2.0  # no input at all this long, streams not complete: read the stream (a lost end leaves no gap)
STALL_MAX_S = 16.0  # the wait doubles while such reads bring nothing, up to this
DEEP_AFTER = 3  # gap reads ended with the same gaps: the next reads from the stream's start

Unit = tuple[str, str]  # (call id, partition)
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
    RESUME = "resume"  # the unit is paused: take live input again, store a barrier, read on


@dataclass(frozen=True)
class StartRead:
    """Read the unit's `edges` from the stream: from the start behind a barrier
    (`from_start`), else after stream sequence `after`. `read_id` names it in the
    progress and end reports."""

    cid: str
    partition: str
    read_id: int
    edges: tuple[str, ...]
    from_start: bool
    after: int
    why: Why
    detail: str = ""


@dataclass
class _Unit:
    edges: tuple[str, ...]
    last_input: float  # live input, or a stall read, last
    stall_s: float
    placed: bool = False  # its read from the start (behind a barrier) has begun
    reading: int | None = None  # the running read's id
    read_to: int = 0  # the stream sequence its reads have read to
    paused: bool = False  # live input is not taken: it waits in the stream for the running read
    floor: int = 0  # where its first read started (the call's open): nothing of it is stored before
    gap_reads: tuple[Gaps, int] = ((), 0)  # the gaps its last gap reads were for, and how many ended so


class InputReads:
    """Per worker: fed with the units' edges, live input, read progress, the engines'
    gaps and the clock; answers with the reads to start."""

    def __init__(
        self,
        period_s: float = REPAIR_PERIOD_S,
        stall_s: float = STALL_S,
        stall_max_s: float = STALL_MAX_S,
        produced_by: Mapping[str, str] | None = None,
    ) -> None:
        self.period_s = period_s  # the shell calls tick() this often
        self.stall_s = stall_s
        self.stall_max_s = stall_max_s
        # edge -> the partition that produces it (the topology); an edge not in it comes over the bus
        self._produced_by = dict(produced_by or {})
        self._calls: dict[str, dict[str, _Unit]] = {}  # cid -> partition -> unit
        self._seen: dict[Unit, Gaps] = {}  # gaps at the last tick
        self._next_id = 0

    def __contains__(self, cid: str) -> bool:
        return cid in self._calls

    def _unit(self, cid: str, partition: str) -> _Unit | None:
        units = self._calls.get(cid)
        return None if units is None else units.get(partition)

    # -- events --------------------------------------------------------------
    def subscribed(self, cid: str, partition: str, edges: Iterable[str], now: float, floor: int = 0) -> StartRead | None:
        """The call's `partition` was placed here (it reads `edges`) and its subscriptions
        are in place: read what the stream holds after sequence `floor` (the call's open less
        one; 0: the whole stream). None for a unit already here."""
        units = self._calls.setdefault(cid, {})
        if partition in units:
            return None
        unit = units[partition] = _Unit(tuple(sorted(edges)), last_input=now, stall_s=self.stall_s, read_to=floor, floor=floor)
        return self._start(cid, partition, unit, Why.PLACED)

    def forget(self, cid: str) -> None:
        """The call ended here: all its units go."""
        self._calls.pop(cid, None)
        for unit in [u for u in self._seen if u[0] == cid]:
            del self._seen[unit]

    def live_input(self, cid: str, partition: str, now: float) -> None:
        """Live input came for the unit: its stall clock starts again, at the shortest wait."""
        unit = self._unit(cid, partition)
        if unit is not None:
            unit.last_input, unit.stall_s = now, self.stall_s

    def read_progress(self, cid: str, partition: str, read_id: int, seq: int) -> None:
        """The read handed on everything up to stream sequence `seq`."""
        unit = self._unit(cid, partition)
        if unit is not None and unit.reading == read_id:
            unit.read_to = seq

    def read_to(self, cid: str, partition: str) -> int:
        unit = self._unit(cid, partition)
        return 0 if unit is None else unit.read_to

    def read_ended(self, cid: str, partition: str, read_id: int) -> None:
        """The read ended (read to the end, failed or cancelled); an older one is ignored."""
        unit = self._unit(cid, partition)
        if unit is not None and unit.reading == read_id:
            unit.reading = None

    def reading(self, cid: str, partition: str) -> bool:
        unit = self._unit(cid, partition)
        return unit is not None and unit.reading is not None

    def paused(self, cid: str, partition: str) -> bool:
        """Live input for the unit is to be dropped: it waits in the stream (hot path)."""
        unit = self._unit(cid, partition)
        return unit is not None and unit.paused

    def pause(self, cid: str, partition: str) -> tuple[bool, StartRead | None]:
        """No room for the unit's input: stop taking it live. (Newly paused, and a read from
        where reads reached, unless one runs: it reads on past what is dropped from now.)"""
        unit = self._unit(cid, partition)
        if unit is None or unit.paused:
            return False, None
        unit.paused = True
        return True, self._start(cid, partition, unit, Why.PAUSED)

    def at_end(self, cid: str, partition: str, read_id: int) -> Next:
        """The read reached the end of what the stream holds. A unit never paused since the
        read began took all its live input: done. A paused one resumes (see Next.RESUME)."""
        unit = self._unit(cid, partition)
        if unit is None or unit.reading != read_id:
            return Next.DONE
        if unit.paused:
            return Next.RESUME
        unit.reading = None
        return Next.DONE

    def resumed(self, cid: str, partition: str, now: float) -> None:
        """Live input is taken again (the shell subscribed; it stores a barrier and reads on)."""
        unit = self._unit(cid, partition)
        if unit is not None:
            unit.paused = False
            unit.last_input, unit.stall_s = now, self.stall_s

    def may_lose(self, cid: str, partition: str) -> bool:
        """Whether input of the unit can be lost on its way here (so a stall read may find it):
        some of its edges come over the bus (not produced by one of the call's partitions on
        this worker), or it is paused (its live input is left in the stream)."""
        unit = self._unit(cid, partition)
        if unit is None:
            return False
        if unit.paused:
            return True
        here = self._calls[cid]
        return any(self._produced_by.get(e) not in here for e in unit.edges)

    def reconnected(self) -> list[StartRead]:
        reads = []
        for cid, units in self._calls.items():
            for partition, unit in units.items():
                if (r := self._start(cid, partition, unit, Why.RECONNECT)) is not None:
                    reads.append(r)
        return reads

    def tick(self, now: float, missing: Mapping[Unit, Gaps], awaiting: Iterable[Unit]) -> list[StartRead]:
        """Every `period_s`: `missing` are the engines' gaps per unit (the same gaps as at the
        last tick: lost in transit), `awaiting` the units whose input is not complete (of
        those, a stall reads only what may be lost: `may_lose`)."""
        reads = []
        for (cid, partition), gaps in missing.items():
            unit = self._unit(cid, partition)
            if unit is None or self._seen.get((cid, partition)) != gaps or unit.reading is not None:
                continue
            detail = f"items {gaps} missing for {self.period_s:.1f}s"
            self._deepen(unit, gaps)
            if (r := self._start(cid, partition, unit, Why.GAP, detail)) is not None:
                reads.append(r)
        self._seen = dict(missing)
        for cid, partition in set(awaiting):
            unit = self._unit(cid, partition)
            if unit is None or unit.reading is not None or now - unit.last_input < unit.stall_s:
                continue
            if not self.may_lose(cid, partition):
                continue
            detail = f"no input for {now - unit.last_input:.1f}s"
            unit.last_input, unit.stall_s = now, min(2 * unit.stall_s, self.stall_max_s)
            if (r := self._start(cid, partition, unit, Why.STALL, detail)) is not None:
                reads.append(r)
        return reads

    # -- rules ---------------------------------------------------------------
    @staticmethod
    def _deepen(unit: _Unit, gaps: Gaps) -> None:
        """Count the gap reads that ended with these gaps; after DEEP_AFTER, read from the
        stream's start once (see the module's docstring)."""
        last, ended = unit.gap_reads
        ended = ended + 1 if last == gaps else 0
        unit.gap_reads = (gaps, ended)
        if ended >= DEEP_AFTER and unit.floor:
            unit.floor = unit.read_to = 0

    def _start(self, cid: str, partition: str, unit: _Unit, why: Why, detail: str = "") -> StartRead | None:
        """A read of the unit's edges, unless one is under way (it covers this one)."""
        if unit.reading is not None:
            return None
        from_start = not unit.placed  # its first: from the start, behind a barrier
        unit.placed = True
        self._next_id += 1
        unit.reading = self._next_id
        return StartRead(cid, partition, self._next_id, unit.edges, from_start, unit.read_to, why, detail)
