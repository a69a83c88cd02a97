"""How a model's partitions are wired: client streams and inter-partition edges.

Walks. A partition runs each call's chunk under a *walk*: a name that says which of its
computations the chunk takes (prefill or decode, say), handed to it as `StepInput.walk`.
A partition no stream drives runs under the walk `""`. An edge whose `Connection` has a
`consumer_walk` drives its consumer's walk: the hook runs on the producer's side for every
item the producer emits on the edge, and the name it returns travels with the item; the
consumer's chunks are cut where the walk changes and one step's batch holds one walk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from shared.runtime.errors import ConfigError

if TYPE_CHECKING:
    from shared.sdk.chunking import ChunkPolicy, Item

CLIENT = "__client__"
"""Reserved producer name: the client, not a partition."""


@dataclass(frozen=True)
class ClientStreamLimits:
    """Bounds and units of one client stream.

    `item_size` is how many units (samples for audio) make one stream item; the
    frontend cuts client input into items of exactly this size.
    """

    max_items: int | None = None
    item_size: int | None = None
    unit: str = "items"
    sample_rate: int | None = None


@dataclass(frozen=True)
class ProducerWalkCtx:
    """What a `consumer_walk` hook sees: one item the producing partition emitted on a
    walk-driving edge. Built afresh for every item, on the producer's worker."""

    cid: str
    item: Item
    producer_walk: str = ""  # the walk the producer's own step ran under ("": none drives it)


@dataclass(frozen=True)
class Connection:
    """A stream from the client (from_partition=CLIENT) or a partition into a partition.
    Only a client stream takes `limits`. `consumer_walk`, on an edge between partitions,
    names the walk each item's chunk runs under in the consumer (see the module doc)."""

    from_partition: str
    to_partition: str
    edge_name: str
    chunk_policy_factory: Callable[[], ChunkPolicy]
    limits: ClientStreamLimits | None = None
    consumer_walk: Callable[[ProducerWalkCtx], str] | None = None

    @property
    def from_client(self) -> bool:
        return self.from_partition == CLIENT


@dataclass(frozen=True)
class PartitionTopology:
    partitions: list[str]
    connections: list[Connection] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = set(self.partitions)
        if CLIENT in names:
            raise ValueError(f"{CLIENT!r} is reserved and cannot name a partition")
        if len(names) != len(self.partitions):
            raise ValueError("partition names must be unique")
        seen: set[str] = set()
        for c in self.connections:
            if c.edge_name in seen:
                raise ValueError(f"edge {c.edge_name!r} is declared twice")
            seen.add(c.edge_name)
            if c.to_partition not in names:
                raise ValueError(f"edge {c.edge_name!r} goes to unknown partition {c.to_partition!r}")
            if not c.from_client and c.from_partition not in names:
                raise ValueError(f"edge {c.edge_name!r} comes from unknown partition {c.from_partition!r}")
            if c.from_client and c.limits is None:
                raise ValueError(f"client edge {c.edge_name!r} needs ClientStreamLimits")
        self.check_walk_driving_connections()

    @cached_property
    def _client_edges(self) -> dict[str, Connection]:
        return {c.edge_name: c for c in self.connections if c.from_client}

    def client_edges(self) -> dict[str, Connection]:
        """Client streams by edge name (built once: the frontend asks for every append)."""
        return self._client_edges

    def inputs_of(self, partition: str) -> list[Connection]:
        return [c for c in self.connections if c.to_partition == partition]

    def outputs_of(self, partition: str) -> list[Connection]:
        return [c for c in self.connections if c.from_partition == partition]

    def producer_triggered_partitions(self) -> set[str]:
        """Partitions whose walk the stream drives (an incoming edge has a consumer_walk)."""
        return set(self.walk_drivers())

    def walk_drivers(self) -> dict[str, Connection]:
        """Producer-triggered partition -> the connection whose consumer_walk decides its walk
        (the first declared; check_walk_driving_connections makes them all agree)."""
        out: dict[str, Connection] = {}
        for c in self.connections:
            if c.consumer_walk is not None:
                out.setdefault(c.to_partition, c)
        return out

    def check_walk_driving_connections(self) -> None:
        """A producer-triggered partition has one authority over its walk: every incoming edge
        comes from one producer partition (not the client, which runs no model code) and
        shares one consumer_walk, so the items of all its edges agree on the walk. ValueError
        otherwise. (Chunks cannot overlap here: a StreamBuffer releases each item in exactly
        one chunk, so no item runs under two walks.)"""
        for p, driver in self.walk_drivers().items():
            if driver.from_client:
                raise ValueError(
                    f"client edge {driver.edge_name!r} has a consumer_walk: only a partition's output "
                    "can drive a walk (the client runs no model code)"
                )
            inputs = self.inputs_of(p)
            producers = sorted({c.from_partition for c in inputs})
            if len(producers) > 1:
                names = ", ".join("the client" if n == CLIENT else repr(n) for n in producers)
                raise ValueError(
                    f"partition {p!r} is producer-triggered (edge {driver.edge_name!r} drives its walk), "
                    f"so all its incoming edges must come from one producer; they come from {names}"
                )
            others = [c.edge_name for c in inputs if c.consumer_walk is not driver.consumer_walk]
            if others:
                raise ValueError(
                    f"partition {p!r} is producer-triggered: all its incoming edges must share edge "
                    f"{driver.edge_name!r}'s consumer_walk (one function), and {others} do not"
                )

    def stream_limits(self, overrides: Mapping[str, int | None]) -> dict[str, int | None]:
        """Effective max_items per client edge (see client_stream_limits)."""
        return {edge: lim.max_items for edge, lim in client_stream_limits(self, overrides).items()}


