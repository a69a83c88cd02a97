"""The frontend's HTTP server: uvicorn's, with the bounded stop every duplexbus service has.

The conductor and the workers stop under `process.run_until_stopped`; the frontend's loop
is uvicorn's, which on its own waits for every connection and then for the app's shutdown
for as long as they take (a response still streaming, an abort waiting on a NATS that is
gone). Here a stop signal arms `process.exit_after(process.stop_bound_s(drain))`, and the
drain starts as the server starts to stop, for the one-shots' calls too (the WebSocket
connections start it as well: `websocket.py`). uvicorn then waits for connections up to the
drain plus `STOP_GRACE_S`, the app leaves the bus within `service.LEAVE_S`, and whatever
still holds the process past the bound is cut short.
"""

from __future__ import annotations

import math
import socket
import threading
from types import FrameType

import uvicorn

from services.frontend.websocket import DRAIN
from shared.runtime.process import STOP_GRACE_S, exit_after, stop_bound_s


class FrontendServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_s: float) -> None:
        config.timeout_graceful_shutdown = math.ceil(drain_s + STOP_GRACE_S)  # (whole seconds)
        super().__init__(config)
        self.drain_s = drain_s
        self._hard_stop: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The stop signal (in the main thread, between two steps of the loop)."""
        if self._hard_stop is None:
            self._hard_stop = exit_after(stop_bound_s(self.drain_s), "frontend")
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = getattr(self.lifespan, "state", {}).get(DRAIN)
        if drain is not None:
            drain()
        await super().shutdown(sockets)
        # The hard stop stays armed (a daemon thread: it does not hold up the exit): what is
        # left, the loop's own shutdown, waits on threads that may be stuck.
