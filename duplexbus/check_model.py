"""`duplexbus check-model NAME|module:Class`: what a model author runs before serving a model.

It loads the model as a worker does (models/registry.py), builds every partition, and runs
them all in this process through the worker's own engines (services/worker/engine.py),
wired in memory, on generated calls: many at once, of random lengths, their appends
interleaved, each stream ended at a random point, some calls aborted (seeded). Client
input goes through the model's `process_prompt` / `process_stream_chunk` and the frontend's
framing (services/frontend/calls.py `CallInput`), as it would when served. No NATS.

It checks the rules a served model must keep (each broken one is a line, and the exit
status is 1):

- every partition is reached by the client's streams (the rest of the topology is checked
  as it is built);
- every call finishes (a done from each partition) unless the check aborted it, within
  `max_steps` steps after its input ended and within `timeout_s`; none fails in the model
  (an output or item the wire cannot carry included: each goes through the wire's encoding,
  and each item reaches its consumer as it would served);
- per call and partition, the outputs' seqs are 0, 1, 2, ... each once, as many as the
  done counts, none after the call ended; the same for each edge's items and its end;
- each partition's `open_call` runs once per call, and then exactly one `close_call` (it
  finished) or `drop_call` (aborted, failed);
- nothing of a call is left once it ended: the engines hold no call, the partitions emit
  nothing for a call their step was not given, no attribute of a partition holds a call's
  id (its dicts' keys, its sets and lists, one level deep), and a partition with a
  `capacity()` takes that many new calls at once.

It also reports each partition's steps, batch sizes and step times (median, p95).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.frontend.calls import CallInput, InputState
from services.worker import engine as eng
from shared.bus import wire
from shared.runtime.errors import BadRequest, ConfigError, DuplexError
from shared.sdk.audio import encode_wav
from shared.sdk.chunking import Item
from shared.sdk.model import CallInfo, ClientFile, ClientInput, Emission, Model, Partition, StepInput
from shared.sdk.topology import CLIENT, PartitionTopology

log = logging.getLogger(__name__)

WORDS = "the quick brown fox jumps over a lazy dog while seven bells ring out".split()
MAX_INPUT_BYTES = 1 << 30  # the frontend's max_call_input_mb is not what is checked here
PROBE_MAX = 4096  # the most calls the capacity probe opens in one partition


@dataclass(frozen=True)
class Options:
    calls: int = 32
    seed: int = 0
    appends: int = 6  # the most appends a call makes after its opening
    items: int = 8  # the most items one append carries (audio: plus a remainder under one item)
    abort_share: float = 0.125  # of the calls, aborted at a random point
    max_steps: int = 2000  # steps one call may take in a partition after its input ended
    timeout_s: float = 300.0  # the whole run
    max_batch: int = 64


# -- the partitions, counted -------------------------------------------------------------
class Counted(Partition):
    """A partition as the engine sees it, with every lifecycle call counted and every step
    timed; the model's own partition does the work."""

    def __init__(self, inner: Partition) -> None:
        self.inner = inner  # its `blocking` does not matter here: every step runs in this thread
        self.opens: Counter[str] = Counter()
        self.closes: Counter[str] = Counter()
        self.drops: Counter[str] = Counter()
        self.drained: Counter[str] = Counter()  # steps a call was given after its input ended
        self.step_s: list[float] = []
        self.batch_sizes: list[int] = []

    def open_call(self, call: CallInfo) -> None:
        self.opens[call.cid] += 1
        self.inner.open_call(call)

    def step(self, batch: list[StepInput]) -> list[Emission]:
        self.batch_sizes.append(len(batch))
        self.drained.update(s.cid for s in batch if s.inputs_ended)
        start = time.perf_counter()
        try:
            return list(self.inner.step(batch))
        finally:
            self.step_s.append(time.perf_counter() - start)

    def close_call(self, cid: str) -> dict[str, Any]:
        self.closes[cid] += 1
        return self.inner.close_call(cid)

    def drop_call(self, cid: str) -> None:
        self.drops[cid] += 1
        self.inner.drop_call(cid)

    def wants_step(self, cid: str) -> bool:
        return self.inner.wants_step(cid)

    def capacity(self) -> int | None:
        return self.inner.capacity()


