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
from services.frontend.outbox import Reply
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

    _output_prefix: bytes | None = None

    def reply(self, body: dict[str, Any]) -> None:
        self.sink.send({"request_id": self.request_id, **body})

    def relay_output(self, event_json: bytes) -> None:
        """`{"request_id": ..., "output": EVENT}` spliced as JSON text: the event is never decoded here."""
        if self._output_prefix is None:
            self._output_prefix = b'{"request_id":' + msgspec.json.encode(self.request_id) + b',"output":'
        self.sink.send(b"".join((self._output_prefix, event_json, b"}")))
