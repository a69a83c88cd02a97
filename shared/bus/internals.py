"""The one place that uses nats-py's private attributes.

nats-py gives each subscription a queue and a task, so every message costs a queue put,
a task switch and a coroutine; a worker or frontend with hundreds of live calls spends a
large part of its time on that. `subscribe_direct` replaces the queue with an object that
hands each message to a plain function from the client's read loop. It relies on three
private attributes of `nats.aio.subscription.Subscription` (`_pending_queue`,
`_wait_for_msgs_task`, `_pending_size`); `missing_internals()` names any a nats-py upgrade
moved, and tests/test_bus_direct.py fails loudly on it. Where they are missing at run time
the subscription falls back to an ordinary callback, and says so once in the log.

`GuardedClient` is nats-py's client with one method mended: a PONG that comes after its
flush timed out killed the read loop (docs/reliability.md, *A NATS pause*), leaving the
connection deaf for minutes. `reading()` tells whether a client's read loop still runs
(shared/bus/link.py watches it). Both rely on private attributes of
`nats.aio.client.Client` (`_pongs`, `_pings_outstanding`, `_reading_task`);
`missing_client_internals()` names any an upgrade moved (tests/test_nats_py_pong.py).
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
CLIENT_PRIVATE = ("_pongs", "_pings_outstanding", "_reading_task")
_warned = False


class GuardedClient(Client):
    """nats-py's client, whose read loop survives a PONG that nobody waits for any more.

    `flush(timeout)` queues a future for its PING's PONG and, on a timeout, cancels it but
    leaves it queued. The late PONG then pops it and sets its result: InvalidStateError,
    which ends the read loop (nats-py 2.16.0, `Client._process_pong`). Here that PONG is
    taken as the cancelled ping's own answer and dropped; a later one answers the next ping,
    as the server answers pings in order. (The patch proposed upstream does the same.)"""

    async def _process_pong(self) -> None:
        pongs = getattr(self, "_pongs", None)
        if pongs and pongs[0].done():
            pongs.pop(0)
            self._pings_outstanding = 0  # the server answers: not stale
            return
        await super()._process_pong()


def missing_client_internals(nc: Client) -> list[str]:
    """The private attributes of the client that GuardedClient and `reading` rely on and
    `nc` lacks (or whose kind changed)."""
    missing = [a for a in CLIENT_PRIVATE if not hasattr(nc, a)]
    if "_pongs" not in missing and not isinstance(nc._pongs, list):
        missing.append("_pongs (no longer a list)")
    return missing


def reading(nc: Client) -> bool:
    """Whether the client's read loop runs (true too where nats-py's internals moved: then
    it cannot be told, and the stale-connection check is what is left)."""
    task = getattr(nc, "_reading_task", None)
    if not isinstance(task, asyncio.Task):
        return True
    return not task.done()


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


class LazyInbox:
    """One wildcard inbox subscription, made on first use, whose messages reach `handler` from
    the read loop (`subscribe_direct`). Replies are addressed to `{prefix}.{token}`, and the
    handler routes each by the reply subject's last token: one subscription serves every
    request in flight, where nats-py's own request path makes a future and a lookup each."""

    def __init__(self, nc: Client, handler: Callable[[Msg], None]) -> None:
        self._nc, self._handler = nc, handler
        self._prefix = ""
        self._ready = asyncio.Lock()

    async def prefix(self) -> str:
        if self._prefix:
            return self._prefix
        async with self._ready:
            if not self._prefix:
                prefix = self._nc.new_inbox()
                await subscribe_direct(self._nc, f"{prefix}.*", self._handler)
                self._prefix = prefix
        return self._prefix
