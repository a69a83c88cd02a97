"""How a model's partitions are wired: client streams and inter-partition edges."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplexbus.shared.chunking import ChunkPolicy

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
