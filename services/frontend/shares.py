"""Fair share: how many calls one client may hold on a frontend at once (pure: no I/O).

The conductor admits up to `max_concurrent_requests` calls over all frontends, first come
first served; a client that opens request_ids as fast as it can would take every slot, and
every other client's call would get 503. So each client's calls are counted where they are
opened, and past its share an opening is refused with 429 (`TooManyCalls`, naming the key)
before anything reaches the bus; the client's other calls go on.

- A socket (`WS /generate/ws`) holds at most `max_calls_per_socket` calls: live, queued
  one-shots and openings under way alike.
- A bearer token holds at most `max_calls_per_token` on this frontend, over all its sockets,
  `POST /generate` requests and `/v1/realtime` sessions (a detached session's call counts
  until it ends). Without tokens there is no client identity to count by beyond the socket.

A share is taken before the opening's first await and given back exactly once: when the
call ends, or when its opening fails (`open_shared`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.frontend.protocol import Opening
from services.frontend.relayed_call import RelayedCall, Sink
from shared.runtime.config import ServingConfig
from shared.runtime.errors import TooManyCalls

OnEnd = Callable[[RelayedCall], None]
OpenCall = Callable[..., Awaitable[RelayedCall]]  # FrontendService.open_call(opening, sink, on_end=...)


class Shares:
    """A frontend's count of calls per token, and the caps every `Share` is held to."""

    def __init__(self, per_socket: int, per_token: int, on_refused: Callable[[TooManyCalls], None] | None = None) -> None:
        self.per_socket = per_socket
        self.per_token = per_token
        self._on_refused = on_refused
        self.by_token: dict[str, int] = {}  # token's label -> calls it holds (no entry: none)

    @classmethod
    def from_config(cls, cfg: ServingConfig, on_refused: Callable[[TooManyCalls], None] | None = None) -> Shares:
        return cls(cfg.calls_per_socket, cfg.calls_per_token, on_refused)

    def client(self, token: str | None, socket: bool) -> Share:
        """The share of one connection: a socket's (held to `per_socket`) or a request's; its
        token's label (`auth.Grant.client`), None without tokens."""
        return Share(self, token, self.per_socket if socket else None)

    def refuse(self, err: TooManyCalls) -> TooManyCalls:
        if self._on_refused is not None:
            self._on_refused(err)
        return err


class Share:
    """One connection's calls, held to its caps."""

    def __init__(self, shares: Shares, token: str | None, cap: int | None) -> None:
        self.shares = shares
        self.token = token
        self.cap = cap
        self.held = 0

    def take(self, force: bool = False) -> None:
        """One call more, or `TooManyCalls` (nothing taken); with `force`, past the caps too."""
        s = self.shares
        if not force and self.cap is not None and self.held >= self.cap:
            raise s.refuse(TooManyCalls("max_calls_per_socket", f"this socket holds {self.held} calls, the most one may"))
        if not force and self.token is not None and s.by_token.get(self.token, 0) >= s.per_token:
            held = s.by_token[self.token]
            raise s.refuse(TooManyCalls("max_calls_per_token", f"this token holds {held} calls here, the most one may"))
        self.held += 1
        if self.token is not None:
            s.by_token[self.token] = s.by_token.get(self.token, 0) + 1

    def give(self) -> None:
        """One call less (it ended, or its opening failed)."""
        self.held -= 1
        if self.token is not None:
            left = self.shares.by_token[self.token] - 1
            if left:
                self.shares.by_token[self.token] = left
            else:
                del self.shares.by_token[self.token]  # no entry per token ever seen: the map stays bounded


def moved_in(share: Share | None) -> OnEnd | None:
    """A call that moved to this frontend (a realtime session resumed here) counts within
    `share` from now on: the `on_end` that gives it back. Taken past the caps too: the socket
    gave back its own session's call just before, and a session that has left the frontend
    it was on cannot be turned away. None: no share to keep."""
    if share is None:
        return None
    share.take(force=True)
    given = False

    def ended(call: RelayedCall) -> None:
        nonlocal given
        if not given:
            given = True
            share.give()

    return ended


async def open_shared(
    share: Share | None, open_call: OpenCall, opening: Opening, sink: Sink, on_end: OnEnd | None = None
) -> RelayedCall:
    """`open_call` within `share`: taken first (a refusal raises before anything is opened),
    given back once, when the call ends or its opening fails. None: no share to keep."""
    if share is None:
        return await open_call(opening, sink, on_end=on_end)
    share.take()
    given = False

    def give_once() -> None:
        nonlocal given
        if not given:
            given = True
            share.give()

    def ended(call: RelayedCall) -> None:
        give_once()
        if on_end is not None:
            on_end(call)

    try:
        return await open_call(opening, sink, on_end=ended)
    except BaseException:
        give_once()  # (the service may have ended it already: `ended` ran, and this is a no-op)
        raise
