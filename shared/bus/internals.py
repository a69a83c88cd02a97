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

`GuardedClient` also reads a run of plain messages (`MSG`, no headers) for direct
subscriptions in a loop of its own (`FastParser`): no regular expression, state change or
coroutine per message (2.53 against 3.43 µs a message, `bench/nats_py_paths.py`). A message
cut between two reads waits in the buffer for the rest, as nats-py's parser keeps it. Everything
else (headers, pings, a subscription with a queue) goes to nats-py's own parser, and a plain
message that parser began is finished here. It relies on the parser's `buf`, `state`,
`needed`, `header_needed` and `msg_arg` and the client's `_subs`, `stats` and `msg_class`
(`CLIENT_PRIVATE`); where one is missing, the parser is nats-py's own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol import parser as nats_parser

log = logging.getLogger(__name__)

PRIVATE = ("_pending_queue", "_wait_for_msgs_task", "_pending_size")
CLIENT_PRIVATE = ("_pongs", "_pings_outstanding", "_reading_task", "_ps", "_subs", "msg_class", "stats")
PARSER_PRIVATE = ("buf", "state", "nc", "needed", "header_needed", "msg_arg")
_warned = False


class GuardedClient(Client):
    """nats-py's client, whose read loop survives a PONG that nobody waits for any more.

    `flush(timeout)` queues a future for its PING's PONG and, on a timeout, cancels it but
    leaves it queued. The late PONG then pops it and sets its result: InvalidStateError,
    which ends the read loop (nats-py 2.16.0, `Client._process_pong`). Here that PONG is
    taken as the cancelled ping's own answer and dropped; a later one answers the next ping,
    as the server answers pings in order. (The patch proposed upstream does the same.)

    Its parser is `FastParser`, which hands a plain message for a direct subscription over
    in a loop of its own (`_deliver_direct`)."""

    def __init__(self) -> None:
        super().__init__()
        if not missing_parser_internals(self):
            self._ps = FastParser(self)

    async def _process_pong(self) -> None:
        pongs = getattr(self, "_pongs", None)
        if pongs and pongs[0].done():
            pongs.pop(0)
            self._pings_outstanding = 0  # the server answers: not stale
            return
        await super()._process_pong()

    def _deliver_direct(self, sid: int, subject: bytes | bytearray, reply: bytes | bytearray, payload: bytes) -> bool:
        """A plain message to a direct subscription, handed over at once (False: not one,
        for nats-py's `_process_msg`). Counted as nats-py counts it."""
        sub = self._subs.get(sid)
        if sub is None or sub._max_msgs > 0:
            return False
        queue: object = sub._pending_queue
        if not isinstance(queue, _Direct):
            return False
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(payload)
        sub._received += 1
        queue.deliver(
            self.msg_class(subject=subject.decode(), reply=reply.decode(), data=payload, headers=None, _client=self, _sid=sid)
        )
        return True


class FastParser(nats_parser.Parser):
    """nats-py's parser, with a loop of its own for the message a service gets most: a plain
    `MSG` (no headers) for a direct subscription, whole or cut between reads. What that loop
    does not take is left in the buffer for nats-py's own `parse`, in order."""

    nc: GuardedClient

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        nc = self.nc
        while True:
            if self.state == nats_parser.AWAITING_MSG_PAYLOAD and not self.header_needed:
                # A plain message nats-py's parser began (after something only it takes): its
                # payload is finished here, so the run of messages after it is this loop's.
                arg = self.msg_arg
                sid, subject, reply, start = arg["sid"], arg["subject"], arg["reply"], 0
                stop = self.needed
            elif self.state == nats_parser.AWAITING_CONTROL_LINE and buf.startswith(b"MSG "):
                end = buf.find(b"\r\n", 4, nats_parser.MAX_CONTROL_LINE_SIZE)
                if end < 0:
                    if len(buf) < nats_parser.MAX_CONTROL_LINE_SIZE:
                        return  # the line is still coming: kept for the next read, as nats-py keeps it
                    break  # a longer line than this loop reads: nats-py's parser takes it
                parts = buf[4:end].split(b" ")  # subject, sid, [reply,] size
                if len(parts) == 3:
                    subject, sid_text, size = parts
                    reply = b""
                elif len(parts) == 4:
                    subject, sid_text, reply, size = parts
                else:
                    break  # malformed: nats-py's parser refuses it
                if not (sid_text.isdigit() and size.isdigit()):
                    break
                sid, start = int(sid_text), end + 2
                stop = start + int(size)
            else:
                break
            if len(buf) < stop + 2:
                # The payload is still coming. Left in the buffer, not handed to nats-py's parser
                # half read: a read that ends inside a message is the rule under load, and
                # nats-py's parser, once it holds one, would take the whole next read too.
                return
            payload = bytes(buf[start:stop])
            del buf[: stop + 2]
            self.state = nats_parser.AWAITING_CONTROL_LINE
            # Handed over with no coroutine (the point of this loop); only nats-py's own way awaits.
            if not nc._deliver_direct(sid, subject, reply, payload):
                await nc._process_msg(sid, bytes(subject), bytes(reply), payload, None)  # type: ignore[arg-type]
                buf = self.buf  # a reconnect while it waited gives the parser a new one
        if self.buf:
            await super().parse(b"")


def missing_parser_internals(nc: Client) -> list[str]:
    """What `FastParser` relies on that nats-py's parser (or its module) lacks."""
    ps: Any = getattr(nc, "_ps", None)
    missing = [f"_ps.{a}" for a in PARSER_PRIVATE if not hasattr(ps, a)]
    for name in ("AWAITING_CONTROL_LINE", "AWAITING_MSG_PAYLOAD", "MAX_CONTROL_LINE_SIZE"):
        if not hasattr(nats_parser, name):
            missing.append(f"nats.protocol.parser.{name}")
    if "_ps.buf" not in missing and not isinstance(ps.buf, bytearray):
        missing.append("_ps.buf (no longer a bytearray)")
    return missing


def missing_client_internals(nc: Client) -> list[str]:
    """The private attributes of the client that GuardedClient and `reading` rely on and
    `nc` lacks (or whose kind changed)."""
    missing = [a for a in CLIENT_PRIVATE if not hasattr(nc, a)]
    if "_pongs" not in missing and not isinstance(nc._pongs, list):
        missing.append("_pongs (no longer a list)")
    return missing + missing_parser_internals(nc)


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
        self.deliver(msg)

    def deliver(self, msg: Msg) -> None:
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
