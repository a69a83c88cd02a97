"""Per-call input state on the frontend (pure): framing, budgets, end of input, idleness."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from shared.runtime.errors import BadRequest, DuplexError, LimitExceeded
from shared.sdk.audio import Framer
from shared.sdk.chunking import Item
from shared.sdk.model import ClientInput, Model, StreamInput


class InputState(enum.Enum):
    OPEN = "open"  # some client stream still open
    INPUT_ENDED = "input_ended"  # every client stream ended; outputs may still come
    ENDED = "ended"  # finished, failed or aborted


@dataclass
class Prepared:
    """What one opening, append or end_input turned into."""

    items: list[tuple[str, int, Item]] = field(default_factory=list)  # (edge, seq, item) to publish
    late: list[str] = field(default_factory=list)  # streams the client had already ended: input not sent
    already_ended: list[str] = field(default_factory=list)  # named in end_input, but had already ended
    ended: dict[str, int] = field(default_factory=dict)  # edge -> total items, streams ended now


class CallInput:
    """One call's input as the frontend sees it. No I/O.

    Client audio is cut into the model's own items as it arrives; the remainder is
    carried to the next append and padded with zeros to one last item when its
    stream ends. Every bound is checked before anything is committed, so a refused
    input leaves the counts as they were.
    """

    def __init__(
        self,
        model: Model,
        stream_limits: dict[str, int | None],
        max_input_bytes: int,
        now: float,
    ) -> None:
        self.model = model
        self.edges = model.client_edges()
        self.edge_order = sorted(self.edges)  # bounds are checked stream by stream in this order
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

        Raises BadRequest (LimitExceeded for a bound) before anything is committed.
        Input the model routes to a stream the client already ended is reported in
        `late` and neither charged nor sent.
        """
        if self.state is not InputState.OPEN:
            raise BadRequest("the call's input has ended")
        # (Written for the append every live call sends every few tens of milliseconds: no
        # set, sort or comprehension where nothing is late, unknown or ending.)
        ending, already = self._streams_to_end(end)
        data = self._process(inp, opening)
        live = data  # the input for streams still open: all of it, unless some is late
        late: list[str] = []
        for e in data:
            if e not in self.edges:
                unknown = sorted(set(data) - set(self.edges))
                raise BadRequest(f"the model routed input to unknown stream(s) {unknown}")
            if e not in self.open_streams:
                late.append(e)
        if late:
            live = {e: d for e, d in data.items() if e in self.open_streams}
            late.sort()
        if not data and (inp.text or inp.files or (not opening and not ending and not already)):
            raise BadRequest(self._nothing_produced(inp))
        for edge, d in live.items():
            framed = edge in self.framers
            if framed and isinstance(d, list):
                raise BadRequest(f"stream {edge!r} takes raw samples, the model gave items")
            if not framed and not isinstance(d, list):
                raise BadRequest(f"stream {edge!r} takes items, not raw samples")
        charged = self._charged_bytes(inp, late)
        if charged and self.input_bytes + charged > self.max_input_bytes:
            mb = self.max_input_bytes / (1024 * 1024)
            raise LimitExceeded(
                "max_call_input_mb",
                f"the call's files would total {self.input_bytes + charged} bytes, over {mb:g} MiB",
            )
        for edge in self.edge_order:
            if edge not in live and edge not in ending:
                continue
            new = self._count(edge, live.get(edge), flush=edge in ending)
            limit = self.max_items.get(edge)
            if limit is not None and self.published[edge] + new > limit:
                raise LimitExceeded(
                    f"client_streams.{edge}.max_items",
                    f"stream {edge!r} would have {self.published[edge] + new} items, over its bound of {limit}"
                    f" ({self._unit(edge)})",
                )
        # Committed from here on.
        out = Prepared(late=late, already_ended=already)
        self.input_bytes += charged
        for edge, d in live.items():
            self._emit(out, edge, self._frame(edge, d))
        for edge in ending:
            out.ended[edge] = self._end(out, edge)
        self.last_input = now
        if not self.open_streams:
            self.state = InputState.INPUT_ENDED
        return out

    def end_input(self, end: bool | list[str], now: float) -> Prepared:
        """End the named streams (True: all). Flushing a remainder is bounded like any input."""
        return self.accept(ClientInput(), opening=False, end=end, now=now)

    def _process(self, inp: ClientInput, opening: bool) -> dict[str, StreamInput]:
        try:
            return self.model.process_prompt(inp) if opening else self.model.process_stream_chunk(inp)
        except DuplexError:
            raise
        except Exception as e:  # I-4: whatever the model's decoding makes of bad input, it is a 400
            # The exception's own text is not the client's (library internals, a bug's details):
            # chained, for the shell to log (`socket_session.told`).
            raise BadRequest(f"the input could not be decoded by model {self.model.name!r}") from e

    def _nothing_produced(self, inp: ClientInput) -> str:
        if inp.text and not inp.files and self.model.text_stream() is None:
            return f"text-only input produced no stream item: model {self.model.name!r} has no text stream"
        if not inp.text and not inp.files:
            return "an append needs text or files (or end_input)"
        return "the input produced no stream item"

    def _charged_bytes(self, inp: ClientInput, late: list[str]) -> int:
        """File bytes charged to max_call_input_mb: every file but those routed to an ended stream."""
        charged = 0
        default = self.model.default_stream() if late else None
        for f in inp.files:
            if not late or (f.stream or default) not in late:
                charged += len(f.data)
        return charged

    def _unit(self, edge: str) -> str:
        limits = self.edges[edge].limits
        assert limits is not None
        if limits.item_size:
            return f"items of {limits.item_size} {limits.unit}"
        return limits.unit

    def _streams_to_end(self, end: bool | list[str] | None) -> tuple[list[str], list[str]]:
        """(streams to end now, streams named that had already ended)."""
        if end is None or end is False:
            return [], []
        if end is True:
            return sorted(self.open_streams), []
        unknown = [e for e in end if e not in self.edges]
        if unknown:
            raise BadRequest(f"unknown stream(s) {unknown} in end_input; this model's streams: {sorted(self.edges)}")
        names = list(dict.fromkeys(end))
        return [e for e in names if e in self.open_streams], [e for e in names if e not in self.open_streams]

    def _count(self, edge: str, d: StreamInput | None, flush: bool) -> int:
        framer = self.framers.get(edge)
        if framer is None:
            return len(d) if isinstance(d, list) else 0
        return framer.count_after(0 if d is None else len(d), flush=flush)

    def _frame(self, edge: str, d: StreamInput) -> list[Item]:
        framer = self.framers.get(edge)
        if framer is None:
            assert isinstance(d, list)
            return d
        assert not isinstance(d, list)
        return [Item(f) for f in framer.push(np.asarray(d))]

    def _emit(self, out: Prepared, edge: str, items: list[Item]) -> None:
        seq = self.published[edge]
        for item in items:
            out.items.append((edge, seq, item))
            seq += 1
        self.published[edge] = seq

    def _end(self, out: Prepared, edge: str) -> int:
        framer = self.framers.get(edge)
        if framer is not None:
            last = framer.flush()
            if last is not None:
                self._emit(out, edge, [Item(last)])
        self.open_streams.discard(edge)
        return self.published[edge]

    # -- lifecycle -------------------------------------------------------------
    def touch(self, now: float) -> None:
        """Input that is not sent yet (a realtime session's held buffer) or a sign of life:
        it resets the request timeout as input does."""
        self.last_input = now

    def idle_for(self, now: float) -> float:
        """Seconds since the last input, while input is still open (the request timeout's clock)."""
        return now - self.last_input if self.state is InputState.OPEN else 0.0

    def close(self) -> None:
        self.state = InputState.ENDED