# -- what the engines did, recorded -------------------------------------------------------
@dataclass
class Record:
    """Everything the engines made, per call."""

    outputs: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(list))  # (cid, partition) -> seqs
    dones: dict[tuple[str, str], int] = field(default_factory=dict)  # (cid, partition) -> outputs counted
    edge_items: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(list))  # (cid, edge) -> seqs
    edge_ends: dict[tuple[str, str], int] = field(default_factory=dict)  # (cid, edge) -> total
    failures: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # cid -> what failed it
    after_done: list[str] = field(default_factory=list)  # actions of a partition for a call it had finished
    finished: set[str] = field(default_factory=set)  # a done from every partition
    gone: set[str] = field(default_factory=set)  # failed, aborted, or refused at its opening

    @property
    def ended(self) -> set[str]:
        return self.finished | self.gone


class Rig:
    """The model's partitions, one engine each, wired in memory as a worker running them all
    would be; every action recorded in `record`."""

    def __init__(self, model: Model, opts: Options) -> None:
        topo = model.topology
        self.binary_fields = model.binary_fields
        self.parts = {p: Counted(model.create_partition(p)) for p in topo.partitions}
        self.engines = {p: eng.Engine(p, topo, part, opts.max_batch, tick_s=eng.TICK_S) for p, part in self.parts.items()}
        self.consumer = {c.edge_name: c.to_partition for c in topo.connections}
        self.producer = {c.edge_name: c.from_partition for c in topo.connections}
        self.record = Record()
        self.live: set[str] = set()
        self.aborted: set[str] = set()

    def open(self, cid: str) -> str | None:
        """Add the call to every engine; what refused it, if one did (and none keeps it)."""
        added: list[str] = []
        for name, e in self.engines.items():
            try:
                e.add_call(cid)
            except Exception as err:
                for other in added:
                    self.engines[other].drop_call(cid)
                self.record.gone.add(cid)
                return f"open_call of {name} raised {type(err).__name__}: {err}"
            added.append(name)
        self.live.add(cid)
        return None

    def push(self, cid: str, edge: str, seq: int, item: Item, walk: str = "") -> None:
        """The item as it arrives served: through the wire (its array read-only, its meta as
        msgpack gives it back)."""
        consumer = self.consumer[edge]
        try:
            sent = wire.as_sent(item)
        except Exception as e:  # the model's data, as in a worker (Stepper.carry_out)
            producer = self.producer[edge]
            by = "process_stream_chunk (client input)" if producer == CLIENT else producer
            self._unsendable(cid, f"{by}: an item on {edge!r}", e)
            return
        self._apply(self.engines[consumer].push(cid, edge, seq, sent, walk), consumer)

    def end(self, cid: str, edge: str, total: int) -> None:
        self._apply(self.engines[self.consumer[edge]].end(cid, edge, total), self.consumer[edge])

    def abort(self, cid: str) -> None:
        self.aborted.add(cid)
        self._ended(cid)

    def _ended(self, cid: str) -> None:
        """Failed or aborted: every engine lets it go, as a worker does on the call's abort."""
        self.live.discard(cid)
        self.record.gone.add(cid)
        for e in self.engines.values():
            e.drop_call(cid)

    def _apply(self, actions: list[eng.Action], partition: str) -> None:
        rec = self.record
        for a in actions:
            if a.cid in rec.gone:
                continue  # what is left of a failed call goes nowhere (a frontend drops it)
            if (a.cid, partition) in rec.dones:
                rec.after_done.append(f"{type(a).__name__} from {partition}")
                continue
            if isinstance(a, eng.PublishOutput):
                try:
                    wire.check_event(a.data, self.binary_fields)
                except Exception as e:  # the model's data, as in a worker (Stepper.carry_out)
                    self._unsendable(a.cid, f"{partition}: an output", e)
                    continue
                rec.outputs[a.cid, partition].append(a.seq)
            elif isinstance(a, eng.PublishEdgeItem):
                rec.edge_items[a.cid, a.edge].append(a.seq)
                self.push(a.cid, a.edge, a.seq, a.item, a.walk)
            elif isinstance(a, eng.PublishEdgeEnd):
                rec.edge_ends[a.cid, a.edge] = a.total
                self.end(a.cid, a.edge, a.total)
            elif isinstance(a, eng.PublishDone):
                rec.dones[a.cid, partition] = a.outputs
                if all((a.cid, p) in rec.dones for p in self.engines):
                    self.live.discard(a.cid)
                    rec.finished.add(a.cid)
            elif isinstance(a, eng.FailCall):
                during = getattr(a.error, "during", "")
                rec.failures[a.cid].append(f"{partition}{f' ({during})' if during else ''}: {a.error.message}")
                self._ended(a.cid)

    def _unsendable(self, cid: str, what: str, error: Exception) -> None:
        """What the wire cannot carry fails the call, as in a worker (services/worker/stepper.py)."""
        self.record.failures[cid].append(f"{what} that the wire cannot carry ({error}); served, the call fails")
        self._ended(cid)

    def round(self, now: float) -> bool:
        """One step of every engine with work due; False where none had any."""
        worked = False
        for name, e in self.engines.items():
            if e.has_work(now):
                worked = True
                self._apply(e.step(now), name)
        return worked

    def next_due(self, now: float) -> float | None:
        dues = [d for e in self.engines.values() if (d := e.next_due(now)) is not None]
        return min(dues) if dues else None


