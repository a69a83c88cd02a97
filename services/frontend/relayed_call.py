"""One call as the frontend holds it: its input, its relay of outputs, and where its messages go.

The service (`service.py`) opens and ends calls; `inputs.py` publishes their input and
`outputs.py` relays their outputs and fin. All three share this record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from services.frontend.calls import CallInput
from services.frontend.outbox import Packed, Reply, pack
from services.frontend.relay import OutputRelay
from shared.bus import wire
from shared.bus.connection import BusSubscription


class Sink(Protocol):
    """Takes a call's server -> client messages; never blocks (`outbox.Outbox`)."""

    def send(self, msg: Reply) -> None: ...
    def has_room(self) -> bool: ...  # False: outputs wait in the stream until `when_room` calls back
    def when_room(self, key: str, then: Callable[[], None]) -> None: ...


@dataclass(eq=False)  # a call is itself, whatever its fields: its owner keeps it in a set
class RelayedCall:
    cid: str
    request_id: str | None
    input: CallInput
    sink: Sink
    live: bool
    request_id_revision: int = 0  # the KV revision that reserved request_id (0: none)
    subs: list[BusSubscription] = field(default_factory=list)
    relay: OutputRelay = field(default_factory=OutputRelay)
    recovering: bool = False  # a read of the call's outputs from the stream is under way
    fin: wire.Fin | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    on_end: Callable[[RelayedCall], None] | None = None  # whoever opened it forgets it (a socket)
    opened: float = field(default_factory=time.monotonic)
    binary: bool = False  # opened in msgpack: every message of the call goes back in msgpack
    binary_fields: tuple[str, ...] = ()  # the model's (an output published in JSON is packed here)
    moves: int = 0  # how often the call moved to another frontend before it came here (0: opened here)
    announced: asyncio.Task[None] | None = None  # a live call's open being stored (its ends of input wait for it)

    _output_prefix: bytes | None = None

    def reply(self, body: dict[str, Any]) -> None:
        msg = {"request_id": self.request_id, **body}
        self.sink.send(pack(msg) if self.binary else msg)

    def relay_output(self, event: bytes) -> None:
        """`{"request_id": ..., "output": EVENT}` spliced, in the call's encoding (the event's
        already, `wire.OutputMsg`): the event is never decoded here."""
        if self._output_prefix is None:
            if self.binary:  # a map of two entries, the event its last value
                self._output_prefix = (
                    b"\x82" + _packer.encode("request_id") + _packer.encode(self.request_id) + _packer.encode("output")
                )
            else:
                self._output_prefix = b'{"request_id":' + msgspec.json.encode(self.request_id) + b',"output":'
        if self.binary:
            self.sink.send(Packed(self._output_prefix + event))
        else:
            self.sink.send(b"".join((self._output_prefix, event, b"}")))

    def event_body(self, o: wire.OutputMsg) -> bytes:
        """The output's event in the call's encoding: as published, or converted where it was
        published in the other (a worker of a release before 1.3)."""
        if o.packed == self.binary:
            return o.json
        return wire.repack_event(o.json, self.binary_fields) if self.binary else wire.unpack_event(o.json)


_packer = msgspec.msgpack.Encoder()
