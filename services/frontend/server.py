"""The frontend's HTTP server: uvicorn's, with the bounded stop every duplexbus service has.

The conductor and the workers stop under `process.run_until_stopped`; the frontend's loop
is uvicorn's, which on its own waits for every connection and then for the app's shutdown
for as long as they take (a response still streaming, an abort waiting on a NATS that is
gone). Here a stop signal arms `process.exit_after(process.stop_bound_s(drain + unlist))`,
starts the drain at once, for the one-shots' calls too (the WebSocket connections start it
as well: `websocket.py`). The listener stays open for `shutdown_unlist_s` more, while
/healthz and every new call answer 503 before anything is read (`app.py`): a gateway that sent a
call there in the seconds its checks take to mark this frontend down gets an answer it may
retry elsewhere, where a closed listener would leave it retrying, and failing, on the same
address. Then uvicorn stops: it waits for connections up to the drain plus `STOP_GRACE_S`,
the app leaves the bus within `service.LEAVE_S`, and whatever still holds the process past
the bound is cut short. A second signal stops it at once.

`serve` wires the frontend's app and its protocol classes into that server: what
`duplexbus frontend` runs once it has parsed its flags. With a `health_port` it also answers
/livez and /readyz there, on `health_host`: `duplexbus up` runs its frontends on one shared
port, where one frontend's /livez cannot be told from another's, and probes each there.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from types import FrameType

import uvicorn

from services.frontend.app import create_app
from services.frontend.exposure import warn_if_open
from services.frontend.http import FrontendHttpProtocol
from services.frontend.websocket import DRAIN, FrontendWebSocketProtocol
from shared.runtime.config import ServingConfig
from shared.runtime.health import HealthServer
from shared.runtime.process import STOP_GRACE_S, exit_after, stop_bound_s, tune_gc


def serve(cfg: ServingConfig, host: str, port: int, fd: int | None = None, health_port: int | None = None) -> None:
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
    server = FrontendServer(config, cfg.shutdown_drain_s, cfg.shutdown_unlist_s)
    if health_port is not None:
        readiness = app.state.service.readiness
        server.health = HealthServer(None, readiness, host=cfg.health_host, port=health_port, live=readiness.live)
    server.run(sockets=sockets)


class FrontendServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_s: float, unlist_s: float = 0.0) -> None:
        config.timeout_graceful_shutdown = math.ceil(drain_s + STOP_GRACE_S)  # (whole seconds)
        super().__init__(config)
        self.drain_s = drain_s
        self.unlist_s = unlist_s
        self._hard_stop: threading.Timer | None = None
        # The first stop signal, and when: uvicorn is told of it `unlist_s` later (`on_tick`).
        self._signalled: tuple[int, FrameType | None, float] | None = None
        self._drain_started = False
        self.health: HealthServer | None = None  # /livez and /readyz on a port of their own

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.health is not None:
            await self.health.start()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The stop signal (in the main thread, between two steps of the loop): the drain
        starts at the loop's next tick, the listener closes `unlist_s` later."""
        if self._hard_stop is None:
            self._hard_stop = exit_after(stop_bound_s(self.drain_s + self.unlist_s), "frontend")
        if self._signalled is None and self.unlist_s > 0:
            self._signalled = (sig, frame, time.monotonic())
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s in uvicorn's main loop: in the loop, where the drain may be started."""
        if self._signalled is not None and not self.should_exit:
            sig, frame, at = self._signalled
            if not self._drain_started:
                self._drain_started = True
                _start_drain(self)
            if time.monotonic() - at >= self.unlist_s:
                super().handle_exit(sig, frame)  # uvicorn's own stop from here, the signal kept for its exit
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        _start_drain(self)  # (once: the service's drain is one however often it is asked for)
        await super().shutdown(sockets)
        if self.health is not None:  # answered until here: a draining frontend is alive
            await self.health.close()
        # The hard stop stays armed (a daemon thread: it does not hold up the exit): what is
        # left, the loop's own shutdown, waits on threads that may be stuck.


def _start_drain(server: uvicorn.Server) -> None:
    """The app's drain, once its lifespan has started (the service's drain is one however
    often it is asked for). A function, not a method: the server's own methods are uvicorn's."""
    drain = getattr(server.lifespan, "state", {}).get(DRAIN)
    if drain is not None:
        drain()
