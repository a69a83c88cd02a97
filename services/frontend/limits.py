"""The limits a server needs (pure): a cap on connections, timeouts for what a client leaves
unfinished or unread, and one memory budget for all of a frontend's connections together.

Every connection (a TCP connection's HTTP or WebSocket protocol, and a one-shot's buffers)
is a `Conn` registered with the frontend's one `Guard`. A connection says what it holds
and since when it has waited (`Load`); the guard decides which to end and why (`Shed`);
the connection ends itself. The guard hears of growth as it happens (`report`), so the
budget holds within one read, and looks at every connection periodically (`sweep`), for
the timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.runtime.config import ServingConfig

OFFENDER_MIN = 64 * 1024  # a connection holding less is never closed for the budget


@dataclass(frozen=True)
class Shed:
    """Why a connection is ended, and how the client is told."""

    key: str  # the config key of the limit
    reason: str  # the close reason / error text (it starts with the key)
    ws_code: int  # WebSocket close code
    http_status: int  # for an HTTP request still being read
    drop: bool = False  # no goodbye: the client is not reading, a close frame would only wait


@dataclass
class Load:
    """What one connection holds now, and since when it has waited on its client."""

    input: int = 0  # bytes of client input held: partial or queued messages, a body being read
    output: int = 0  # bytes of output waiting for the client
    headers_since: float | None = None  # an HTTP request's headers unfinished since
    message_since: float | None = None  # a WebSocket message or request body unfinished since
    stalled_since: float | None = None  # output waiting and none of it taken since
    idle_since: float | None = None  # a WebSocket with no call and no message (none under way) since

    @property
    def held(self) -> int:
        return self.input + self.output


class Conn(Protocol):
    def load(self, now: float) -> Load: ...
    def shed(self, why: Shed) -> None: ...


@dataclass(frozen=True)
class Limits:
    max_connections: int
    memory_bytes: int
    send_buffer_bytes: int  # output waiting for one client before its outputs wait in the stream
    header_timeout_s: float
    message_timeout_s: float
    send_timeout_s: float
    idle_timeout_s: float

    @classmethod
    def from_config(cls, c: ServingConfig) -> Limits:
        return cls(
            max_connections=c.max_connections,
            memory_bytes=c.frontend_memory_bytes,
            send_buffer_bytes=c.max_send_buffer_bytes,
            header_timeout_s=c.header_timeout_s,
            message_timeout_s=c.message_timeout_s,
            send_timeout_s=c.send_timeout_s,
            idle_timeout_s=c.socket_idle_timeout_s,
        )

    @property
    def sweep_s(self) -> float:
        """How often the timeouts are checked: often enough that none runs much over."""
        return min(1.0, self.header_timeout_s / 4, self.message_timeout_s / 4, self.idle_timeout_s / 4)

    def headers(self) -> Shed:
        text = f"header_timeout_s: request headers not complete in {self.header_timeout_s:g} s"
        return Shed("header_timeout_s", text, 1008, 408)

    def message(self) -> Shed:
        text = f"message_timeout_s: a message (or request body) not complete in {self.message_timeout_s:g} s"
        return Shed("message_timeout_s", text, 1008, 408)

    def not_reading(self) -> Shed:
        text = f"send_timeout_s: the client read none of its waiting output for {self.send_timeout_s:g} s"
        return Shed("send_timeout_s", text, 1008, 503, drop=True)

    def idle(self) -> Shed:
        return Shed("socket_idle_timeout_s", f"socket_idle_timeout_s: no call for {self.idle_timeout_s:g} s", 1000, 408)

    def memory(self) -> Shed:
        mb = self.memory_bytes / (1024 * 1024)
        return Shed("frontend_memory_mb", f"frontend_memory_mb: the frontend's buffers are full ({mb:g} MiB)", 1013, 503)

    def verdict(self, load: Load, now: float) -> Shed | None:
        """The timeout this connection has run past, if any."""
        if load.headers_since is not None and now - load.headers_since > self.header_timeout_s:
            return self.headers()
        if load.message_since is not None and now - load.message_since > self.message_timeout_s:
            return self.message()
        if load.stalled_since is not None and now - load.stalled_since > self.send_timeout_s:
            return self.not_reading()
        if load.idle_since is not None and now - load.idle_since > self.idle_timeout_s:
            return self.idle()
        return None


class Guard:
    """A frontend's connections, against its limits. No I/O; `now` is a monotonic clock."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._held: dict[Conn, int] = {}  # bytes each last reported; oldest connection first
        self._counted: set[Conn] = set()  # those that count against max_connections
        self.total = 0  # sum of _held
        self.shed_count: dict[str, int] = {}  # config key -> connections ended by it (for /healthz)

    def __len__(self) -> int:
        return len(self._counted)

    def admit(self, conn: Conn) -> bool:
        """A new TCP connection; False past max_connections (it is refused, not registered)."""
        if len(self._counted) >= self.limits.max_connections:
            self.shed_count["max_connections"] = self.shed_count.get("max_connections", 0) + 1
            return False
        self.adopt(conn)
        return True

    def adopt(self, conn: Conn, counted: bool = True) -> None:
        """A connection already admitted, under another protocol now (a WebSocket upgrade), or
        (counted=False) buffers of the app's own that belong to an admitted one (a one-shot)."""
        self._held[conn] = 0
        if counted:
            self._counted.add(conn)

    def release(self, conn: Conn) -> None:
        self.total -= self._held.pop(conn, 0)
        self._counted.discard(conn)

    def report(self, conn: Conn, held: int, now: float) -> list[tuple[Conn, Shed]]:
        """A connection's buffers changed to `held` bytes; the connections to end, if that put
        the frontend over its budget."""
        if conn not in self._held:
            return []
        self.total += held - self._held[conn]
        self._held[conn] = held
        if self.total <= self.limits.memory_bytes:
            return []
        return self._over_budget({c: c.load(now) for c in self._held})

    def buffered(self, now: float) -> tuple[int, int]:
        """(input, output) bytes all connections hold now, looked at afresh (for /healthz)."""
        loads = [c.load(now) for c in self._held]
        return sum(x.input for x in loads), sum(x.output for x in loads)

    def sweep(self, now: float) -> list[tuple[Conn, Shed]]:
        """Every connection looked at: those past a timeout, then those over the budget."""
        loads = {c: c.load(now) for c in self._held}
        out: list[tuple[Conn, Shed]] = []
        for conn, load in loads.items():
            why = self.limits.verdict(load, now)
            if why is not None:
                out.append((conn, why))
        for conn, _ in out:
            loads.pop(conn)
        self._refresh(loads)
        for conn, why in out:
            self._forget(conn)
            self._count(why)
        if self.total > self.limits.memory_bytes:
            out.extend(self._over_budget(loads))
        return out

    def _count(self, why: Shed) -> None:
        self.shed_count[why.key] = self.shed_count.get(why.key, 0) + 1

    def _refresh(self, loads: dict[Conn, Load]) -> None:
        for conn, load in loads.items():
            self._held[conn] = load.held
        self.total = sum(self._held.values())

    def _forget(self, conn: Conn) -> None:
        """Ended: its bytes no longer count (it frees them as it closes) and it is not chosen again."""
        self.total -= self._held.pop(conn, 0)
        self._counted.discard(conn)

    def _over_budget(self, loads: dict[Conn, Load]) -> list[tuple[Conn, Shed]]:
        """The newest connections that hold more than OFFENDER_MIN, until the rest fit."""
        self._refresh(loads)
        out: list[tuple[Conn, Shed]] = []
        for conn in reversed(list(self._held)):
            if self.total <= self.limits.memory_bytes:
                break
            if self._held[conn] >= OFFENDER_MIN:
                why = self.limits.memory()
                self._forget(conn)
                self._count(why)
                out.append((conn, why))
        return out
