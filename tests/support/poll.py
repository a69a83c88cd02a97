"""Waiting for a state, not for a time: poll a predicate until it holds or a deadline passes.

A fixed sleep either waits too long (a slow suite) or too little (a flaky one on a busy
machine); a poll returns as soon as the state is there and says what never came.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

INTERVAL_S = 0.05  # short against any timeout a test waits on, long enough not to busy the loop


@overload
async def until(predicate: Callable[[], Awaitable[T]], timeout: float, what: str, interval: float = ...) -> T: ...
@overload
async def until(predicate: Callable[[], T], timeout: float, what: str, interval: float = ...) -> T: ...
async def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = INTERVAL_S) -> Any:
    """The predicate's first truthy value, polled every `interval` seconds (plain or async);
    TimeoutError naming `what` (and the last value) if none comes within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout} s (last: {got!r})")
        await asyncio.sleep(interval)


def until_sync(predicate: Callable[[], T], timeout: float, what: str, interval: float = INTERVAL_S) -> T:
    """`until` for tests that are not async (a subprocess's state, a file)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout} s (last: {got!r})")
        time.sleep(interval)
