"""Stream items, chunks and chunk policies (pure, no I/O).

A stream is a sequence of items numbered from 0. A chunk policy decides when
buffered items are released to the partition and how they are collated into
one chunk. End of a stream is a count: the buffer is complete once it has seen
that many items, whatever order the items and the count arrived in. Each item carries
the walk it runs under (shared/sdk/topology.py; "" for a stream that drives none): a
chunk holds items of one walk only, cut where the walk changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.runtime.errors import LimitExceeded, ProtocolError


@dataclass
class Item:
    """One stream item: an optional tensor and free-form metadata."""

    data: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Chunk:
    """Items released together. `data` is the items' tensors concatenated on axis 0."""

    items: list[Item]
    first_seq: int
    last: bool = False  # the stream ends with this chunk
    walk: str = ""  # the walk all its items run under

    @property
    def data(self) -> np.ndarray | None:
        arrays = [i.data for i in self.items if i.data is not None]
        if not arrays:
            return None
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)

    def __len__(self) -> int:
        return len(self.items)


class ChunkPolicy(ABC):
    """Decides how many of the buffered items form the next chunk."""

    @abstractmethod
    def take(self, available: int, complete: bool) -> int:
        """How many items to release now (0: wait). `complete`: no more will come."""


class FixedChunkPolicy(ChunkPolicy):
    """Chunks of exactly `chunk_size` items; the last, shorter chunk is flushed at the end."""

    def __init__(self, chunk_size: int = 1) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.chunk_size = chunk_size

    def take(self, available: int, complete: bool) -> int:
        if available >= self.chunk_size:
            return self.chunk_size
        return available if complete else 0


class CatchUpChunkPolicy(ChunkPolicy):
    """Everything buffered, up to `max_items`: a call that fell behind catches up in one step."""

    def __init__(self, max_items: int = 64) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self.max_items = max_items

    def take(self, available: int, complete: bool) -> int:
        return min(available, self.max_items)


@dataclass
class _Run:
    """Consecutive ready items of one walk."""

    walk: str
    count: int


ITEM_OVERHEAD = 256  # bytes an item costs beside its tensor's (the objects around it), for bounds in bytes


def item_bytes(item: Item) -> int:
    """What holding `item` costs in memory, roughly: its tensor and the objects around it."""
    return ITEM_OVERHEAD + (item.data.nbytes if item.data is not None else 0)


class StreamBuffer:
    """Reorders, deduplicates and counts one call's items on one edge.

    Items may arrive twice (live subscription and catch-up read overlap) or out of
    order; each seq is kept once. The ready items are kept as runs of one walk: the policy
    sees only the head run (whose end closes the chunk, as the stream's end does), so a
    chunk never mixes walks. It holds whatever it is given: how much a worker takes at once
    is its flow control's to bound (`held_bytes` says what is held here).
    `max_items`, the stream's declared bound, refuses any item numbered past it.
    """

    def __init__(self, policy: ChunkPolicy, max_items: int | None = None) -> None:
        self.policy = policy
        self.max_items = max_items
        self._ready: deque[Item] = deque()  # contiguous from self._next_release
        self._runs: deque[_Run] = deque()  # _ready as runs of one walk, in order
        self._last_walk = ""  # of the last chunk released: the empty final chunk's walk
        self._pending: dict[int, tuple[Item, str]] = {}  # arrived ahead of a gap, with its walk
        self._next_release = 0  # seq of the first item in _ready
        self._next_expected = 0  # seq that would extend _ready
        self.total: int | None = None  # count from the end-of-stream message
        self.finished = False  # the last chunk has been released
        self.held_bytes = 0  # item_bytes of every item held (ready or pending)

    @property
    def buffered(self) -> int:
        return len(self._ready) + len(self._pending)

    @property
    def missing(self) -> int | None:
        """The first seq known to be missing (a later item or the end count says it exists), else None."""
        if self._pending or (self.total is not None and self._next_expected < self.total):
            return self._next_expected
        return None

    @property
    def complete(self) -> bool:
        return self.total is not None and self._next_expected >= self.total

    def is_new(self, seq: int) -> bool:
        """Not held nor released yet (a push of it would not be a duplicate)."""
        return seq >= self._next_expected and seq not in self._pending

    def push(self, seq: int, item: Item, walk: str = "") -> bool:
        """Add an item, run under `walk`; False if it was a duplicate."""
        if not self.is_new(seq):
            return False
        if self.total is not None and seq >= self.total:
            raise ProtocolError(f"item {seq} past the stream's end ({self.total} items)")
        if self.max_items is not None and seq >= self.max_items:
            raise LimitExceeded("stream_buffer", f"item {seq} is past the stream's declared bound of {self.max_items} items")
        self.held_bytes += item_bytes(item)
        if seq == self._next_expected:
            self._append(item, walk)
            while self._next_expected in self._pending:
                self._append(*self._pending.pop(self._next_expected))
        else:
            self._pending[seq] = (item, walk)
        return True

    def _append(self, item: Item, walk: str) -> None:
        self._ready.append(item)
        self._next_expected += 1
        if self._runs and self._runs[-1].walk == walk:
            self._runs[-1].count += 1
        else:
            self._runs.append(_Run(walk, 1))

    def _head(self) -> tuple[str, int, bool]:
        """The head run's walk and length, and whether nothing more joins it (a walk change
        follows it, or the stream is complete)."""
        if not self._runs:
            return self._last_walk, 0, self.complete
        return self._runs[0].walk, self._runs[0].count, self.complete or len(self._runs) > 1

    @property
    def next_walk(self) -> str | None:
        """The walk of the next chunk, None while there is none to release (`has_chunk`, with
        the head read once: asked for each of a call's streams in every step)."""
        if self.finished:
            return None
        walk, available, closed = self._head()
        if self.complete and not self._ready:
            return walk  # the empty final chunk
        return walk if self.policy.take(available, closed) > 0 else None

    def end(self, total: int) -> None:
        if self.total is not None and self.total != total:
            raise ProtocolError(f"stream ended twice with different counts ({self.total}, {total})")
        if total < self._next_expected or any(s >= total for s in self._pending):
            raise ProtocolError(f"end count {total} is below items already received")
        self.total = total

    def has_chunk(self) -> bool:
        if self.finished:
            return False
        if self.complete and not self._ready:
            return True  # an empty final chunk tells the partition the stream ended
        _, available, closed = self._head()
        return self.policy.take(available, closed) > 0

    def pop_chunk(self) -> Chunk | None:
        if self.finished:
            return None
        walk, available, closed = self._head()
        n = min(self.policy.take(available, closed), available)
        if n == 0 and not (self.complete and not self._ready):
            return None
        items = [self._ready.popleft() for _ in range(n)]
        for i in items:
            self.held_bytes -= ITEM_OVERHEAD if i.data is None else ITEM_OVERHEAD + i.data.nbytes
        if n == available:
            if self._runs:
                self._runs.popleft()
        elif n:
            self._runs[0].count -= n
        self._last_walk = walk
        chunk = Chunk(items=items, first_seq=self._next_release, walk=walk)
        self._next_release += n
        if self.complete and not self._ready:
            chunk.last = True
            self.finished = True
        return chunk