# -- generated calls ------------------------------------------------------------------------
@dataclass
class Script:
    """One call's client messages, in its order: ("input", ClientInput, end) | ("abort",)."""

    cid: str
    events: deque[tuple[Any, ...]]
    input: CallInput | None = None
    sent: int = 0  # messages sent so far (the first is the opening)


def make_input(model: Model, rng: np.random.Generator, opts: Options, streams: list[str]) -> ClientInput:
    """Random content for some of the model's streams: audio files of random lengths for its
    audio streams (a remainder under one item included), words for its text stream."""
    edges = model.client_edges()
    text_edge = model.text_stream()
    inp = ClientInput()
    for edge in streams:
        limits = edges[edge].limits
        assert limits is not None
        if limits.sample_rate:
            size = limits.item_size or 1
            n = int(rng.integers(0, opts.items + 1)) * size + int(rng.integers(0, size))
            pcm = (rng.standard_normal(n) * 2000).clip(-32768, 32767).astype("<i2")
            inp.files.append(ClientFile(f"{edge}.wav", encode_wav(pcm, limits.sample_rate), stream=edge))
        elif edge == text_edge:
            inp.text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
    return inp


def fed_streams(model: Model) -> list[str]:
    """The client streams check-model can make input for: audio, and the text stream."""
    text_edge = model.text_stream()
    return [e for e, c in sorted(model.client_edges().items()) if (c.limits and c.limits.sample_rate) or e == text_edge]


def make_script(model: Model, cid: str, rng: np.random.Generator, opts: Options) -> Script:
    streams = fed_streams(model)
    n = int(rng.integers(0, opts.appends + 1))
    inputs: list[tuple[Any, ...]] = []
    for _ in range(n + 1):  # the opening, then the appends
        some = [s for s in streams if rng.random() < 0.8] or streams[:1]
        inputs.append(("input", make_input(model, rng, opts, some), None))
    # Each stream ends with some message from the opening on (an append may then carry
    # input for a stream already ended: the frontend calls that late and drops it).
    for s in model.client_edges():
        i = int(rng.integers(0, len(inputs)))
        kind, inp, end = inputs[i]
        inputs[i] = (kind, inp, [*(end or []), s])
    events: deque[tuple[Any, ...]] = deque(inputs)
    if rng.random() < opts.abort_share:
        events.insert(int(rng.integers(1, len(events) + 1)), ("abort",))
    return Script(cid, events)


# -- the run --------------------------------------------------------------------------------
@dataclass
class Report:
    model: str
    calls: int
    aborted: int
    violations: list[str]
    figures: dict[str, dict[str, float]]  # partition -> steps, batch and step-time percentiles
    notes: list[str] = field(default_factory=list)


