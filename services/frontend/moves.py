"""A call that moves to another frontend (a realtime session resumed there), as data (pure).

The frontend that holds the call lets it go (`hand_over`): where its input and its relay of
outputs stand goes into the `wire.RealtimeMove` the taker gets. The taker sets a fresh input
and relay of the call to that (`take_over`) and carries on where the other left off: each
stream's next item has the next seq, the samples short of an item are still short of one,
and the relay's first read of the stream relays what the other did not.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.calls import CallInput, InputState
from services.frontend.relay import OutputRelay
from services.frontend.relayed_call import RelayedCall
from shared.bus import wire


def hand_over(call: RelayedCall, frontend_id: str, session: bytes, age_s: float) -> wire.RealtimeMove:
    """The move of `call` (its input's remainders are taken out: this frontend sends nothing
    more of it), with the session's own state."""
    inp = call.input
    remainders: dict[str, wire.Tensor] = {}
    for edge, framer in inp.framers.items():
        n = framer.pending
        last = framer.flush()  # the remainder, padded to an item: its first n samples are it
        if last is not None:
            remainders[edge] = wire.Tensor.from_array(last[:n])
    next_out, read_to = call.relay.hand_over()
    return wire.RealtimeMove(
        ok=True,
        frontend_id=frontend_id,
        model=inp.model.name,
        request_id=call.request_id or "",
        request_id_revision=call.request_id_revision,
        moves=call.moves + 1,
        published=dict(inp.published),
        open_streams=sorted(inp.open_streams),
        input_bytes=inp.input_bytes,
        remainders=remainders,
        next_out=next_out,
        read_to=read_to,
        age_s=age_s,
        session=session,
    )


@dataclass
class Taken:
    """What the taker builds the call of, besides its cid and where its messages go."""

    request_id: str | None
    request_id_revision: int
    moves: int
    relay: OutputRelay


def take_over(inp: CallInput, move: wire.RealtimeMove) -> Taken:
    """Set `inp`, a fresh input of the move's model, to where the other frontend left it;
    ValueError for a move that does not fit the model (nothing is taken then)."""
    edges = set(inp.edges)
    named = set(move.published) | set(move.open_streams) | set(move.remainders)
    if not named <= edges:
        raise ValueError(f"streams {sorted(named - edges)} are not model {inp.model.name!r}'s")
    for edge, t in move.remainders.items():
        framer = inp.framers.get(edge)
        if framer is None or t.to_array().ndim != 1 or len(t.to_array()) >= framer.item_size:
            raise ValueError(f"stream {edge!r}: a remainder that is not one short of an item")
    inp.published.update(move.published)
    inp.open_streams = set(move.open_streams)
    inp.input_bytes = move.input_bytes
    for edge, t in move.remainders.items():
        inp.framers[edge].push(t.to_array())  # short of an item: held, none cut
    if not inp.open_streams:
        inp.state = InputState.INPUT_ENDED
    relay = OutputRelay.taken_over(move.next_out, move.read_to)
    return Taken(move.request_id or None, move.request_id_revision, move.moves, relay)
