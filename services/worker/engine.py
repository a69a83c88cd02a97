"""The worker engine's pure core: stream buffers, chunk policies, batched steps.

No I/O here. The service feeds items and end counts in (`push`, `end`), asks for
the next batch (`next_batch`), runs the partition's `step` off the event loop, and
turns the emissions into actions to publish (`complete`). `LocalPipeline` runs a
whole model through these cores in one process, for tests and benchmarks.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.runtime.errors import DuplexError, LimitExceeded, ModelFailed, ProtocolError
from shared.runtime.states import checked
from shared.sdk.chunking import Chunk, Item, StreamBuffer
from shared.sdk.model import CallInfo, EdgeItem, Emission, Model, Output, Partition, StepInput
from shared.sdk.topology import PartitionTopology, ProducerWalkCtx

log = logging.getLogger(__name__)


class EngineCallState(enum.Enum):
    """Where one call stands in one partition's engine (the conductor's `CallState` is the
    whole call's, across partitions)."""

    RUNNING = "running"  # inputs still open
    DRAINING = "draining"  # inputs ended; the partition still has work (wants_step)
    FINISHED = "finished"
    FAILED = "failed"


TICK_S = 0.02  # how often a worker steps a partition that wants steps without input (paced audio)

_TRANSITIONS = {
    EngineCallState.RUNNING: {EngineCallState.DRAINING, EngineCallState.FINISHED, EngineCallState.FAILED},
    EngineCallState.DRAINING: {EngineCallState.FINISHED, EngineCallState.FAILED},
    EngineCallState.FINISHED: set(),
    EngineCallState.FAILED: set(),
}


# Actions for the shell to carry out, in order.
@dataclass(frozen=True)
class PublishOutput:
    cid: str
    seq: int
    data: dict[str, Any]


@dataclass(frozen=True)
class PublishEdgeItem:
    cid: str
    edge: str
    seq: int
    item: Item
    walk: str = ""  # the consumer's walk for it (the edge's consumer_walk); "": the edge drives none


@dataclass(frozen=True)
class PublishEdgeEnd:
    cid: str
    edge: str
    total: int


@dataclass(frozen=True)
class PublishDone:
    cid: str
    outputs: int
    usage: dict[str, Any]


@dataclass(frozen=True)
class FailCall:
    cid: str
    error: DuplexError


Action = PublishOutput | PublishEdgeItem | PublishEdgeEnd | PublishDone | FailCall


@dataclass
class _Call:
    cid: str
    buffers: dict[str, StreamBuffer]
    out_edges: dict[str, int]  # edge -> items sent so far
    state: EngineCallState = EngineCallState.RUNNING
    outputs: int = 0
    last_step: int = -1  # step number this call was last served (fairness: least recent first)
    last_time: float = -math.inf  # when it was last served (paces steps without input)
    in_flight: bool = False  # part of the batch being stepped now
    held: int = 0  # bytes its stream buffers hold (the sum of their held_bytes)
    walk: str = ""  # the walk it last ran under: a step without new input runs under it again

    def move(self, to: EngineCallState) -> None:
        self.state = checked(f"call {self.cid}", self.state, to, _TRANSITIONS)

    @property
    def inputs_ended(self) -> bool:
        for b in self.buffers.values():  # (a loop, not all() over a generator: asked per call per step)
            if not b.finished:
                return False
        return True


@dataclass
class EngineStats:
    steps: int = 0
    chunks: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    opened: int = 0  # calls added
    ended: int = 0  # calls gone: finished, failed or dropped
    model_errors: int = 0  # times the partition's code raised or broke the model API
    stray_emissions: int = 0  # emissions for a call its step was not given (dropped)


