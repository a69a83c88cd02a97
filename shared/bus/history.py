"""Reading what the stream holds, fast, with the stream's own timestamps (`duplexbus replay`).

`BusConnection.read_stored` pulls in batches, and nats-py turns each pulled message into a
task switch and a coroutine: about 30 µs a message, 0.7 s for a 10-minute `echo` call on
its own. Here one ephemeral push consumer with flow control delivers the messages, and a
plain function takes each one from the client's read loop (`internals.subscribe_direct`)
into a queue the reader drains: about 8 µs a message. With `follow`, the read does not stop
at the end of what is stored: it goes on with what the stream stores next (a live call).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.bus import subjects
from shared.bus.failures import Denials, mapped
from shared.bus.internals import subscribe_direct
from shared.bus.payloads import Payloads
from shared.runtime.errors import BusError, BusTimeout

log = logging.getLogger(__name__)

HIGH_WATER = 20_000  # messages queued for the reader before flow control holds the server back
STALLED_S = 10.0  # a read that expects more and hears nothing this long has lost its consumer


@dataclass(frozen=True, slots=True)
class Stored:
    subject: str
    body: bytes
    seq: int  # the stream's sequence number
    ts_ns: int  # when the stream stored it (ns since the epoch)


def _ack_fields(reply: str) -> tuple[int, int, int]:
    """(stream seq, timestamp ns, pending) from a JetStream delivery's reply subject:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`, or the form with
    a domain and an account hash (12 tokens)."""
    t = reply.split(".")
    if len(t) >= 12:
        return int(t[7]), int(t[9]), int(t[10])
    return int(t[5]), int(t[7]), int(t[8])


class _Pushed:
    """The queue between the read loop's handler and the reader, with flow control held back
    while the reader is behind (that is the backpressure: the server waits for the reply)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.queue: deque[Msg] = deque()
        self.ready = asyncio.Event()
        self.held: list[str] = []
        self._sends: set[asyncio.Task[Any]] = set()

    def handle(self, m: Msg) -> None:
        if m.headers and m.headers.get("Status") == "100":  # flow control or an idle heartbeat
            reply = m.reply or m.headers.get("Nats-Consumer-Stalled")
            if reply:
                self._answer(reply) if len(self.queue) < HIGH_WATER else self.held.append(reply)
            return
        if m.reply:
            self.queue.append(m)
            self.ready.set()

    def _answer(self, subject: str) -> None:
        task = asyncio.get_running_loop().create_task(self.nc.publish(subject, b""))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def taken(self) -> None:
        if self.held and len(self.queue) < HIGH_WATER // 2:
            for subject in self.held:
                self._answer(subject)
            self.held.clear()


async def read_history(
    nc: Client,
    js: JetStreamContext,
    payloads: Payloads,
    denials: Denials,
    filters: list[str],
    follow: bool = False,
    since: float | None = None,
) -> AsyncGenerator[Stored, None]:
    """Every message the stream holds on `filters`, oldest first (from `since`, a Unix time,
    where given); with `follow`, then every one it stores next, until the caller stops."""
    doing = f"reading {', '.join(filters)}"
    pushed = _Pushed(nc)
    inbox = nc.new_inbox()
    with mapped(doing, denials):
        sub = await subscribe_direct(nc, inbox, pushed.handle)
    cfg = ConsumerConfig(
        filter_subjects=filters,
        deliver_subject=inbox,
        deliver_policy=DeliverPolicy.BY_START_TIME if since else DeliverPolicy.ALL,
        opt_start_time=datetime.datetime.fromtimestamp(since, datetime.UTC) if since else None,
        ack_policy=AckPolicy.NONE,
        flow_control=True,
        idle_heartbeat=2.0,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    info = None
    try:
        with mapped(doing, denials):
            info = await js.add_consumer(subjects.STREAM, cfg)
        expected = info.num_pending or 0
        if not follow and not expected:
            return
        # A read that does not follow ends once it has what was stored when it began: a count,
        # not the pending figure of a delivery, which on a cluster just after a new stream
        # leader was elected can say 0 with messages still to come (a replay cut short).
        delivered = 0
        heard = time.monotonic()
        while True:
            if not pushed.queue:
                pushed.ready.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pushed.ready.wait(), 1.0)
                if not pushed.queue:
                    if not follow and time.monotonic() - heard > STALLED_S:
                        raise BusTimeout(doing, f"the stream sent nothing for {STALLED_S:.0f}s with messages left")
                    continue
            heard = time.monotonic()
            m = pushed.queue.popleft()
            pushed.taken()
            seq, ts, _ = _ack_fields(m.reply)
            body = await payloads.body(m.headers, m.data) if payloads.is_stored(m.headers) else m.data
            yield Stored(m.subject, body, seq, ts)
            delivered += 1
            if not follow and delivered >= expected:
                return
    finally:
        with contextlib.suppress(BusError), mapped(doing):  # closed already: nothing to undo
            await sub.unsubscribe()
        if info is not None:
            try:
                with mapped(doing, denials):
                    await js.delete_consumer(subjects.STREAM, info.name)
            except BusError as e:  # ephemeral: the server removes it after inactive_threshold
                log.debug("deleting a history read's consumer: %s", e)
