"""The frontend's heartbeats: numbered, each listing the calls the frontend holds (pure).

The conductor ends a call its frontend's heartbeats no longer list (docs/design.md,
"Reconciliation"). A call's open carries `taken()`, the number of the last heartbeat built
before the frontend took it, so the conductor counts only heartbeats built after: one built
before and delivered late says nothing of the call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from shared.bus import wire

# The most calls a heartbeat lists: about 27 bytes each, so 4096 stay near 110 KB, within
# any server's max_payload. A frontend holding more lists none (None), and none of its calls
# is ended by its heartbeats until it holds fewer.
LISTED_MAX = 4096


class Beats:
    """`next()` builds the next heartbeat of frontend `frontend_id` from `held` (cid -> call,
    the service's own live calls, read as the heartbeat is built)."""

    def __init__(self, frontend_id: str, held: Mapping[str, object], limit: int = LISTED_MAX) -> None:
        self.frontend_id = frontend_id
        self.held = held
        self.limit = limit
        self.count = 0  # heartbeats built so far

    def taken(self) -> int:
        """For a call taken now (put in `held` with no await between): every heartbeat numbered
        above this one lists it while it is held."""
        return self.count

    def next(self) -> bytes:
        self.count += 1
        calls = sorted(self.held) if len(self.held) <= self.limit else None
        return wire.encode(wire.FrontendHeartbeat(frontend_id=self.frontend_id, ts=time.time(), beat=self.count, calls=calls))
