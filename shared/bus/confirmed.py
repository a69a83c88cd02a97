"""Publishes the stream must confirm: sent again until it has stored them.

A core publish to a stream subject is stored by the stream's leader, and dropped without a
word where the stream has none: for the seconds a cluster takes to elect another after the
node that led it died. Subscribers then connected to that node miss the message too, and a
call waits forever on an item that is neither delivered nor stored. So each such publish
carries a reply subject (as a JetStream publish does) but nothing waits on it: the stream's
ack, when it comes, takes the message off `Unconfirmed`; one with no ack within `wait_s`,
or refused (no leader: 503), is published again, until one is stored. Every item and output
carries a seq, and every reader drops a seq it has seen, so a repeat is harmless.

`Unconfirmed` is the bookkeeping (pure: the caller sends and tells the time);
`BusConnection.publish` wires it to the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from shared.bus.failures import mapped
from shared.bus.internals import subscribe_direct
from shared.runtime.errors import BusError

log = logging.getLogger(__name__)

WAIT_S = 2.0  # no ack this long: sent again (an ack takes a millisecond; a leader election seconds)
MAX_BYTES = 64 * 1024 * 1024  # unconfirmed at most; past it a publisher waits
STATUS = "Status"  # the header of a server's status reply (503: no responders)


@dataclass
class Sent:
    subject: str
    body: bytes
    headers: dict[str, str] | None
    at: float  # when it was last published


class Unconfirmed:
    def __init__(self, wait_s: float, max_bytes: int) -> None:
        self.wait_s = wait_s
        self.max_bytes = max_bytes
        self.bytes = 0
        self.resent = 0
        self._sent: OrderedDict[int, Sent] = OrderedDict()  # the oldest publish first
        self._next = 0

    def __len__(self) -> int:
        return len(self._sent)

    @property
    def full(self) -> bool:
        """Past max_bytes unconfirmed: a publisher waits (the stream is not keeping up)."""
        return self.bytes >= self.max_bytes

    def add(self, subject: str, body: bytes, headers: dict[str, str] | None, now: float) -> int:
        """A publish about to be sent: its token (the last part of its reply subject)."""
        self._next += 1
        self._sent[self._next] = Sent(subject, body, headers, now)
        self.bytes += len(body)
        return self._next

    def confirmed(self, token: int) -> bool:
        """The stream stored it: True where it was still waiting."""
        sent = self._sent.pop(token, None)
        if sent is None:
            return False  # a repeat confirmed the same message already
        self.bytes -= len(sent.body)
        return True

    def due(self, now: float) -> list[tuple[int, Sent]]:
        """Those with no ack for wait_s: to publish again now (each counted as sent at `now`)."""
        out: list[tuple[int, Sent]] = []
        for token, sent in self._sent.items():
            if now - sent.at < self.wait_s:
                break  # ordered by when each was last sent
            out.append((token, sent))
        for token, sent in out:
            sent.at = now
            self._sent.move_to_end(token)
        self.resent += len(out)
        return out


class Confirmer:
    """`Unconfirmed` on a connection: confirmed publishes, their acks (handled in the read
    loop, no task per ack) and the task that sends again what is due."""

    def __init__(self, nc: Client, wait_s: float = WAIT_S, max_bytes: int = MAX_BYTES) -> None:
        self._nc = nc
        self.unconfirmed = Unconfirmed(wait_s, max_bytes)
        self._prefix = f"_INBOX.{NUID().next().decode()}."
        self._room = asyncio.Event()
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await subscribe_direct(self._nc, self._prefix + "*", self._on_ack)
        self._task = asyncio.get_running_loop().create_task(self._resend())

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None) -> None:
        while self.unconfirmed.full:  # backpressure: the stream is not keeping up
            self._room.clear()
            await self._room.wait()
        token = self.unconfirmed.add(subject, body, headers, time.monotonic())
        await self._nc.publish(subject, body, reply=f"{self._prefix}{token}", headers=headers)

    def _on_ack(self, msg: Msg) -> None:
        if msg.headers and msg.headers.get(STATUS):
            return  # 503, no one to store it (a stream electing its leader): sent again when due
        if msg.data.startswith(b'{"error"'):
            error = json.loads(msg.data)["error"]
            if error.get("code") == 503:
                return
            log.error("the stream refused a message for good: %s", error.get("description", error))
        self.unconfirmed.confirmed(int(msg.subject.rsplit(".", 1)[1]))
        if not self.unconfirmed.full:
            self._room.set()

    async def _resend(self) -> None:
        while True:
            await asyncio.sleep(self.unconfirmed.wait_s / 4)
            due = self.unconfirmed.due(time.monotonic())
            if due:
                log.warning(
                    "%d message(s) not confirmed by the stream in %.1fs: sending them again", len(due), self.unconfirmed.wait_s
                )
            for token, sent in due:
                try:
                    with mapped(f"sending {sent.subject} again"):
                        await self._nc.publish(sent.subject, sent.body, reply=f"{self._prefix}{token}", headers=sent.headers)
                except BusError as e:  # closed, reconnecting: due again later
                    log.debug("%s", e)

    async def close(self, timeout: float) -> None:
        """Wait up to `timeout` for what is unconfirmed (sending it again meanwhile), then stop."""
        deadline = time.monotonic() + timeout
        while len(self.unconfirmed) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if len(self.unconfirmed):
            log.warning("closing with %d message(s) not confirmed by the stream", len(self.unconfirmed))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