class _ServingConfig(Protocol):
    @property
    def max_items_overrides(self) -> Mapping[str, int | None]: ...


class _HasTopology(Protocol):
    topology: PartitionTopology


@dataclass(frozen=True)
class ClientStream:
    """Where a client stream's items go: the partition that consumes it, and the walk they
    run under there. That walk is always "" (a client stream cannot drive a walk, nor flow
    into a partition another stream drives: check_walk_driving_connections)."""

    partition: str
    walk: str = ""


def find_client_streams(model: _HasTopology) -> dict[str, ClientStream]:
    """Each client stream's consumer partition and walk, by edge name."""
    topo = model.topology
    driven = topo.producer_triggered_partitions()
    out: dict[str, ClientStream] = {}
    for edge, c in topo.client_edges().items():
        if c.to_partition in driven:  # unreachable for a topology that passed its checks
            raise ValueError(f"client edge {edge!r} flows into {c.to_partition!r}, whose walk a stream drives")
        out[edge] = ClientStream(c.to_partition)
    return out


def client_stream_limits(
    topology: PartitionTopology, serving_config: _ServingConfig | Mapping[str, int | None] | None = None
) -> dict[str, ClientStreamLimits]:
    """Each client stream's limits: the model's declaration with the serving config's
    `client_streams` (edge -> max_items, or a ServingConfig) applied. The config may lower a
    model's bound, never raise or remove it, nor name a stream the model does not have
    (ConfigError naming the key)."""
    if serving_config is None:
        overrides: Mapping[str, int | None] = {}
    elif isinstance(serving_config, Mapping):
        overrides = serving_config
    else:
        overrides = serving_config.max_items_overrides
    out: dict[str, ClientStreamLimits] = {}
    for edge, conn in topology.client_edges().items():
        assert conn.limits is not None  # PartitionTopology refuses a client edge without
        out[edge] = conn.limits
    for edge, max_items in overrides.items():
        key = f"client_streams.{edge}.max_items"
        if edge not in out:
            raise ConfigError(f"client_streams.{edge}", f"the model has no client stream {edge!r}")
        model_max = out[edge].max_items
        if max_items is None:
            if model_max is not None:
                raise ConfigError(key, f"cannot remove the model's bound of {model_max}")
            continue
        if model_max is not None and max_items > model_max:
            raise ConfigError(key, f"{max_items} raises the model's bound of {model_max}")
        out[edge] = replace(out[edge], max_items=max_items)
    return out
