"""The conductor's pure core: admission, placement, end-of-input and completion.

`Conductor.handle(event) -> actions`, no I/O. The service turns bus messages and
timer ticks into events and carries out the actions. It never sees a data
message (I-1): only opens, ends of input, dones, aborts, assignment results and
liveness.
"""

from __future__ import annotations

import enum
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.bus import wire
from shared.runtime.config import ServingConfig
from shared.runtime.states import checked

KWARGS_INLINE_MAX = 64 * 1024  # larger model_kwargs are read by workers from the call's open message
# Calls ended (or aborted before their open came) that are remembered, so that an open read
# again (redelivered after ack_wait, its ack lost) or read after its abort is not placed.
# Bounded: past it the oldest go, and the frontends' heartbeats end what slips through.
ENDED_MAX = 32_768
# Consecutive listed heartbeats of its frontend, each built after the call was taken, that
# must leave a call out before the conductor ends it: one proves the frontend let it go; the
# second leaves the frontend's own abort, published just after, the time to arrive first.
UNHELD_BEATS = 2
FRONTENDS_MAX = 10_000  # frontends whose last listing (or loss) is kept, the oldest dropped past it

# A worker's refusals that say it takes no new call now (it is draining after a SIGTERM, or
# full), not that the call is at fault: the conductor's view of it was late, and the call is
# placed on another worker. Worded so by services/worker/assignment.py (a test holds the two
# to each other); the text, not a field, because a worker of the release before speaks only
# the text, and a rolling upgrade mixes the two.
BUSY_REFUSAL = re.compile(r"^worker is shutting down$|^worker \S+ is full \(")


def busy_refusal(error: str | None) -> bool:
    """Whether a refused assignment may be tried on another worker (see BUSY_REFUSAL)."""
    return error is not None and BUSY_REFUSAL.search(error) is not None


class CallState(enum.Enum):
    QUEUED = "queued"  # a one-shot waiting for a slot; its input waits in JetStream (I-2)
    WAITING = "waiting"  # admitted, but no worker serves a partition yet (start-up); input waits in JetStream
    PLACING = "placing"  # assignments sent, not all acknowledged
    RUNNING = "running"
    INPUT_ENDED = "input_ended"  # every client stream ended; waiting for the partitions
    FINISHED = "finished"


_TRANSITIONS: dict[CallState, set[CallState]] = {
    CallState.QUEUED: {CallState.PLACING, CallState.WAITING, CallState.FINISHED},
    CallState.WAITING: {CallState.PLACING, CallState.FINISHED},
    CallState.PLACING: {CallState.RUNNING, CallState.INPUT_ENDED, CallState.WAITING, CallState.FINISHED},
    CallState.RUNNING: {CallState.INPUT_ENDED, CallState.PLACING, CallState.WAITING, CallState.FINISHED},
    CallState.INPUT_ENDED: {CallState.PLACING, CallState.WAITING, CallState.FINISHED},
    CallState.FINISHED: set(),
}


# -- events ------------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    msg: wire.Open
    now: float
    seq: int = 0  # the open's stream sequence (0: not known)


@dataclass(frozen=True)
class InputEnded:
    cid: str
    edge: str
    total: int


@dataclass(frozen=True)
class PartitionDone:
    cid: str
    msg: wire.Done


@dataclass(frozen=True)
class AbortRequested:
    cid: str
    reason: str
    status: int


@dataclass(frozen=True)
class AssignResult:
    cid: str
    worker_id: str
    partitions: tuple[str, ...]
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class WorkerSeen:
    hb: wire.WorkerHeartbeat


@dataclass(frozen=True)
class WorkerLost:
    worker_id: str


@dataclass(frozen=True)
class FrontendLost:
    frontend_id: str


@dataclass(frozen=True)
class FrontendSeen:
    """A new heartbeat of a frontend (not one replayed by a watch made again)."""

    hb: wire.FrontendHeartbeat


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class StreamFull:
    """The stream holds retention.hard_max_bytes or more (full) or has come back under it."""

    full: bool


