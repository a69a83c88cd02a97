"""The frontend's heartbeats: numbered, each listing the calls the frontend holds (pure).

The conductor ends a call its frontend's heartbeats no longer list (docs/design.md,
"Reconciliation"). A call's open carries `taken()`, the number of the last heartbeat built
before the frontend took it, so the conductor counts only heartbeats built after: one built
before and delivered late says nothing of the call.

A call can move to another frontend (a realtime session resumed there). The taker lists it
as `adopted`, with its number of moves, which makes it the call's frontend for the
conductor; the frontend that let it go lists it still (`lend`) until the taker says its
heartbeat is stored (`returned`), so no listing in between leaves the call out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shared.bus import wire

# The most calls a heartbeat lists: about 27 bytes each, so 4096 stay near 110 KB, within
# any server's max_payload. A frontend holding more lists none (None), and none of its calls
# is ended by its heartbeats until it holds fewer.
LISTED_MAX = 4096


class Beats:
    """`next()` builds the next heartbeat of frontend `frontend_id` from `held` (cid -> call,
    the service's own live calls, read as the heartbeat is built; a call's `moves`, where it
    has one above 0, says it was taken over from another frontend)."""

    def __init__(self, frontend_id: str, held: Mapping[str, Any], limit: int = LISTED_MAX) -> None:
        self.frontend_id = frontend_id
        self.held = held
        self.limit = limit
        self.count = 0  # heartbeats built so far
        self.lent: set[str] = set()  # calls let go to another frontend, listed until it has them

    def lend(self, cid: str) -> None:
        """The call moved to another frontend: listed still, until `returned`."""
        self.lent.add(cid)

    def returned(self, cid: str) -> bool:
        """The frontend that took the call lists it now: this one no more. False: not lent (any more)."""
        if cid not in self.lent:
            return False
        self.lent.discard(cid)
        return True

    def taken(self) -> int:
        """For a call taken now (put in `held` with no await between): every heartbeat numbered
        above this one lists it while it is held."""
        return self.count

    def next(self) -> bytes:
        self.count += 1
        calls: list[str] | None = None
        adopted: dict[str, int] = {}
        if len(self.held) + len(self.lent) <= self.limit:
            calls = sorted(self.lent.union(self.held))
            adopted = {cid: moves for cid, call in self.held.items() if (moves := getattr(call, "moves", 0))}
        hb = wire.FrontendHeartbeat(frontend_id=self.frontend_id, ts=time.time(), beat=self.count, calls=calls, adopted=adopted)
        return wire.encode(hb)
