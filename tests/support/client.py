"""A client socket for protocol tests, and what ends a call."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

import pytest
import websockets

Message = dict[str, Any]


class Predicate(Protocol):
    """A test on one message. A Protocol rather than a Callable type so that a lambda that
    binds a loop variable (`lambda m, rid=rid: ...`) still type-checks."""

    def __call__(self, m: Message, /) -> object: ...


def is_final(m: Message) -> bool:
    """Whether a reply ends its call: the finish, or an error that is not an append's (those leave the call running)."""
    return "finish" in m or ("error" in m and not m.get("append"))


class WS:
    """A client socket with a receive buffer, for protocol tests."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.inbox: list[Message] = []

    @classmethod
    async def connect(cls, url: str) -> WS:
        return cls(await websockets.connect(url, max_size=None))

    async def send(self, msg: Message | str) -> None:
        await self.ws.send(msg if isinstance(msg, str) else json.dumps(msg))

    async def recv(self, timeout: float = 10.0) -> Message:
        m: Message = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        return m

    async def until(self, pred: Predicate, timeout: float = 20.0, keep: bool = False) -> Message:
        """The first message (kept or new) matching pred; others stay in the inbox (it too, with keep)."""
        for i, m in enumerate(self.inbox):
            if pred(m):
                return m if keep else self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message; inbox: {[_short(m) for m in self.inbox[-5:]]}")
            m = await self.recv(left)
            if pred(m):
                if keep:
                    self.inbox.append(m)
                return m
            self.inbox.append(m)

    async def final(self, rid: str | None, timeout: float = 20.0) -> Message:
        """The finish or error that ends call `rid` (None: a one-shot without a request_id)."""
        return await self.until(lambda m: m.get("request_id") == rid and is_final(m), timeout)

    def outputs(self, rid: str | None) -> list[Message]:
        """The outputs of call `rid` received so far, taken out of the inbox."""
        out = [m["output"] for m in self.inbox if m.get("request_id") == rid and "output" in m]
        self.inbox = [m for m in self.inbox if not (m.get("request_id") == rid and "output" in m)]
        return out

    async def close(self) -> None:
        await self.ws.close()


async def nothing_for(ws: WS, pred: Predicate, seconds: float) -> None:
    """No message matching pred comes on `ws` for `seconds` (the others received meanwhile stay in its inbox)."""
    with pytest.raises(TimeoutError):
        await ws.until(pred, timeout=seconds)


def _short(m: Message) -> Message:
    if "output" in m and isinstance(m["output"], dict) and "audio" in m["output"]:
        return {**m, "output": {**m["output"], "audio": "..."}}
    return m