Event = (
    Opened | InputEnded | PartitionDone | AbortRequested | AssignResult
    | WorkerSeen | WorkerLost | FrontendLost | FrontendSeen | Tick | StreamFull
)  # fmt: skip


# -- actions -----------------------------------------------------------------
@dataclass(frozen=True)
class SendAssign:
    worker_id: str
    msg: wire.Assign


@dataclass(frozen=True)
class PublishFin:
    cid: str
    msg: wire.Fin
    request_id: str
    request_id_revision: int = 0
    floor: int = 0  # the call's read_after: its messages are above it (retention.py)


@dataclass(frozen=True)
class PublishAbort:
    cid: str
    msg: wire.Abort


@dataclass(frozen=True)
class SaveRecord:
    record: wire.CallRecord


@dataclass(frozen=True)
class DeleteRecord:
    cid: str


Action = SendAssign | PublishFin | PublishAbort | SaveRecord | DeleteRecord


def coalesce(actions: list[Action]) -> list[Action]:
    """The actions of a batch of events, in order, with each call's record written once: its
    last SaveRecord or DeleteRecord, where it stood, the earlier ones dropped (a KV key holds
    its last write; the batch's messages are acknowledged only once its writes are stored, so
    a conductor that stops before has every event of the batch again). A call's end whose
    end of input and dones come in one fetch then costs its record one delete instead of two
    puts and a delete; an open storm's batch, one put per call as before."""
    last: dict[str, int] = {}
    for i, a in enumerate(actions):
        if isinstance(a, SaveRecord):
            last[a.record.cid] = i
        elif isinstance(a, DeleteRecord):
            last[a.cid] = i
    return [
        a
        for i, a in enumerate(actions)
        if not isinstance(a, SaveRecord | DeleteRecord) or last[a.record.cid if isinstance(a, SaveRecord) else a.cid] == i
    ]


@dataclass
class Worker:
    worker_id: str
    model: str
    partitions: list[str]
    capacity: int
    load: int  # as last reported
    calls: set[str] = field(default_factory=set)  # placed here by this conductor (one slot per call)

    @property
    def free(self) -> int:
        # The report lags placements; our own count lags nothing we placed.
        return self.capacity - max(self.load, len(self.calls))


@dataclass
class Call:
    cid: str
    request_id: str
    model: str
    frontend_id: str
    live: bool
    created: float
    model_kwargs: dict[str, Any]
    partitions: list[str]
    open_streams: set[str]
    state: CallState = CallState.QUEUED
    placement: dict[str, str] = field(default_factory=dict)  # partition -> worker
    acked: set[str] = field(default_factory=set)  # partitions whose assignment was acknowledged
    done: dict[str, int] = field(default_factory=dict)  # partition -> outputs
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)  # partition -> what it reported
    waiting_since: float = 0.0
    request_id_revision: int = 0
    frontend_beat: int = 0  # the open's: the frontend's heartbeats numbered above it list the call while it holds it
    unheld: int = 0  # its frontend's listed heartbeats in a row, since it took the call, that left it out
    kwargs_in_open: bool = False  # large kwargs stay in the open message, not in records or assignments
    binary: bool = False  # its client reads msgpack: its workers publish its outputs packed
    moves: int = 0  # how often it moved to another frontend (`frontend_id` is the latest; `FrontendSeen`)
    read_after: int = 0  # nothing of it is stored at or before this stream sequence (wire.Open.read_after)
    # Workers that refused this placement as busy (draining, full): not asked again until the
    # call is placed, so a placement asks each worker at most once. Not saved: a restored
    # call is taken as placed.
    refused_by: set[str] = field(default_factory=set)

    def move(self, to: CallState) -> None:
        self.state = checked(f"call {self.cid}", self.state, to, _TRANSITIONS)

    @classmethod
    def from_record(cls, r: wire.CallRecord) -> Call:
        """The call as a record saved it (record() is the other way)."""
        return cls(
            cid=r.cid,
            request_id=r.request_id,
            model=r.model,
            frontend_id=r.frontend_id,
            live=r.live,
            created=r.created,
            request_id_revision=r.request_id_revision,
            frontend_beat=r.frontend_beat,
            model_kwargs=dict(r.model_kwargs),
            kwargs_in_open=r.kwargs_in_open,
            binary=r.binary,
            moves=r.moves,
            read_after=r.read_after,
            partitions=list(r.partitions),
            open_streams=set(r.open_streams),
            state=CallState(r.state),
            placement=dict(r.placement),
            done=dict(r.done),
            usage={p: dict(u) for p, u in r.usage.items() if isinstance(u, dict)},
        )

    def record(self) -> wire.CallRecord:
        return wire.CallRecord(
            cid=self.cid,
            request_id=self.request_id,
            model=self.model,
            frontend_id=self.frontend_id,
            state=self.state.value,
            live=self.live,
            created=self.created,
            request_id_revision=self.request_id_revision,
            frontend_beat=self.frontend_beat,
            model_kwargs={} if self.kwargs_in_open else self.model_kwargs,
            kwargs_in_open=self.kwargs_in_open,
            binary=self.binary,
            moves=self.moves,
            read_after=self.read_after,
            partitions=list(self.partitions),
            open_streams=sorted(self.open_streams),
            placement=dict(self.placement),
            done=dict(self.done),
            usage={p: dict(u) for p, u in self.usage.items()},
        )


