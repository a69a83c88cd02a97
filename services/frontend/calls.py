"""Per-call input state on the frontend (pure): framing, budgets, end of input, idleness."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from duplexbus.shared.audio import Framer
from duplexbus.shared.chunking import Item
from duplexbus.shared.errors import BadRequest, LimitExceeded
from duplexbus.shared.model import ClientInput, Model, StreamInput


class InputState(enum.Enum):
    OPEN = "open"  # some client stream still open
    INPUT_ENDED = "input_ended"  # every client stream ended; outputs may still come
    ENDED = "ended"  # finished, failed or aborted


@dataclass
class Prepared:
    """What one opening or append turned into."""

    items: list[tuple[str, int, Item]] = field(default_factory=list)  # (edge, seq, item) to publish
    late: list[str] = field(default_factory=list)  # streams the client had already ended
    ended: dict[str, int] = field(default_factory=dict)  # edge -> total items, streams ended now


class CallInput:
    """One call's input as the frontend sees it. No I/O."""

    def __init__(
        self,
        model: Model,
        stream_limits: dict[str, int | None],
        max_input_bytes: int,
        now: float,
    ) -> None:
        self.model = model
        self.edges = model.client_edges()
        self.max_items = stream_limits
        self.max_input_bytes = max_input_bytes
        self.framers: dict[str, Framer] = {}
        for edge, conn in self.edges.items():
            assert conn.limits is not None
            if conn.limits.item_size:
                self.framers[edge] = Framer(conn.limits.item_size)
        self.published: dict[str, int] = dict.fromkeys(self.edges, 0)
        self.open_streams: set[str] = set(self.edges)
        self.input_bytes = 0
        self.last_input = now
        self.state = InputState.OPEN

    # -- input -----------------------------------------------------------------
    def accept(self, inp: ClientInput, opening: bool, end: bool | list[str] | None, now: float) -> Prepared:
        """Decode, frame and bound one opening or append, then end the streams `end` names.

        Raises (BadRequest, LimitExceeded) before anything is committed, so a refused
        append leaves the counts as they were.
        """
        if self.state is not InputState.OPEN:
            raise BadRequest("the call's input has ended")
        ending = self._streams_to_end(end)
        data = self.model.process_prompt(inp) if opening else self.model.process_stream_chunk(inp)
        file_bytes = sum(len(f.data) for f in inp.files)
        out = Prepared()
        live = {e: d for e, d in data.items() if e in self.open_streams}
        out.late = sorted(e for e in data if e not in self.open_streams)
        if not opening and not live and not ending and not out.late:
            raise BadRequest(
                "the input produced no stream item"
                + (" (text-only, and the model has no text stream)" if inp.text and not inp.files else "")
            )
        if self.input_bytes + file_bytes > self.max_input_bytes and live:
            mb = self.max_input_bytes / (1024 * 1024)
            raise LimitExceeded("max_call_input_mb", f"the call's files exceed {mb:g} MiB")
        for edge, d in live.items():
            new = self._count(edge, d, flush=edge in ending)
            limit = self.max_items.get(edge)
            if limit is not None and self.published[edge] + new > limit:
                raise LimitExceeded(f"client_streams.{edge}.max_items", f"more than {limit} items on stream {edge!r}")
        for edge in ending:
            if edge not in live and self._count(edge, None, flush=True):
                limit = self.max_items.get(edge)
                if limit is not None and self.published[edge] + 1 > limit:
                    raise LimitExceeded(
                        f"client_streams.{edge}.max_items", f"more than {limit} items on stream {edge!r}"
                    )
        # Committed from here on.
        if live:
            self.input_bytes += file_bytes
        for edge, d in live.items():
            self._emit(out, edge, self._frame(edge, d))
        for edge in ending:
            out.ended[edge] = self._end(out, edge)
        self.last_input = now
        if not self.open_streams:
            self.state = InputState.INPUT_ENDED
        return out

    def end_input(self, end: bool | list[str], now: float) -> Prepared:
        if self.state is not InputState.OPEN:
            raise BadRequest("the call's input has already ended")
        ending = self._streams_to_end(end)
        if not ending:
            raise BadRequest("every named stream had already ended")
        out = Prepared()
        for edge in ending:
            out.ended[edge] = self._end(out, edge)
        self.last_input = now
        if not self.open_streams:
            self.state = InputState.INPUT_ENDED
        return out

    def _streams_to_end(self, end: bool | list[str] | None) -> list[str]:
        if end is None or end is False:
            return []
        if end is True:
            return sorted(self.open_streams)
        unknown = [e for e in end if e not in self.edges]
        if unknown:
            raise BadRequest(f"unknown stream(s) {unknown} in end_input; this model's streams: {sorted(self.edges)}")
        return [e for e in end if e in self.open_streams]

    def _count(self, edge: str, d: StreamInput | None, flush: bool) -> int:
        framer = self.framers.get(edge)
        if framer is None:
            return len(d) if isinstance(d, list) else 0
        units = 0 if d is None else len(d)
        n = framer.count_after(units)
        if flush and (framer.pending + units) % framer.item_size:
            n += 1
        return n

    def _frame(self, edge: str, d: StreamInput) -> list[Item]:
        framer = self.framers.get(edge)
        if framer is None:
            if not isinstance(d, list):
                raise BadRequest(f"stream {edge!r} takes items, not raw samples")
            return d
        if isinstance(d, list):
            raise BadRequest(f"stream {edge!r} takes raw samples")
        return [Item(f) for f in framer.push(np.asarray(d))]

    def _emit(self, out: Prepared, edge: str, items: list[Item]) -> None:
        for item in items:
            out.items.append((edge, self.published[edge], item))
            self.published[edge] += 1

    def _end(self, out: Prepared, edge: str) -> int:
        framer = self.framers.get(edge)
        if framer is not None:
            last = framer.flush()
            if last is not None:
                self._emit(out, edge, [Item(last)])
        self.open_streams.discard(edge)
        return self.published[edge]

    # -- lifecycle -------------------------------------------------------------
    def idle_for(self, now: float) -> float:
        """Seconds since the last input, while input is still open (the request timeout's clock)."""
        return now - self.last_input if self.state is InputState.OPEN else 0.0

    def close(self) -> None:
        self.state = InputState.ENDED
