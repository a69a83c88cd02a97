"""What a stored call's messages say: its client streams' rates and items, and its outputs as
a client reads them. Shared by `duplexbus replay` (audio, timeline) and its --rerun."""

from __future__ import annotations

from collections.abc import Iterable

from clients.eval.core import Event
from clients.eval.protocols import GenerateWS
from shared.bus import subjects, wire
from shared.bus.history import Stored
from shared.runtime.errors import DuplexError

DEFAULT_RATE = 16_000


def client_rate(model: str, edge: str) -> int:
    """The sample rate of a model's client stream (16 kHz where the model is unknown here)."""
    from models.registry import get_model

    try:
        conns = get_model(model).topology.connections
    except DuplexError:
        return DEFAULT_RATE
    for c in conns:
        if c.from_client and c.edge_name == edge and c.limits is not None and c.limits.sample_rate:
            return c.limits.sample_rate
    return DEFAULT_RATE


def input_items(msgs: Iterable[tuple[Stored, wire.AnyMsg | None]]) -> dict[str, list[tuple[int, int, bytes]]]:
    """Per client stream: (seq, stored at ns, PCM bytes) of each item, in seq order, repeats dropped."""
    out: dict[str, dict[int, tuple[int, int, bytes]]] = {}
    for s, m in msgs:
        if isinstance(m, wire.InputItem) and m.item.data is not None:
            edge = subjects.parse(s.subject).edge or ""
            out.setdefault(edge, {}).setdefault(m.seq, (m.seq, s.ts_ns, m.item.data.data))
    return {e: [items[k] for k in sorted(items)] for e, items in out.items()}


def outputs(msgs: Iterable[tuple[Stored, wire.AnyMsg | None]]) -> list[wire.OutputMsg]:
    """The call's outputs in the order the client got them: per partition by seq, repeats dropped."""
    seen: dict[tuple[str, int], wire.OutputMsg] = {}
    for _, m in msgs:
        if isinstance(m, wire.OutputMsg):
            seen.setdefault((m.partition, m.seq), m)
    return [seen[k] for k in sorted(seen)]


def output_events(msgs: list[tuple[Stored, wire.AnyMsg | None]], rate: int) -> list[Event]:
    """The call's outputs as `duplexbus eval`'s translator reads them from a socket (`rate`:
    of audio that does not say its own)."""
    translator = GenerateWS(rate)
    return [ev for o in outputs(msgs) for ev in translator.classify(b'{"output": ' + o.event_json() + b"}")]