class Check:
    """One run of check-model over one model."""

    def __init__(self, model: Model, opts: Options) -> None:
        self.model = model
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)
        self.rig = Rig(model, opts)
        self.violations: list[str] = []
        caps = [c for p in self.rig.parts.values() if (c := p.capacity()) is not None]
        self.limit = max(1, min([opts.calls, *caps]))  # calls open at once: no more than a worker would hold
        self.scripts = deque(make_script(model, f"check-{i:04d}", self.rng, opts) for i in range(opts.calls))
        self.open: dict[str, Script] = {}

    def run(self) -> Report:
        deadline = time.monotonic() + self.opts.timeout_s
        while (self.scripts or self.open) and time.monotonic() < deadline:
            if not self._next_event():
                self._wait()
            if self.rng.random() < 0.25:  # messages of several calls between steps: batches mix calls
                self.rig.round(time.monotonic())
            self._bound_steps()
            self._forget_ended()
        for cid in sorted(self.open):
            self.violations.append(f"call {cid} was not over within the check's --timeout ({self.opts.timeout_s:g} s)")
            self.rig.abort(cid)
        return self._report()

    def _next_event(self) -> bool:
        """Open a call or send one call's next message; False where nothing was left to send."""
        if self.scripts and len(self.open) < self.limit and (not self.open or self.rng.random() < 0.3):
            script = self.scripts.popleft()
            self._open(script)
            return True
        waiting = [s for s in self.open.values() if s.events]
        if not waiting:
            return False
        self._send(waiting[int(self.rng.integers(0, len(waiting)))])
        return True

    def _open(self, script: Script) -> None:
        refused = self.rig.open(script.cid)
        if refused is not None:
            self.violations.append(f"call {script.cid} was refused: {refused}")
            return
        limits = self.model.topology.stream_limits({})
        script.input = CallInput(self.model, limits, MAX_INPUT_BYTES, now=time.monotonic())
        self.open[script.cid] = script
        self._send(script)  # its opening

    def _send(self, script: Script) -> None:
        event = script.events.popleft()
        if event[0] == "abort":
            self.rig.abort(script.cid)
            return
        _, inp, end = event
        assert script.input is not None
        if script.input.state is not InputState.OPEN or script.cid in self.rig.record.ended:
            return  # every stream ended already (or the call did): nothing more to send
        script.sent += 1
        try:
            prepared = script.input.accept(inp, opening=script.sent == 0, end=end, now=time.monotonic())
        except BadRequest as e:
            self.violations.append(f"call {script.cid}: the frontend refused generated input: {e.message}")
            self.rig.abort(script.cid)
            return
        for edge, seq, item in prepared.items:
            self.rig.push(script.cid, edge, seq, item)
        for edge, total in prepared.ended.items():
            self.rig.end(script.cid, edge, total)

    def _wait(self) -> None:
        """Nothing to send: step what is due, else sleep until a paced step is."""
        now = time.monotonic()
        if self.rig.round(now):
            return
        due = self.rig.next_due(now)
        if due is not None:
            time.sleep(min(max(due, 0.001), 0.05))
            return
        for cid in sorted(c for c in self.open if c in self.rig.live):
            self.violations.append(f"call {cid} is not over and has nothing left to do: its input all sent, no step due")
            self.rig.abort(cid)

    def _bound_steps(self) -> None:
        for name, part in self.rig.parts.items():
            for cid, n in part.drained.items():
                if n > self.opts.max_steps and cid in self.rig.live:
                    self.violations.append(
                        f"call {cid} did not finish in {name}: {n} steps after its input ended (max_steps {self.opts.max_steps})"
                    )
                    self.rig.abort(cid)

    def _forget_ended(self) -> None:
        for cid in [c for c, s in self.open.items() if c in self.rig.record.ended and not s.events]:
            del self.open[cid]
        for cid in [c for c in self.open if c in self.rig.record.ended]:
            self.open[cid].events.clear()  # ended (failed, aborted): its other messages would be late

    def _report(self) -> Report:
        rig = self.rig
        cids = [f"check-{i:04d}" for i in range(self.opts.calls)]
        v = topology_violations(self.model.topology) + self.violations
        v += failure_violations(rig.record.failures)
        v += order_violations(rig.record, list(rig.engines))
        v += lifecycle_violations(rig.parts, rig.record.finished)
        v += leftover_violations(rig, set(cids))
        figures = {name: figures_of(part) for name, part in rig.parts.items()}
        notes = [
            f"stream {e!r}: check-model makes no input for it (neither audio nor the text stream)"
            for e in sorted(self.model.client_edges())
            if e not in fed_streams(self.model)
        ]
        return Report(self.model.name, self.opts.calls, len(rig.aborted), grouped(v), figures, notes)


# -- the rules, each a list of violations ----------------------------------------------------
_CALL = re.compile(r"call (check-\d{4})")


def grouped(violations: list[str]) -> list[str]:
    """One line per rule broken: the same words for many calls become one line naming them."""
    calls: dict[str, list[str]] = {}
    for v in violations:
        calls.setdefault(_CALL.sub("call {call}", v), []).extend(_CALL.findall(v))
    out = []
    for text, cids in calls.items():
        if len(cids) <= 1:
            out.append(text.replace("{call}", cids[0]) if cids else text)
        else:
            shown = ", ".join(cids[:3]) + (f" and {len(cids) - 3} more" if len(cids) > 3 else "")
            out.append(f"{len(cids)} calls ({shown}): " + text.replace("call {call}", "the call"))
    return out


