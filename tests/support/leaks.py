"""NATS clients a test module leaves open. The suite shares one event loop, so a client a
module forgot keeps reconnecting to its stopped server in every later module, and its
"NATS: connect call failed" lines land in a later test's captured log (one test counting
its own warnings once read three). Each module's leftovers are closed when it ends and
named at the end of the run, so the leak is fixed where it is made."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

_opened: list[Client] = []
left_open: dict[str, int] = {}  # module → clients it left open


def record_connects() -> None:
    """Wrap nats-py's connect once, so every client the test process connects is known."""
    connect: Callable[..., Awaitable[None]] = Client.connect
    if getattr(connect, "_recorded", False):
        return

    async def recorded(self: Client, *args: Any, **kwargs: Any) -> None:
        _opened.append(self)
        await connect(self, *args, **kwargs)

    recorded._recorded = True  # type: ignore[attr-defined]
    Client.connect = recorded  # type: ignore[method-assign]


def mark() -> int:
    return len(_opened)


async def close_since(start: int, module: str) -> None:
    """Close the clients opened since `start` that are still open, and count them for `module`."""
    leftovers = [nc for nc in _opened[start:] if not nc.is_closed]
    del _opened[start:]
    for nc in leftovers:
        with contextlib.suppress(Exception):  # whatever state it is in, it goes
            await nc.close()
    if leftovers:
        left_open[module] = left_open.get(module, 0) + len(leftovers)
