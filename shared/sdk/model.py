"""The model API: what a model declares, and the partitions a worker runs.

A model is used on both sides of the bus. The frontend calls `process_prompt` and
`process_stream_chunk` (stateless: client input to stream data keyed by client
edge). A worker calls `create_partition(name)` once and then steps the partition
over many calls at once. Per-call state lives inside the partition, keyed by cid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from shared.runtime.errors import BadRequest
from shared.sdk.audio import decode_audio_file
from shared.sdk.chunking import Chunk, Item
from shared.sdk.realtime import RealtimeMapping
from shared.sdk.topology import Connection, PartitionTopology


@dataclass
class ClientFile:
    name: str
    data: bytes
    stream: str | None = None


@dataclass
class ClientInput:
    """One opening or append, parsed and decoded from base64."""

    text: str | None = None
    files: list[ClientFile] = field(default_factory=list)
    model_kwargs: dict[str, Any] = field(default_factory=dict)


StreamInput = np.ndarray | list[Item]
"""Raw units (cut into items by the frontend's framer) or ready-made items."""


@dataclass
class CallInfo:
    """What a partition learns about a call when it starts."""

    cid: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepInput:
    """One call's share of a batched step."""

    cid: str
    chunks: dict[str, Chunk]  # edge -> the chunk released this step
    inputs_ended: bool = False  # every input stream has ended and been released
    walk: str = ""  # the walk the call runs under this step ("": no stream drives the partition); one per batch


@dataclass
class Output:
    """An event for the client (relayed verbatim as `output`)."""

    cid: str
    data: dict[str, Any]


@dataclass
class EdgeItem:
    """An item for the partition at the other end of `edge`."""

    cid: str
    edge: str
    item: Item


Emission = Output | EdgeItem


class Partition(ABC):
    """One stage of a model, batched across calls. No I/O here."""

    blocking: ClassVar[bool] = True
    """True: `step` runs in a thread so the worker's bus I/O goes on meanwhile (model
    forward passes). False: it is cheap enough to run on the event loop."""

    @abstractmethod
    def open_call(self, call: CallInfo) -> None: ...

    @abstractmethod
    def step(self, batch: list[StepInput]) -> list[Emission]:
        """One batched forward pass over the given calls' ready chunks."""

    @abstractmethod
    def close_call(self, cid: str) -> dict[str, Any]:
        """Drop the call's state; return its usage."""

    def capacity(self) -> int | None:
        """The most calls this partition can hold at once (a KV cache pool, say); None: no bound
        of its own. A worker takes no more calls than its smallest partition capacity."""
        return None

    def wants_step(self, cid: str) -> bool:
        """True while the partition has work for `cid` without new input (e.g. paced audio)."""
        return False

    def drop_call(self, cid: str) -> None:
        """The call was aborted: drop its state without usage."""
        self.close_call(cid)


class Model(ABC):
    """A servable model: its topology, client-input processing and partitions."""

    name: ClassVar[str]
    topology: PartitionTopology
    binary_fields: ClassVar[tuple[str, ...]] = ("audio",)
    """Top-level fields of this model's output events that hold audio: bytes (`pcm16_bytes`),
    which a JSON client gets as base64 text, or base64 text (`b64_pcm16`). A client that
    opened its call in msgpack gets either as raw bytes, no base64 to undo."""

    def client_edges(self) -> dict[str, Connection]:
        return self.topology.client_edges()

    def default_stream(self) -> str | None:
        """The model's one audio stream, if it has exactly one."""
        return self._default_stream

    @cached_property
    def _default_stream(self) -> str | None:  # computed once: asked for every file of every append
        audio = [e for e, c in self.client_edges().items() if c.limits and c.limits.sample_rate]
        return audio[0] if len(audio) == 1 else None

    def text_stream(self) -> str | None:
        return None

    def process_prompt(self, opening: ClientInput) -> dict[str, StreamInput]:
        return self.process_stream_chunk(opening)

    def process_stream_chunk(self, append: ClientInput) -> dict[str, StreamInput]:
        """Decode one append into stream data keyed by client edge."""
        edges = self.client_edges()
        out: dict[str, list[np.ndarray]] = {}
        items: dict[str, list[Item]] = {}
        for f in append.files:
            edge = f.stream or self.default_stream()
            if edge is None:
                raise BadRequest(f"file {f.name!r} names no stream and the model has no single audio stream")
            conn = edges.get(edge)
            if conn is None:
                raise BadRequest(f"unknown stream {edge!r}; this model's streams: {sorted(edges)}")
            limits = conn.limits
            assert limits is not None
            if limits.sample_rate is None:
                raise BadRequest(f"stream {edge!r} takes no files")
            out.setdefault(edge, []).append(decode_audio_file(f.name, f.data, limits.sample_rate))
        text_edge = self.text_stream()
        if append.text and text_edge is not None:
            items.setdefault(text_edge, []).append(Item(meta={"text": append.text}))
        result: dict[str, StreamInput] = {e: (a[0] if len(a) == 1 else np.concatenate(a)) for e, a in out.items()}
        result.update(items)
        return result

    def realtime_mapping(self) -> RealtimeMapping | None:
        """Optional: a fresh `RealtimeMapping` per `WS /v1/realtime` session, saying how this
        model's outputs become realtime events (shared/sdk/realtime.py). None (the default):
        the model is not served over `/v1/realtime`."""
        return None

    @abstractmethod
    def create_partition(self, name: str) -> Partition: ...
