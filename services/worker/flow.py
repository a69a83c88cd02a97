"""How much call input a worker holds (pure): flow control from the stream.

Every item of a call's input (client streams, and edges from other partitions) is in the
stream before any worker sees it, so a worker never has to hold more than it is about to
step. Each worker takes input at its own pace, in bytes of items held in its stream
buffers (`chunking.item_bytes`), per partition of a call (a "call" below):

- **Live input** of a call is taken while the call holds less than `call_bytes` and the
  worker less than `worker_bytes`. Past that, the call is paused (`repair.InputReads`):
  its live input is dropped unread (it stays in the stream), and a read of the stream
  takes it instead, at the worker's pace.
- **A read** hands an item on under the same bounds, or whenever the call has nothing to
  step; otherwise it stops, and reads on from where it stopped once there is room again
  (`has_room`).
- **Room** comes back when the call holds less than half of `call_bytes` (so a paused call
  does not flip between reading and live input for every step) and the worker less than
  `worker_bytes`; or at once for a call with nothing left to step, so a call is never
  starved by the others (nor by a chunk policy that waits for more items than the bound
  holds).

So a worker holds at most `worker_bytes`, plus for each call what one step of it needs,
whatever its clients send; a client that sends faster than the model steps only makes its
input wait in the stream, and no call fails for its pace.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class Bounds:
    call_bytes: int = 2 * MIB
    worker_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        if self.call_bytes <= 0 or self.worker_bytes <= 0:
            raise ValueError(f"bounds must be > 0, got {self}")

    def take(self, call_held: int, worker_held: int) -> bool:
        """A live item may be held: the call and the worker are under their bounds."""
        return call_held < self.call_bytes and worker_held < self.worker_bytes

    def read_take(self, call_held: int, worker_held: int, call_has_chunk: bool) -> bool:
        """An item a read brings may be held: under the bounds, or needed for the call's next step."""
        return not call_has_chunk or self.take(call_held, worker_held)

    def has_room(self, call_held: int, worker_held: int, call_has_chunk: bool) -> bool:
        """A paused call may read on, or take live input again."""
        if not call_has_chunk:
            return True
        return 2 * call_held < self.call_bytes and worker_held < self.worker_bytes