class Engine:
    """Runs one partition of one model over many calls."""

    def __init__(
        self,
        partition_name: str,
        topology: PartitionTopology,
        partition: Partition,
        max_batch: int = 64,
        tick_s: float = 0.0,
    ) -> None:
        self.name = partition_name
        # A call with no new input that still wants steps (paced audio, draining) is stepped
        # at most every tick_s, not in a tight loop.
        self.tick_s = tick_s
        self.partition = partition
        # A partition that never wants a step without input (the default wants_step) has no
        # paced or draining calls: skip the scans for them, which are O(calls) per step.
        self._paced = type(partition).wants_step is not Partition.wants_step
        self.max_batch = max_batch
        self.inputs = topology.inputs_of(partition_name)
        self.outputs = [c.edge_name for c in topology.outputs_of(partition_name)]
        # Walks: the hooks that name the consumer's walk for what this partition emits, and
        # the input edges that drive this partition's own walk (see shared/sdk/topology.py).
        self._walk_hooks = {c.edge_name: c.consumer_walk for c in topology.outputs_of(partition_name) if c.consumer_walk}
        self._driving = {c.edge_name for c in self.inputs if c.consumer_walk is not None}
        self._calls: dict[str, _Call] = {}
        self._dirty: dict[str, None] = {}  # calls that got input since they were last served (ordered set)
        self._drop_after_step: set[str] = set()  # failed while in a step: partition state dropped after it
        self._wants_failed: set[str] = set()  # calls whose wants_step raised: failed at their next step
        self.in_step_since: float | None = None  # when the batch being stepped was taken (None: no step under way)
        self._next_idle_scan = -math.inf
        self._step_no = 0
        self.held_bytes = 0  # what every call's stream buffers hold (see StreamBuffer.held_bytes)
        self.stats = EngineStats()

    # -- calls -------------------------------------------------------------
    def __contains__(self, cid: str) -> bool:
        return cid in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def input_edges(self) -> list[str]:
        return [c.edge_name for c in self.inputs]

    def add_call(self, cid: str, model_kwargs: dict[str, Any] | None = None) -> None:
        if cid in self._calls:
            return  # a repeated assignment (conductor retry) is harmless
        # A client stream's declared max_items bounds its seqs; how much is held at once is
        # the worker's flow control's to bound (it stops taking input, which waits in the stream).
        buffers = {
            c.edge_name: StreamBuffer(c.chunk_policy_factory(), c.limits.max_items if c.limits else None) for c in self.inputs
        }
        try:
            self.partition.open_call(CallInfo(cid, dict(model_kwargs or {})))
        except Exception:
            # It may have taken part of the call's state (a KV slot) before it raised: drop_call
            # lets that go, as for any call that ends without close_call. The caller reports it.
            self._drop_state(cid)
            raise
        self._calls[cid] = _Call(cid, buffers, dict.fromkeys(self.outputs, 0))
        self.stats.opened += 1

    def drop_call(self, cid: str) -> None:
        """Aborted or failed elsewhere: forget it without a done."""
        call = self._calls.get(cid)
        if call is not None:
            self._remove(call)
            self._let_go(call)

    def _remove(self, call: _Call) -> None:
        """The call leaves the engine; its buffers go with it."""
        del self._calls[call.cid]
        self.held_bytes -= call.held
        self._wants_failed.discard(call.cid)
        self.stats.ended += 1

    def _let_go(self, call: _Call) -> None:
        """The partition's state for a call that ends without close_call: drop_call, once, and
        only after a step under way that has the call (it may run in a thread now)."""
        if call.in_flight:
            self._drop_after_step.add(call.cid)
        else:
            self._drop_state(call.cid)

    def _drop_state(self, cid: str) -> None:
        """partition.drop_call; one that raises is logged, not raised: the call ends anyway,
        and what ends it (an abort, another failure) must go on."""
        try:
            self.partition.drop_call(cid)
        except Exception as e:
            self._model_error("drop_call", [cid], e)

    def _model_error(self, during: str, cids: list[str], error: Exception) -> ModelFailed:
        """The model's exception, with its traceback, for the worker's log; the error the
        calls fail with names only the partition (it reaches the client)."""
        self.stats.model_errors += 1
        shown = ", ".join(cids[:8]) + (f" and {len(cids) - 8} more" if len(cids) > 8 else "")
        log.error("partition %s: %s failed for %s", self.name, during, shown, exc_info=error)
        return ModelFailed(self.name, during)

    def held(self, cid: str) -> int:
        """Bytes the call's stream buffers hold here (0 for a call not here)."""
        call = self._calls.get(cid)
        return 0 if call is None else call.held

    def wants_item(self, cid: str, edge: str, seq: int) -> bool:
        """A push of it would be held: the call is here, running, and has not had that item."""
        call = self._calls.get(cid)
        buf = None if call is None or call.state in (EngineCallState.FINISHED, EngineCallState.FAILED) else call.buffers.get(edge)
        return buf is not None and buf.is_new(seq)

    def has_chunk(self, cid: str) -> bool:
        """The call holds a chunk to step (its buffers would be drained by steps, not only by input)."""
        call = self._calls.get(cid)
        return call is not None and any(b.has_chunk() for b in call.buffers.values())

    def push(self, cid: str, edge: str, seq: int, item: Item, walk: str = "") -> list[Action]:
        """`walk`: the one the producer named for the item; it counts only on an edge that
        drives this partition's walk (a producer whose model differs cannot stall a call)."""
        call = self._calls.get(cid)
        if call is None or call.state in (EngineCallState.FINISHED, EngineCallState.FAILED):
            return []
        buf = call.buffers.get(edge)
        if buf is None:
            return self._fail(call, ProtocolError(f"partition {self.name} has no input edge {edge!r}"))
        before = buf.held_bytes
        try:
            buf.push(seq, item, walk if edge in self._driving else "")
        except (ProtocolError, LimitExceeded) as e:
            return self._fail(call, e)
        call.held += buf.held_bytes - before
        self.held_bytes += buf.held_bytes - before
        self._dirty[cid] = None
        return []

    def end(self, cid: str, edge: str, total: int) -> list[Action]:
        call = self._calls.get(cid)
        if call is None or call.state in (EngineCallState.FINISHED, EngineCallState.FAILED):
            return []
        buf = call.buffers.get(edge)
        if buf is None:
            return self._fail(call, ProtocolError(f"partition {self.name} has no input edge {edge!r}"))
        try:
            buf.end(total)
        except ProtocolError as e:
            return self._fail(call, e)
        self._dirty[cid] = None
        return []

    def awaiting_input(self) -> list[str]:
        """Calls with an input stream not yet complete."""
        return [cid for cid, call in self._calls.items() if not call.inputs_ended]

    def missing(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Calls waiting on an item known to exist (lost in transit): cid -> (edge, first missing seq)s."""
        out: dict[str, tuple[tuple[str, int], ...]] = {}
        for cid, call in self._calls.items():
            gaps = tuple((e, m) for e, b in call.buffers.items() if (m := b.missing) is not None)
            if gaps:
                out[cid] = gaps
        return out

    def fail_call(self, cid: str, error: DuplexError) -> list[Action]:
        call = self._calls.get(cid)
        return [] if call is None else self._fail(call, error)

    def _fail(self, call: _Call, error: DuplexError) -> list[Action]:
        call.move(EngineCallState.FAILED)
        self._remove(call)
        self._let_go(call)
        return [FailCall(call.cid, error)]

    # -- stepping ------------------------------------------------------------
    def _has_input(self, call: _Call) -> bool:
        if call.in_flight:
            return False
        for b in call.buffers.values():  # (a loop, not any() over a generator: asked per call per step)
            if b.has_chunk():
                return True
        return False

    def _idle_wants(self, call: _Call) -> bool:
        return not call.in_flight and (call.state is EngineCallState.DRAINING or self._wants_step(call.cid))

    def _wants_step(self, cid: str) -> bool:
        """partition.wants_step; one that raises is logged once and answered True, so the call
        is stepped and failed after that step (a question cannot fail a call itself)."""
        if cid in self._wants_failed:
            return True
        try:
            return self.partition.wants_step(cid)
        except Exception as e:
            self._model_error("wants_step", [cid], e)
            self._wants_failed.add(cid)
            return True

    def _wants(self, call: _Call, now: float) -> bool:
        if self._has_input(call):
            return True
        return self._idle_wants(call) and now - call.last_time >= self.tick_s

    def has_work(self, now: float = math.inf) -> bool:
        """`now` (monotonic seconds) paces calls without input; the default ignores the pacing."""
        return any(self._wants(c, now) for c in self._calls.values())

    def _candidates(self, now: float) -> list[_Call]:
        """Calls to serve now. Calls with new input come from the dirty set (O(new input), not
        O(calls): this runs for every step); calls that only want paced steps are looked for
        by a full scan at most every tick."""
        out: dict[str, _Call] = {}
        for cid in list(self._dirty):
            call = self._calls.get(cid)
            if call is None:
                del self._dirty[cid]
            elif self._has_input(call):
                out[cid] = call
            elif not call.in_flight:
                del self._dirty[cid]  # drained; a push or end marks it again
        if self._paced and now >= self._next_idle_scan:
            self._next_idle_scan = now + self.tick_s / 2 if math.isfinite(now) else -math.inf
            for call in self._calls.values():
                if call.cid not in out and self._idle_wants(call) and now - call.last_time >= self.tick_s:
                    out[call.cid] = call
        return list(out.values())

    def next_due(self, now: float) -> float | None:
        """Seconds until some call is due a step without new input; None if none wants one."""
        if not self._paced:
            return None
        due = [c.last_time + self.tick_s - now for c in self._calls.values() if self._idle_wants(c)]
        return max(0.0, min(due)) if due else None

    def _next_walk(self, call: _Call) -> str:
        """The walk of the call's next chunk (of its first input edge that has one), else the
        walk it last ran under."""
        for buf in call.buffers.values():
            if (walk := buf.next_walk) is not None:
                return walk
        return call.walk

    def next_batch(self, now: float = math.inf) -> list[StepInput]:
        """Up to max_batch calls, one chunk per input edge each, least recently served first.
        Where a stream drives the walk, the batch holds one walk only: the least recently
        served call's, so a walk few calls run is served as soon as its turn comes."""
        ready = self._candidates(now)
        ready.sort(key=lambda c: c.last_step)
        walk = ""
        if self._driving and ready:
            walk = self._next_walk(ready[0])
            ready = [c for c in ready if self._next_walk(c) == walk]
        batch: list[StepInput] = []
        for call in ready[: self.max_batch]:
            chunks: dict[str, Chunk] = {}
            for edge, buf in call.buffers.items():
                if buf.next_walk != walk:
                    continue  # none to release, or its next chunk runs under another walk: a later step's
                before = buf.held_bytes
                chunk = buf.pop_chunk()
                if chunk is not None:
                    chunks[edge] = chunk
                    call.held -= before - buf.held_bytes
                    self.held_bytes -= before - buf.held_bytes
            call.in_flight = True
            call.last_step = self._step_no
            call.last_time = now if math.isfinite(now) else -math.inf
            call.walk = walk
            batch.append(StepInput(call.cid, chunks, inputs_ended=call.inputs_ended, walk=walk))
        self._step_no += 1
        if batch and math.isfinite(now):
            self.in_step_since = now
        return batch

    def step(self, now: float = math.inf) -> list[Action]:
        """next_batch, step and complete in one go (the shell splits them to step off-loop)."""
        batch = self.next_batch(now)
        if not batch:
            return []
        try:
            emissions = self.partition.step(batch)
        except Exception as e:
            return self.step_failed(batch, e)
        return self.complete(batch, emissions)

    def _count(self, batch: list[StepInput]) -> None:
        self.in_step_since = None
        self.stats.steps += 1
        self.stats.chunks += sum(len(s.chunks) for s in batch)
        self.stats.batch_sizes.append(len(batch))
        if len(self.stats.batch_sizes) > 10_000:
            del self.stats.batch_sizes[:5_000]

    def step_failed(self, batch: list[StepInput], error: Exception) -> list[Action]:
        """The partition's step raised: every call of the batch fails, as which one made it
        raise is not known and each one's state may be half written. Each call's state is
        dropped once (drop_call, never close_call)."""
        self._count(batch)
        return self._batch_failed(batch, self._model_error("step", [s.cid for s in batch], error))

    def _batch_failed(self, batch: list[StepInput], error: ModelFailed) -> list[Action]:
        actions: list[Action] = []
        for s in batch:
            call = self._calls.get(s.cid)
            if call is None:
                self._after_step_gone(s.cid)
            else:
                call.in_flight = False
                actions += self._fail(call, error)
        return actions

    def _after_step_gone(self, cid: str) -> None:
        """A call of the batch that failed or was dropped while stepped: its state goes now."""
        if cid in self._drop_after_step:
            self._drop_after_step.discard(cid)
            self._drop_state(cid)

    def complete(self, batch: list[StepInput], emissions: Iterable[Emission]) -> list[Action]:
        """The step's emissions, as actions; then each call of the batch goes on, drains,
        finishes or fails. Model code that raises or breaks the API here fails the calls it
        concerns (see `_check_emissions`), never the caller."""
        self._count(batch)
        try:
            emitted = list(emissions)  # a generator runs model code here
            wrong = [e for e in emitted if not isinstance(e, Output | EdgeItem)]
            if wrong:
                raise TypeError(f"step returned a {type(wrong[0]).__name__}, not an Output or an EdgeItem")
        except Exception as err:
            return self._batch_failed(batch, self._model_error("step", [s.cid for s in batch], err))
        given = {s.cid for s in batch}
        broken = self._check_emissions(emitted, given)
        walks = self._consumer_walks(emitted, batch, broken)
        actions: list[Action] = []
        for e in emitted:
            call = self._calls.get(e.cid)
            if call is None or e.cid not in given or e.cid in broken:
                continue  # dropped while stepping, a stray (logged), or failed below
            if isinstance(e, Output):
                actions.append(PublishOutput(e.cid, call.outputs, e.data))
                call.outputs += 1
            else:
                walk = walks.get(id(e), "")
                actions.append(PublishEdgeItem(e.cid, e.edge, call.out_edges[e.edge], e.item, walk))
                call.out_edges[e.edge] += 1
        for s in batch:
            call = self._calls.get(s.cid)
            if call is None:
                self._after_step_gone(s.cid)
                continue
            call.in_flight = False
            self._dirty[call.cid] = None  # input that arrived while it was in flight
            if s.cid in broken or s.cid in self._wants_failed:
                actions += self._fail(call, ModelFailed(self.name, broken.get(s.cid, "wants_step")))
            elif call.inputs_ended:
                actions += self._after_input(call)
        return actions

    def _check_emissions(self, emitted: list[Emission], given: set[str]) -> dict[str, str]:
        """Calls of the batch whose emissions break the API (an edge not the partition's): those
        calls fail, the others of the batch go on. An emission for a call the step was not
        given is dropped and logged, and fails nothing: the call it names may be healthy."""
        broken: dict[str, str] = {}
        stray: list[str] = []
        for e in emitted:
            if e.cid not in given:
                stray.append(e.cid)
            elif e.cid not in broken and (wrong := self._malformed(e)):
                broken[e.cid] = "step"
                self.stats.model_errors += 1
                log.error("partition %s emitted %s, for %s", self.name, wrong, e.cid)
        if stray:
            self.stats.stray_emissions += len(stray)
            self.stats.model_errors += 1
            log.error("partition %s emitted for calls its step was not given (dropped): %s", self.name, sorted(set(stray))[:8])
        return broken

    def _malformed(self, e: Emission) -> str | None:
        """How an emission breaks the API's shapes, the call's fault alone; None if it does not.
        (What the wire cannot carry of well-shaped data is found where it is encoded.)"""
        if isinstance(e, Output):
            return None if isinstance(e.data, dict) else f"an Output whose data is a {type(e.data).__name__}, not a dict"
        if e.edge not in self.outputs:
            return f"on {e.edge!r}, not one of its edges {self.outputs}"
        if not isinstance(e.item, Item):
            return f"an EdgeItem on {e.edge!r} holding a {type(e.item).__name__}, not an Item"
        return None

    def _consumer_walks(self, emitted: list[Emission], batch: list[StepInput], broken: dict[str, str]) -> dict[int, str]:
        """The consumer's walk for each edge item on a walk-driving edge (id of the emission ->
        walk), from the edge's consumer_walk. A hook that raises or names no walk (not a
        non-empty str) breaks the API: its call fails, as for an unknown edge."""
        if not self._walk_hooks:
            return {}
        producer_walk = {s.cid: s.walk for s in batch}
        walks: dict[int, str] = {}
        for e in emitted:
            hook = self._walk_hooks.get(e.edge) if isinstance(e, EdgeItem) else None
            if hook is None or e.cid not in producer_walk or e.cid in broken:
                continue
            assert isinstance(e, EdgeItem)
            try:
                walk = hook(ProducerWalkCtx(e.cid, e.item, producer_walk[e.cid]))
                if not isinstance(walk, str) or not walk:
                    raise TypeError(f"consumer_walk of edge {e.edge!r} returned {walk!r}, not a walk's name")
            except Exception as error:
                broken[e.cid] = "consumer_walk"
                self._model_error("consumer_walk", [e.cid], error)
                continue
            walks[id(e)] = walk
        return walks

    def _after_input(self, call: _Call) -> list[Action]:
        """A call whose inputs have all ended: it drains while the partition wants steps for it,
        then finishes."""
        wants = self._wants_step(call.cid)
        if call.cid in self._wants_failed:  # it raised just now
            return self._fail(call, ModelFailed(self.name, "wants_step"))
        if not wants:
            return self._finish(call)
        if call.state is EngineCallState.RUNNING:
            call.move(EngineCallState.DRAINING)
        return []

    def _finish(self, call: _Call) -> list[Action]:
        self._remove(call)
        try:
            usage = self.partition.close_call(call.cid)
            if not isinstance(usage, dict):
                raise TypeError(f"close_call returned a {type(usage).__name__}, not a dict")
        except Exception as e:
            # close_call had its one try at the call's state: no drop_call after it.
            call.move(EngineCallState.FAILED)
            return [FailCall(call.cid, self._model_error("close_call", [call.cid], e))]
        call.move(EngineCallState.FINISHED)
        actions: list[Action] = [PublishEdgeEnd(call.cid, e, n) for e, n in call.out_edges.items()]
        actions.append(PublishDone(call.cid, call.outputs, usage))
        return actions


@dataclass
class PipelineResult:
    outputs: list[tuple[str, dict[str, Any]]]  # (partition, data) in emission order
    usage: dict[str, dict[str, Any]]
    errors: list[DuplexError]


class LocalPipeline:
    """A whole model's partitions, one engine each, wired in memory (no bus).

    For tests and benchmarks of models: the same engine cores the workers run.
    """

    def __init__(self, model: Model, max_batch: int = 64) -> None:
        self.model = model
        topo = model.topology
        self.engines = {p: Engine(p, topo, model.create_partition(p), max_batch) for p in topo.partitions}
        self._consumer = {c.edge_name: c.to_partition for c in topo.connections}
        self.outputs: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.usage: dict[str, dict[str, dict[str, Any]]] = {}
        self.errors: dict[str, list[DuplexError]] = {}

    def open(self, cid: str, model_kwargs: dict[str, Any] | None = None) -> None:
        for eng in self.engines.values():
            eng.add_call(cid, model_kwargs)
        self.outputs[cid], self.usage[cid], self.errors[cid] = [], {}, []

    def push(self, cid: str, edge: str, seq: int, item: Item, walk: str = "") -> None:
        self._apply(self.engines[self._consumer[edge]].push(cid, edge, seq, item, walk), None)

    def end(self, cid: str, edge: str, total: int) -> None:
        self._apply(self.engines[self._consumer[edge]].end(cid, edge, total), None)

    def _apply(self, actions: list[Action], partition: str | None) -> None:
        for a in actions:
            if isinstance(a, PublishOutput):
                assert partition is not None
                self.outputs[a.cid].append((partition, a.data))
            elif isinstance(a, PublishEdgeItem):
                self.push(a.cid, a.edge, a.seq, a.item, a.walk)
            elif isinstance(a, PublishEdgeEnd):
                self.end(a.cid, a.edge, a.total)
            elif isinstance(a, PublishDone):
                assert partition is not None
                self.usage[a.cid][partition] = a.usage
            elif isinstance(a, FailCall):
                self.errors[a.cid].append(a.error)
                for eng in self.engines.values():
                    eng.drop_call(a.cid)

    def run_once(self) -> bool:
        """One step of every engine that has work; False when none had any."""
        worked = False
        for name, eng in self.engines.items():
            if eng.has_work():
                worked = True
                self._apply(eng.step(), name)
        return worked

    def finished(self, cid: str) -> bool:
        return len(self.usage.get(cid, {})) == len(self.engines) or bool(self.errors.get(cid))

    def result(self, cid: str) -> PipelineResult:
        return PipelineResult(self.outputs[cid], self.usage[cid], self.errors[cid])
