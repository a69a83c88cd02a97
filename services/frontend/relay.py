"""One call's outputs on their way to its client (pure): per-partition seq order.

Outputs reach the frontend on core NATS subscriptions, so one can be lost in transit, and
after a worker is replaced its successor publishes again what was relayed already. Every
output is also in the stream. The relay decides, from what arrived and when: what goes to
the client now, what waits for an earlier one (bounded), what is a repeat, when a read of
the stream is due, and when the fin's counts are met. The output side (`outputs.py`) does the
reading and the sending.

Flow control: a client slower than its call's outputs is not sent more than its
connection holds (`outbox.Outbox.has_room`). Past that the relay falls *behind*: live
outputs are not taken (they wait in the stream), and once the client has room `outputs.py`
reads them from the stream, from where the relay is, at the client's pace, as it does for
a lost output. A slow reader loses nothing and the frontend holds a bounded amount for it.
"""

from __future__ import annotations

RECOVER_S = 0.3  # an output missing this long (after a gap or a fin) is read from the stream
GRACE_S = 3.0  # after a fin, how long with no output relayed before finishing with outputs missing
MAX_HELD = 10_000  # outputs held ahead of a gap; past it they are dropped and read again from the stream
MAX_HELD_BYTES = 1024 * 1024  # or this many bytes of them


class OutputRelay:
    """The state of one call's relay. No I/O; `now` is a monotonic clock."""

    def __init__(self, max_held: int = MAX_HELD, max_held_bytes: int = MAX_HELD_BYTES) -> None:
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.next_out: dict[str, int] = {}  # partition -> next seq to relay
        self.held: dict[tuple[str, int], bytes] = {}  # arrived ahead of a gap
        self.held_bytes = 0
        self.gap_since: float | None = None  # when the oldest held output started waiting
        # The stream sequence a read has handled everything up to: every output stored at or
        # before it has been relayed or is held, so the next read starts after it.
        self.read_to = 0
        self.counts: dict[str, int] | None = None  # the fin's outputs per partition, once it came
        self.fin_at = 0.0
        self.progress_at = 0.0  # the last time an output went to the client (or the fin came)
        self.behind = False  # live outputs are not taken: the client had no room for them
        self.drops = 0  # live outputs not taken, ever (a read that saw some dropped reads again)

    @property
    def relayed(self) -> int:
        """Outputs sent to the client so far, every partition together."""
        return sum(self.next_out.values())

    def accept(self, partition: str, seq: int, event: bytes, now: float) -> list[bytes]:
        """One output as it arrived; returns the events to send now, in order (empty for a
        repeat, or for one ahead of a gap, which is held)."""
        nxt = self.next_out.get(partition, 0)
        if seq < nxt:
            return []  # a replay after a worker was replaced, or read again from the stream
        if seq > nxt:
            if (partition, seq) in self.held:
                return []
            if len(self.held) < self.max_held and self.held_bytes + len(event) <= self.max_held_bytes:
                self.held[(partition, seq)] = event
                self.held_bytes += len(event)
                self.gap_since = self.gap_since or now
            else:
                # Dropped. It may be stored before `read_to` (it came from a read), so the
                # next read starts from the beginning of the call.
                self.read_to = 0
            return []
        out = [event]
        nxt += 1
        while (partition, nxt) in self.held:
            event = self.held.pop((partition, nxt))
            self.held_bytes -= len(event)
            out.append(event)
            nxt += 1
        self.next_out[partition] = nxt
        if not self.held:
            self.gap_since = None
        self.progress_at = now
        return out

    def fall_behind(self) -> None:
        """A live output was not taken: the client has no room. It waits in the stream."""
        self.behind = True
        self.drops += 1

    def caught_up(self) -> None:
        """A read of the stream went to its end with room to spare: live outputs are taken again."""
        self.behind = False

    def read(self, stream_seq: int) -> None:
        """A read of the stream handled the message stored at `stream_seq`."""
        self.read_to = stream_seq

    def hand_over(self) -> tuple[dict[str, int], int]:
        """The call moves to another frontend (a realtime session resumed there): the outputs
        relayed per partition, and the stream sequence its read of the stream starts after,
        which takes up everything not relayed here. Outputs held ahead of a gap are not handed
        over: where there are some, that read starts from the beginning of the call."""
        return dict(self.next_out), 0 if self.held else self.read_to

    @classmethod
    def taken_over(cls, next_out: dict[str, int], read_to: int) -> OutputRelay:
        """The relay of a call taken over from another frontend (`hand_over`), whose next read
        of the stream (due at once) relays what that one did not."""
        relay = cls()
        relay.next_out = dict(next_out)
        relay.read_to = read_to
        return relay

    def fin(self, counts: dict[str, int], now: float) -> None:
        """The fin came: `counts` outputs per partition make the call complete."""
        self.counts = counts
        self.fin_at = now
        self.progress_at = now

    @property
    def complete(self) -> bool:
        """The fin came and every output it counts has been relayed."""
        return self.counts is not None and all(self.next_out.get(p, 0) >= n for p, n in self.counts.items())

    def read_due(self, now: float, room: bool) -> bool:
        """A read of the stream is due: behind, and the client has room again; or an output
        has been missing for RECOVER_S (behind a gap, or counted by the fin)."""
        if self.behind:
            return room
        return self.recovery_due(now)

    def recovery_due(self, now: float) -> bool:
        """An output has been missing for RECOVER_S: behind a gap, or counted by the fin."""
        if self.gap_since is not None and now - self.gap_since > RECOVER_S:
            return True
        return self.counts is not None and not self.complete and now - self.fin_at > RECOVER_S

    def give_up_due(self, now: float, reading: bool = False) -> bool:
        """The fin counts outputs that reads of the stream have not brought for GRACE_S (not
        while they wait for the client to have room: `send_timeout_s` judges a client that
        reads nothing; nor while a read is under way: a server busy with twenty uploads took
        longer than GRACE_S to answer one, and the call was finished with its outputs in the
        stream)."""
        if self.counts is None or self.complete or self.behind or reading:
            return False
        return now - self.progress_at > GRACE_S