@dataclass(frozen=True)
class Listing:
    """A frontend's latest listed heartbeat: the calls it held when it built heartbeat `beat`."""

    beat: int
    calls: frozenset[str]


LET_GO = "the frontend no longer holds the call"
LOST = "frontend lost"


def _ended_as(status: int) -> str:
    """The fin's reason for a call ended with `status` before it completed."""
    return "aborted" if status == 499 else "error"


def merge_usage(by_partition: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One usage for the call, merged by meaning: partitions of one call that report the same
    key count the same thing from their own side (the listener's turns and the talker's are
    the same turns), so a number is the largest any partition reported, not their sum; any
    other value is the first partition's (in partition name order). Each partition's own
    figures stay in the finish's usage_by_partition."""
    merged: dict[str, Any] = {}
    for partition in sorted(by_partition):
        for k, v in by_partition[partition].items():
            if k not in merged:
                merged[k] = v
            elif isinstance(v, int | float) and isinstance(merged[k], int | float):
                merged[k] = max(merged[k], v)
    return merged


class Conductor:
    """Admission, placement and completion for every call. Pure: no I/O, time comes in events."""

    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        # model -> its partitions, learnt from worker heartbeats: the conductor loads no model code.
        self.partitions_of: dict[str, list[str]] = {}
        self.calls: dict[str, Call] = {}
        self.queue: deque[str] = deque()
        self.workers: dict[str, Worker] = {}
        self.clock = 0.0  # the latest time an event brought
        self.stream_full = False  # past retention.hard_max_bytes: new calls are refused, live ones go on
        # Reconciliation with the frontends (docs/design.md): what each one's latest listed
        # heartbeat says it holds; None for one lost, which holds nothing until it beats again.
        self.listings: OrderedDict[str, Listing | None] = OrderedDict()
        # cid -> None: the call ended here (its fin is out); or the abort read before its open.
        self.ended: OrderedDict[str, AbortRequested | None] = OrderedDict()

    # -- queries -------------------------------------------------------------
    @property
    def active(self) -> int:
        """Calls holding a slot: every call but the queued ones (asked for on every open and
        heartbeat, so counted, not scanned)."""
        return len(self.calls) - len(self.queue)

    def handle(self, ev: Event) -> list[Action]:
        if isinstance(ev, Opened | Tick):
            self.clock = max(self.clock, ev.now)
        match ev:
            case Opened():
                return self._opened(ev)
            case InputEnded():
                return self._input_ended(ev)
            case PartitionDone():
                return self._done(ev)
            case AbortRequested():
                if ev.cid not in self.calls and ev.cid not in self.ended:
                    # Its open is not read yet (delivered again after this, say): it is never placed.
                    self._remember_end(ev.cid, ev)
                    return []
                return self._abort(ev.cid, ev.reason, ev.status, notify_workers=False)
            case AssignResult():
                return self._assign_result(ev)
            case WorkerSeen():
                return self._worker_seen(ev.hb)
            case WorkerLost():
                return self._worker_lost(ev.worker_id)
            case FrontendLost():
                self._list(ev.frontend_id, None)
                cids = [c.cid for c in self.calls.values() if c.frontend_id == ev.frontend_id]
                return [a for cid in cids for a in self._abort(cid, LOST, 499, notify_workers=True)]
            case FrontendSeen():
                return self._frontend_seen(ev.hb)
            case Tick():
                return self._tick(ev.now)
            case StreamFull():
                self.stream_full = ev.full
                return []
        raise TypeError(f"unknown event {ev!r}")

    # -- admission -----------------------------------------------------------
    def _opened(self, ev: Opened) -> list[Action]:
        m = ev.msg
        if m.cid in self.calls:
            return []  # redelivered open
        if m.cid in self.ended and self.ended[m.cid] is None:
            return []  # the call ended here already: its open read again (its ack was lost)
        call = Call(
            cid=m.cid,
            request_id=m.request_id,
            model=m.model,
            frontend_id=m.frontend_id,
            live=m.live,
            created=ev.now,
            request_id_revision=m.request_id_revision,
            model_kwargs=dict(m.model_kwargs),
            kwargs_in_open=len(msgspec.msgpack.encode(m.model_kwargs)) > KWARGS_INLINE_MAX,
            partitions=list(self.partitions_of.get(m.model, [])),  # known once a worker of the model is seen
            open_streams=set(m.open_streams),
            frontend_beat=m.frontend_beat,
            binary=m.binary,
            # Below its open's own sequence, or not known: a stream made again since the frontend
            # saw it (its sequences start over) gives no floor.
            read_after=m.read_after if 0 < m.read_after < ev.seq else 0,
        )
        early = self.ended.get(m.cid)
        if early is not None:  # its abort was read first: the abort wins, the call is never placed
            return [self._fin_msg(call, early.status, _ended_as(early.status), early.reason)]
        gone = self._let_go(m)
        if gone is not None:
            return [self._fin_msg(call, 499, "aborted", gone)]
        if self.stream_full:
            hard = self.config.retention.refuse_above_bytes
            return [self._fin_msg(call, 503, "overloaded", f"the stream is full (retention.hard_max_bytes, {hard} bytes)")]
        if self.active >= self.config.max_concurrent_requests:
            if call.live:
                return [self._fin_msg(call, 503, "overloaded", "max_concurrent_requests reached")]
            if len(self.queue) >= self.config.max_queued_requests:
                return [self._fin_msg(call, 503, "overloaded", "max_queued_requests reached")]
            self.calls[call.cid] = call
            self.queue.append(call.cid)
            return [SaveRecord(call.record())]
        self.calls[call.cid] = call
        return self._place(call, now=ev.now)

    def _let_go(self, m: wire.Open) -> str | None:
        """Why the call's frontend holds it no more, as its latest listing says (None: it may)."""
        if m.frontend_id not in self.listings:
            return None
        listing = self.listings[m.frontend_id]
        if listing is None:
            return LOST
        if listing.beat > m.frontend_beat and m.cid not in listing.calls:  # built after it took the call
            return LET_GO
        return None

    def _place(self, call: Call, only: list[str] | None = None, now: float | None = None) -> list[Action]:
        """Each partition on the live worker with the most free slots.

        Where no worker serves a partition at all (services still starting, or the
        only one died), the call waits up to placement_timeout_s for one; where
        workers exist but all are full, it is refused at once.
        """
        if not call.partitions:
            call.partitions = list(self.partitions_of.get(call.model, []))
        wanted = only or [p for p in call.partitions if p not in call.done]
        if not wanted:
            return self._wait(call, now)
        chosen: dict[str, str] = {}
        taken: list[Worker] = []  # slots taken in this round, given back if the round fails
        for p in wanted:
            serving = [w for w in self.workers.values() if w.model == call.model and p in w.partitions]
            # A worker already running another partition of this call needs no second slot.
            candidates = [w for w in serving if (call.cid in w.calls or w.free > 0) and w.worker_id not in call.refused_by]
            if not serving or not candidates:
                for t in taken:
                    t.calls.discard(call.cid)
                if not serving:
                    return self._wait(call, now)
                return self._finish(call, 503, "overloaded", f"no worker can take partition {p!r} of {call.model!r}")
            best = max(candidates, key=lambda w: (call.cid in w.calls, w.free, w.worker_id))
            if call.cid not in best.calls:
                best.calls.add(call.cid)
                taken.append(best)
            chosen[p] = best.worker_id
        if call.state is not CallState.PLACING:
            call.move(CallState.PLACING)
        by_worker: dict[str, list[str]] = {}
        for p, w in chosen.items():
            call.placement[p] = w
            call.acked.discard(p)
            by_worker.setdefault(w, []).append(p)
        actions: list[Action] = [SaveRecord(call.record())]
        for w, parts in by_worker.items():
            actions.append(
                SendAssign(
                    w,
                    wire.Assign(
                        cid=call.cid,
                        model=call.model,
                        partitions=parts,
                        model_kwargs={} if call.kwargs_in_open else call.model_kwargs,
                        kwargs_in_open=call.kwargs_in_open,
                        binary=call.binary,
                        read_after=call.read_after,
                    ),
                )
            )
        return actions

    def _wait(self, call: Call, now: float | None) -> list[Action]:
        """Saved only when it starts waiting: a waiting call is tried again on every new worker
        (of any model), and a try that changes nothing writes nothing."""
        if call.state is CallState.WAITING:
            return []
        call.move(CallState.WAITING)
        call.waiting_since = now if now is not None else self.clock
        return [SaveRecord(call.record())]

    def _assign_result(self, ev: AssignResult) -> list[Action]:
        call = self.calls.get(ev.cid)
        if call is None or call.state is CallState.FINISHED:
            return []
        if not ev.ok:
            if not any(call.placement.get(p) == ev.worker_id for p in ev.partitions):
                return []  # placed elsewhere since (that worker was lost): its refusal is old news
            if busy_refusal(ev.error):
                return self._place_elsewhere(call, ev)
            return self._abort(call.cid, f"worker {ev.worker_id} refused the call: {ev.error}", 503, notify_workers=True)
        call.acked.update(p for p in ev.partitions if call.placement.get(p) == ev.worker_id)
        if call.state is CallState.PLACING and call.acked >= set(call.partitions):
            call.refused_by.clear()  # placed: a later placement (a worker lost) may ask them again
            # Not saved: the record already holds the placement, and a restored PLACING call is
            # taken as placed (restore), which is what this state says.
            call.move(CallState.INPUT_ENDED if not call.open_streams else CallState.RUNNING)
        return []

    def _place_elsewhere(self, call: Call, ev: AssignResult) -> list[Action]:
        """A worker refused as busy: it took nothing, so the partitions it was asked for go to
        another worker, by the usual placement (none serving: the call waits; none free: 503)."""
        refused = [p for p in ev.partitions if call.placement.get(p) == ev.worker_id and p not in call.acked]
        if not refused:
            return []
        call.refused_by.add(ev.worker_id)
        worker = self.workers.get(ev.worker_id)
        if worker is not None:
            # No call goes there until its next heartbeat says what it takes (a draining
            # worker's says nothing, a full one's its load).
            worker.capacity = 0
            if not any(w == ev.worker_id for p, w in call.placement.items() if p not in refused):
                worker.calls.discard(call.cid)  # the slot taken for this call is not held
        for p in refused:
            del call.placement[p]
        return self._place(call, only=refused)

    # -- progress ------------------------------------------------------------
    def _input_ended(self, ev: InputEnded) -> list[Action]:
        call = self.calls.get(ev.cid)
        if call is None or ev.edge not in call.open_streams:
            return []
        call.open_streams.discard(ev.edge)
        if not call.open_streams and call.state is CallState.RUNNING:
            call.move(CallState.INPUT_ENDED)
        return [SaveRecord(call.record())]

    def _done(self, ev: PartitionDone) -> list[Action]:
        call = self.calls.get(ev.cid)
        if call is None or ev.msg.partition in call.done:
            return []
        call.done[ev.msg.partition] = ev.msg.outputs
        call.usage[ev.msg.partition] = dict(ev.msg.usage)
        if set(call.done) >= set(call.partitions):
            return self._finish(call, 200, "completed", None)
        return [SaveRecord(call.record())]

    def _abort(self, cid: str, reason: str, status: int, notify_workers: bool) -> list[Action]:
        call = self.calls.get(cid)
        if call is None or call.state is CallState.FINISHED:
            return []
        actions: list[Action] = []
        if notify_workers:
            actions.append(PublishAbort(cid, wire.Abort(reason=reason, status=status)))
        return actions + self._finish(call, status, _ended_as(status), reason)

    def _finish(self, call: Call, status: int, reason: str, error: str | None) -> list[Action]:
        was_queued = call.cid in self.queue
        call.move(CallState.FINISHED)
        del self.calls[call.cid]
        self._remember_end(call.cid, None)
        if was_queued:
            self.queue.remove(call.cid)
        # The slot is free now, not at the worker's next heartbeat: a queued one-shot admitted
        # into it must not find its worker still "full" (a worker counts one per call).
        for w in set(call.placement.values()):
            worker = self.workers.get(w)
            if worker is None or call.cid not in worker.calls:
                continue
            worker.calls.discard(call.cid)
            if any(call.placement[p] == w for p in call.acked) and worker.load > 0:
                worker.load -= 1
        fin = wire.Fin(
            status=status,
            reason=reason,
            usage=merge_usage(call.usage),
            usage_by_partition={p: dict(u) for p, u in call.usage.items()},
            error=error,
            outputs=call.done,
        )
        actions: list[Action] = [
            PublishFin(call.cid, fin, call.request_id, call.request_id_revision, call.read_after),
            DeleteRecord(call.cid),
        ]
        if not was_queued:
            actions.extend(self._admit_queued())
        return actions

    def _admit_queued(self) -> list[Action]:
        actions: list[Action] = []
        while self.queue and self.active < self.config.max_concurrent_requests:
            call = self.calls[self.queue.popleft()]
            actions.extend(self._place(call))
        return actions

    def _fin_msg(self, call: Call, status: int, reason: str, error: str) -> PublishFin:
        """The fin of a call refused at its open (never placed)."""
        self._remember_end(call.cid, None)
        fin = wire.Fin(status=status, reason=reason, error=error)
        return PublishFin(call.cid, fin, call.request_id, call.request_id_revision, call.read_after)

    def _remember_end(self, cid: str, early: AbortRequested | None) -> None:
        self.ended[cid] = early
        self.ended.move_to_end(cid)
        while len(self.ended) > ENDED_MAX:
            self.ended.popitem(last=False)

    # -- reconciliation with the frontends -------------------------------------
    def _list(self, frontend_id: str, listing: Listing | None) -> None:
        self.listings[frontend_id] = listing
        self.listings.move_to_end(frontend_id)
        while len(self.listings) > FRONTENDS_MAX:
            self.listings.popitem(last=False)

    def _frontend_seen(self, hb: wire.FrontendHeartbeat) -> list[Action]:
        """A frontend's heartbeat lists the calls it holds: each of its calls that
        UNHELD_BEATS listings in a row, built after it took the call, leave out is let go
        there (its abort lost, or read before its open), and ended here. A call it lists as
        adopted with more moves than the call has here moved to it (a realtime session resumed
        there): it is the call's frontend from now on, its listings built from this one on
        say whether it holds the call, and the frontend that let it go is no longer asked."""
        fid = hb.frontend_id
        if fid in self.listings and self.listings[fid] is None:
            del self.listings[fid]  # lost, and beating again: it holds what it lists from now on
        last = self.listings.get(fid)
        if hb.calls is None or (last is not None and hb.beat <= last.beat):
            return []  # not listed (a 1.1 frontend, or one holding more than it lists), or older than the one kept
        listing = Listing(hb.beat, frozenset(hb.calls))
        self._list(fid, listing)
        actions: list[Action] = []
        for cid, moves in hb.adopted.items():
            moved = self.calls.get(cid)
            if moved is not None and moves > moved.moves and cid in listing.calls:
                moved.frontend_id, moved.moves = fid, moves
                moved.frontend_beat, moved.unheld = hb.beat - 1, 0  # this listing is built after it took the call
                actions.append(SaveRecord(moved.record()))
        for call in [c for c in self.calls.values() if c.frontend_id == fid]:
            if call.cid in listing.calls:
                call.unheld = 0
            elif hb.beat > call.frontend_beat:
                call.unheld += 1
                if call.unheld >= UNHELD_BEATS:
                    actions.extend(self._abort(call.cid, LET_GO, 499, notify_workers=True))
        return actions

    # -- liveness ------------------------------------------------------------
    def _worker_seen(self, hb: wire.WorkerHeartbeat) -> list[Action]:
        self.partitions_of[hb.model] = list(hb.model_partitions)
        w = self.workers.get(hb.worker_id)
        if w is None:
            placed = {c.cid for c in self.calls.values() if hb.worker_id in c.placement.values()}  # after a restore
            self.workers[hb.worker_id] = Worker(hb.worker_id, hb.model, list(hb.partitions), hb.capacity, hb.load, placed)
            return self._retry_waiting() + self._admit_queued()
        w.capacity, w.load = hb.capacity, hb.load
        return self._admit_queued()

    def _retry_waiting(self) -> list[Action]:
        actions: list[Action] = []
        for call in [c for c in self.calls.values() if c.state is CallState.WAITING]:
            actions.extend(self._place(call))
        return actions

    def _worker_lost(self, worker_id: str) -> list[Action]:
        """Re-place the lost worker's partitions: their input is still in the stream,
        so the new worker replays it from the start (outputs are deduplicated by seq)."""
        if self.workers.pop(worker_id, None) is None:
            return []
        actions: list[Action] = []
        for call in list(self.calls.values()):
            lost = [p for p, w in call.placement.items() if w == worker_id and p not in call.done]
            if lost and call.state is not CallState.FINISHED:
                actions.extend(self._place(call, only=lost))
        return actions

    def _tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        limit = self.config.max_call_duration_s
        wait = self.config.placement_timeout_s
        for call in list(self.calls.values()):
            if call.state is CallState.WAITING and now - call.waiting_since > wait:
                msg = f"no worker serves {call.model!r} (waited {wait:g}s, placement_timeout_s)"
                actions.extend(self._abort(call.cid, msg, 503, notify_workers=True))
            elif now - call.created > limit:  # queued one-shots too: a queue wait is not forever
                actions.extend(self._abort(call.cid, f"max_call_duration_s ({limit:g}s) exceeded", 408, notify_workers=True))
        return actions

    # -- recovery ------------------------------------------------------------
    def floor(self) -> int | None:
        """The lowest `read_after` of the calls held (0: one not known; None: none held): none
        of their messages is at or below it (retention.py cuts the stream's head only below)."""
        return min((c.read_after for c in self.calls.values()), default=None)

    def restore(self, records: list[wire.CallRecord]) -> None:
        """Rebuild state from the KV records after a restart."""
        for r in sorted(records, key=lambda r: r.created):
            call = Call.from_record(r)
            if call.state is not CallState.QUEUED:
                call.acked = set(call.placement)
                if call.state is CallState.PLACING:
                    call.state = CallState.RUNNING if call.open_streams else CallState.INPUT_ENDED
            else:
                self.queue.append(call.cid)
            self.calls[call.cid] = call