def topology_violations(topo: PartitionTopology) -> list[str]:
    """What PartitionTopology does not refuse as it is built, and no call could get through:
    no client stream, or a partition no path of edges from the client reaches."""
    if not topo.client_edges():
        return ["the model has no client stream: no call can send it anything"]
    reached = {c.to_partition for c in topo.client_edges().values()}
    grew = True
    while grew:
        more = {c.to_partition for c in topo.connections if c.from_partition in reached} - reached
        reached |= more
        grew = bool(more)
    return [f"partition {p} is reached by no edge from the client's streams" for p in topo.partitions if p not in reached]


def failure_violations(failures: Mapping[str, list[str]]) -> list[str]:
    return [f"call {cid} failed in {'; '.join(why)}" for cid, why in sorted(failures.items())]


def _contiguous(seqs: list[int]) -> str | None:
    """What is wrong with seqs that should be 0, 1, 2, ... each once; None where nothing is."""
    if seqs == list(range(len(seqs))):
        return None
    dup = sorted(s for s, n in Counter(seqs).items() if n > 1)
    if dup:
        return f"seqs {dup[:5]} more than once"
    if sorted(seqs) == list(range(len(seqs))):
        first = next(i for i, s in enumerate(seqs) if s != i)
        return f"out of order from the {first}th: {seqs[max(0, first - 1) : first + 3]}"
    missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
    return f"seqs {missing[:5]} missing"


def order_violations(rec: Record, partitions: list[str]) -> list[str]:
    """Per call and partition, outputs numbered 0.. each once, as many as its done says; per
    call and edge, the same for the edge's items and its end; nothing after a call ended."""
    out: list[str] = []
    for (cid, part), seqs in sorted(rec.outputs.items()):
        if (wrong := _contiguous(seqs)) is not None:
            out.append(f"call {cid}: the outputs of {part}: {wrong}")
    for (cid, part), n in sorted(rec.dones.items()):
        got = len(rec.outputs.get((cid, part), []))
        if n != got:
            out.append(f"call {cid}: {part}'s done counts {n} outputs, {got} were sent")
    for (cid, edge), seqs in sorted(rec.edge_items.items()):
        if (wrong := _contiguous(seqs)) is not None:
            out.append(f"call {cid}: the items on edge {edge}: {wrong}")
    for (cid, edge), total in sorted(rec.edge_ends.items()):
        got = len(rec.edge_items.get((cid, edge), []))
        if total != got:
            out.append(f"call {cid}: edge {edge} ended at {total} items, {got} were sent")
    for what, n in sorted(Counter(rec.after_done).items()):
        out.append(f"{n} times {what} for a call after that partition's done")
    return out


def lifecycle_violations(parts: Mapping[str, Counted], finished: set[str]) -> list[str]:
    """Per partition, open_call once per call, then exactly one close_call or drop_call (every
    call has ended by now: the check aborts what does not); a call that finished everywhere
    got close_call."""
    out: list[str] = []
    for name, p in parts.items():
        for cid in sorted(p.opens):
            opens, closes, drops = p.opens[cid], p.closes[cid], p.drops[cid]
            if opens != 1:
                out.append(f"{name}: open_call ran {opens} times for call {cid}")
            if closes + drops != 1:
                out.append(f"{name}: call {cid} got close_call {closes} and drop_call {drops} times (one of the two, once)")
            elif cid in finished and not closes:
                out.append(f"{name}: call {cid} finished and got drop_call, not close_call")
    return out


def leftover_violations(rig: Rig, cids: set[str]) -> list[str]:
    """Once every call ended: no call in an engine, no emission for a call a step was not
    given, no call's id in a partition's attributes, and every slot of a capacity back."""
    out: list[str] = []
    for name, e in rig.engines.items():
        if len(e):
            out.append(f"{name}: the engine still holds {len(e)} calls")
        if e.stats.stray_emissions:
            out.append(f"{name}: {e.stats.stray_emissions} emissions for calls its step was not given (dropped)")
        for attr, n in held_ids(rig.parts[name].inner, cids).items():
            out.append(f"{name}: {n} ended calls still in its attribute {attr!r} (state not let go)")
        if (short := capacity_probe(rig.parts[name].inner)) is not None:
            out.append(f"{name}: {short}")
    return out


