"""The one place that uses nats-py's private attributes.

nats-py gives each subscription a queue and a task, so every message costs a queue put,
a task switch and a coroutine; a worker or frontend with hundreds of live calls spends a
large part of its time on that. `subscribe_direct` replaces the queue with an object that
hands each message to a plain function from the client's read loop. It relies on three
private attributes of `nats.aio.subscription.Subscription` (`_pending_queue`,
`_wait_for_msgs_task`, `_pending_size`); `missing_internals()` names any a nats-py upgrade
moved, and tests/test_bus_direct.py fails loudly on it. Where they are missing at run time
the subscription falls back to an ordinary callback, and says so once in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)

PRIVATE = ("_pending_queue", "_wait_for_msgs_task", "_pending_size")
_warned = False


class _Direct:
    """Stands in for a subscription's message queue: each message goes to the handler at
    once, from the client's read loop. The methods are those nats-py calls on the queue."""

    def __init__(self, handler: Callable[[Msg], None], sub: Subscription) -> None:
        self.handler = handler
        self.sub = sub

    def put_nowait(self, msg: Msg) -> None:
        self.sub._pending_size -= len(msg.data)  # nothing waits: keep the slow-consumer check quiet
        try:
            self.handler(msg)
        except Exception:  # as a callback's would be: logged, and the subscription goes on
            log.exception("handling a message on %s failed", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


def missing_internals(sub: Subscription) -> list[str]:
    """The private attributes this module relies on that `sub` lacks, or whose kind changed."""
    missing = [a for a in PRIVATE if not hasattr(sub, a)]
    if not missing:
        if not isinstance(sub._pending_queue, asyncio.Queue | _Direct):
            missing.append("_pending_queue (no longer an asyncio.Queue)")
        if not isinstance(sub._wait_for_msgs_task, asyncio.Task):
            missing.append("_wait_for_msgs_task (no longer an asyncio.Task)")
    return missing


def is_direct(sub: Subscription) -> bool:
    return isinstance(getattr(sub, "_pending_queue", None), _Direct)


async def subscribe_direct(nc: Client, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    """A core subscription whose messages reach a plain function from the read loop. The
    handler must not block; it starts a task for any work that awaits."""
    global _warned

    async def cb(msg: Msg) -> None:
        handler(msg)

    sub = await nc.subscribe(subject, cb=cb)
    missing = missing_internals(sub)
    if missing:
        if not _warned:
            _warned = True
            log.warning("nats-py internals moved (%s): subscriptions use ordinary callbacks", ", ".join(missing))
        return sub
    queue, task = sub._pending_queue, sub._wait_for_msgs_task
    assert isinstance(task, asyncio.Task)  # checked by missing_internals
    task.cancel()
    sub._pending_queue = _Direct(handler, sub)  # duck-typed: the methods nats-py calls on its queue
    while not queue.empty():  # anything that came in while subscribing
        sub._pending_queue.put_nowait(queue.get_nowait())
    return sub
