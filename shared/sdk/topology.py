"""How a model's partitions are wired: client streams and inter-partition edges."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from shared.runtime.errors import ConfigError

if TYPE_CHECKING:
    from shared.sdk.chunking import ChunkPolicy

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
class Connection:
    from_partition: str
    to_partition: str
    edge_name: str
    chunk_policy_factory: Callable[[], ChunkPolicy]
    limits: ClientStreamLimits | None = None

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

    def stream_limits(self, overrides: Mapping[str, int | None]) -> dict[str, int | None]:
        """Effective max_items per client edge, with the serving config's `client_streams`
        (edge -> max_items) applied: they may lower a model's bound, never raise or remove it."""
        out: dict[str, int | None] = {}
        for edge, conn in self.client_edges().items():
            assert conn.limits is not None
            out[edge] = conn.limits.max_items
        for edge, max_items in overrides.items():
            key = f"client_streams.{edge}.max_items"
            if edge not in out:
                raise ConfigError(f"client_streams.{edge}", f"the model has no client stream {edge!r}")
            model_max = out[edge]
            if max_items is None:
                if model_max is not None:
                    raise ConfigError(key, f"cannot remove the model's bound of {model_max}")
                continue
            if model_max is not None and max_items > model_max:
                raise ConfigError(key, f"{max_items} raises the model's bound of {model_max}")
            out[edge] = max_items
        return out