def held_ids(part: object, cids: set[str]) -> dict[str, int]:
    """Attributes of a partition whose keys or members are ids of `cids` (one level deep)."""
    out: dict[str, int] = {}
    for attr, value in vars(part).items():
        members: Any
        if isinstance(value, Mapping):
            members = value.keys()
        elif isinstance(value, set | frozenset | list | tuple | deque):
            members = value
        else:
            continue
        n = sum(1 for m in members if isinstance(m, str) and m in cids)
        if n:
            out[attr] = n
    return out


def capacity_probe(part: Partition) -> str | None:
    """A partition with a capacity() must take that many new calls at once; what refused one,
    if any. The probe's calls are dropped after."""
    cap = part.capacity()
    if cap is None or cap > PROBE_MAX:
        return None
    taken: list[str] = []
    try:
        for i in range(cap):
            cid = f"probe-{i:04d}"
            part.open_call(CallInfo(cid))
            taken.append(cid)
    except Exception as e:
        return f"took {len(taken)} new calls of its capacity() {cap}, then refused: {type(e).__name__}: {e} (state not let go)"
    finally:
        for cid in taken:
            part.drop_call(cid)
    return None


def figures_of(part: Counted) -> dict[str, float]:
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else 0.0

    ms = [s * 1000 for s in part.step_s]
    sizes = [float(b) for b in part.batch_sizes]
    return {
        "steps": float(len(sizes)),
        "batch_p50": statistics.median(sizes) if sizes else 0.0,
        "batch_p95": pct(sizes, 95),
        "step_ms_p50": statistics.median(ms) if ms else 0.0,
        "step_ms_p95": pct(ms, 95),
    }


# -- the command ----------------------------------------------------------------------------
def check(spec: str, opts: Options, load: Callable[[str], Model] | None = None) -> Report:
    """Load the model `spec` names (as a worker does) and check it."""
    if load is None:
        from models.registry import served_model

        load = served_model
    model = load(spec)
    return Check(model, opts).run()


def render(report: Report) -> Iterator[str]:
    yield f"check-model {report.model}: {report.calls} calls, {report.aborted} aborted by the check"
    yield f"  {'partition':<16} {'steps':>7} {'batch p50':>9} {'p95':>5} {'step ms p50':>11} {'p95':>8}"
    for name, f in report.figures.items():
        yield (
            f"  {name:<16} {int(f['steps']):>7} {f['batch_p50']:>9.1f} {f['batch_p95']:>5.1f}"
            f" {f['step_ms_p50']:>11.3f} {f['step_ms_p95']:>8.3f}"
        )
    for note in report.notes:
        yield f"note: {note}"
    for v in report.violations:
        yield f"violation: {v}"
    n = len(report.violations)
    yield "ok: no violation" if not n else f"{n} violation{'s' if n > 1 else ''}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Options()
    p.add_argument("model", help="a model's name (built-in, installed entry point) or module:Class")
    p.add_argument("--calls", type=int, default=d.calls, help="generated calls")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the input, its timing and the aborts (default: 0)")
    p.add_argument("--appends", type=int, default=d.appends, help="the most appends a call makes after its opening")
    p.add_argument("--items", type=int, default=d.items, help="the most items one append carries")
    p.add_argument("--abort-share", type=float, default=d.abort_share, help="the share of calls aborted at a random point")
    p.add_argument(
        "--max-steps", type=int, default=d.max_steps, help="steps a call may take in a partition after its input ended"
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds the whole check may take")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="calls in one step, as the config's max_batch")


def run_command(args: argparse.Namespace) -> int:
    """0: no violation; 1: violations, one line each; 2: the model could not be loaded."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # the model's tracebacks
    opts = Options(
        calls=args.calls,
        seed=args.seed,
        appends=args.appends,
        items=args.items,
        abort_share=args.abort_share,
        max_steps=args.max_steps,
        timeout_s=args.timeout,
        max_batch=args.max_batch,
    )
    try:
        report = check(args.model, opts)
    except (ConfigError, DuplexError):
        raise  # cli.main prints a ConfigError as one line (exit 2)
    except Exception as e:  # the model's constructor, or create_partition, raised
        log.exception("loading %s failed", args.model)
        raise ConfigError("model", f"{args.model!r} could not be built: {type(e).__name__}: {e}") from None
    for line in render(report):
        print(line, flush=True)
    return 1 if report.violations else 0
