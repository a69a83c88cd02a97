"""The frontend's HTTP server: uvicorn's, with the bounded stop every duplexbus service has.

The conductor and the workers stop under `process.run_until_stopped`; the frontend's loop
is uvicorn's, which on its own waits for every connection and then for the app's shutdown
for as long as they take (a response still streaming, an abort waiting on a NATS that is
gone). Here a stop signal arms `process.exit_after(process.stop_bound_s(drain))`, and the
drain starts as the server starts to stop, for the one-shots' calls too (the WebSocket
connections start it as well: `websocket.py`). uvicorn then waits for connections up to the
drain plus `STOP_GRACE_S`, the app leaves the bus within `service.LEAVE_S`, and whatever
still holds the process past the bound is cut short.

`serve` wires the frontend's app and its protocol classes into that server: what
`duplexbus frontend` runs once it has parsed its flags.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from types import FrameType

import uvicorn

from services.frontend.app import create_app
from services.frontend.exposure import warn_if_open
from services.frontend.http import FrontendHttpProtocol
from services.frontend.websocket import DRAIN, FrontendWebSocketProtocol
from shared.runtime.config import ServingConfig
from shared.runtime.process import STOP_GRACE_S, exit_after, stop_bound_s, tune_gc


def serve(cfg: ServingConfig, host: str, port: int, fd: int | None = None) -> None:
    """Serve the frontend on host:port until a stop signal, or (`fd`) accept on a listening
    socket inherited from `duplexbus up`, which every frontend of it accepts on."""
    if fd is not None:
        host = socket.socket(fileno=os.dup(fd)).getsockname()[0]
    warn_if_open(host, cfg)
    app = create_app(cfg)
    tune_gc()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # Both take their limits from the app's guard (the lifespan's state).
        http=FrontendHttpProtocol,
        ws=FrontendWebSocketProtocol,
        ws_max_size=cfg.ws_max_frame_bytes,  # the app answers oversize messages itself
        ws_per_message_deflate=False,  # compressing base64 audio costs CPU and saves little
        log_level="warning",
        log_config=None,  # uvicorn's own lines go through setup_logging's handler (JSON with --log-format json)
        lifespan="on",
        ws_ping_interval=20,
    )
    sockets = [socket.socket(fileno=fd)] if fd is not None else None
    FrontendServer(config, cfg.shutdown_drain_s).run(sockets=sockets)


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
