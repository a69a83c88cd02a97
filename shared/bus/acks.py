"""JetStream publishes awaited for their ack, and requests, every reply on one inbox subscription.

nats-py's `JetStreamContext.publish` makes each publish a request (a new token, a future in
its response map, `asyncio.wait_for`), and turns each ack into a `PubAck` dataclass: about
115 µs of the process's CPU per stored message on this project's machine, against 46 µs
here (bench figures in docs/performance.md, *Open storms*). Every call stores a dozen such
messages over its life (its request_id, its open, its records, the workers' barriers and
dones, its fin), and an open storm stores hundreds of them within a tenth of a second in
every process at once.

Requests (the conductor's assignments, two a call) go the same way: nats-py's `request`
costs alike. What a caller sees is what nats-py gives: the stream sequence or the reply, or
nats-py's own exceptions (no responders, a timeout, the server's API error), which
`failures.mapped` turns into BusErrors as before.
"""

from __future__ import annotations

import asyncio
import json
import re

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, InvalidKeyError, NoStreamResponseError

from shared.bus.internals import LazyInbox

ACK_TIMEOUT_S = 5.0  # nats-py's JetStream publish waits as long
NO_RESPONDERS = "503"
_VALID_KEY = re.compile(r"^[-/_=\.a-zA-Z0-9]+$")  # a KV key, as nats-py checks it


def check_key(key: str) -> None:
    """nats-py's check of a KV key before a write (InvalidKeyError)."""
    if not key or key[0] == "." or key[-1] == "." or not _VALID_KEY.match(key):
        raise InvalidKeyError(key)


class Acks:
    """One connection's stored publishes: the acks come back on one inbox subscription (made
    on first use), each to its publish's future, from the client's read loop."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._inbox = LazyInbox(nc, self._on_ack)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._next = 0
        self.stored_to: dict[str, int] = {}  # stream -> the highest sequence an ack said it stored

    def _on_ack(self, msg: Msg) -> None:
        fut = self._waiting.pop(msg.subject.rpartition(".")[2], None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def request(self, subject: str, body: bytes, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        """A request and its one reply, as nats-py's `request` gives it (NoRespondersError
        where nobody is subscribed, its TimeoutError where no reply comes in time)."""
        prefix = await self._inbox.prefix()
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = fut
        expiry = loop.call_later(timeout, _expire, fut)
        try:
            await self._nc.publish(subject, body, reply=f"{prefix}.{token}", headers=headers)
            msg = await fut
        finally:
            expiry.cancel()
            self._waiting.pop(token, None)
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise NoRespondersError
        return msg

    async def publish(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        msg_ttl: float | None = None,
    ) -> int:
        """Store `body` on `subject` and return its stream sequence once the stream has it."""
        if msg_ttl is not None:
            headers = {**(headers or {}), api.Header.MSG_TTL: str(int(msg_ttl))}
        try:
            msg = await self.request(subject, body, timeout or ACK_TIMEOUT_S, headers)
        except NoRespondersError:
            raise NoStreamResponseError from None  # as nats-py's JetStream publish says it
        ack = json.loads(msg.data)
        if "error" in ack:
            APIError.from_error(ack["error"])  # raises the error's own class, as nats-py's publish does
        seq = int(ack["seq"])
        self.saw(str(ack.get("stream", "")), seq)
        return seq

    def saw(self, stream: str, seq: int) -> None:
        """`stream` holds sequence `seq`: anything published from now on is stored after it."""
        self.stored_to[stream] = max(seq, self.stored_to.get(stream, 0))


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(NatsTimeout())
