"""Reads of the stream without a consumer: JetStream's batched direct get.

A consumer read (`BusConnection.read_stored` without a bound) creates an ephemeral consumer,
fetches from it and deletes it: three requests, and the server builds and drops the
consumer's state. A worker reads so at every placement, once per call and partition, so an
open storm (hundreds of calls opened within a tenth of a second) made the server build
hundreds of consumers at once (bench/open_storm.py; docs/performance.md, *Open storms*).
A batched direct get (`$JS.API.DIRECT.GET.<stream>` with `next_by_subj` and `batch`,
nats-server 2.11 and later) answers one request per filter and page with the messages
themselves, then an end-of-batch status; the server keeps nothing.

A filter that names its subject costs the server 30 to 60 µs a page; one with a wildcard about
1 ms (bench/admission_cost.py --ops): readers name their subjects.

It is used only where it reads exactly what a consumer would:

- on a stream with one replica: the one server that stores it answers. A replicated stream's
  followers answer direct gets too, and one may be behind its leader;
- up to a stream sequence already stored (`upto`, a barrier the reader stored itself): every
  filter's pages are then complete up to it, so the filters' messages merge into stream order,
  and nothing stored after it, which could land between two filters' pages, is read.
"""

from __future__ import annotations

import asyncio
import heapq
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.bus import subjects
from shared.bus.internals import LazyInbox
from shared.runtime.errors import BusRefused, BusTimeout, BusUnavailable

PAGE_TIMEOUT_S = 5.0  # JetStream's own request wait
MIN_SERVER = (2, 11)  # batched direct gets


@dataclass
class _Page:
    subject_filter: str
    token: str
    done: asyncio.Future[tuple[str, int]]
    msgs: list[Msg] = field(default_factory=list)
    expiry: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class Stored:
    """One message of a direct read, as the stream holds it."""

    subject: str
    headers: dict[str, str]
    data: bytes
    seq: int


def supported(nc: Client) -> bool:
    """Whether the server nc is connected to answers batched direct gets."""
    try:
        v = nc.connected_server_version
        return (v.major, v.minor) >= MIN_SERVER
    except Exception:  # no version known (not connected, an odd INFO): the consumer read is safe
        return False


class DirectReads:
    """Batched direct gets of one stream over one connection: every page's answer comes to one
    inbox subscription (made on first use), routed to its page by the reply subject's last token."""

    def __init__(self, nc: Client, stream: str) -> None:
        self._nc = nc
        self._api = subjects.js_api_direct_get(stream)
        self._inbox = LazyInbox(nc, self._on_msg)
        self._pages: dict[str, _Page] = {}
        self._next = 0

    def _on_msg(self, msg: Msg) -> None:
        page = self._pages.get(msg.subject.rpartition(".")[2])
        if page is None or page.done.done():
            return  # a page that timed out, or its answer after the end
        status = (msg.headers or {}).get("Status")
        if status is None:
            page.msgs.append(msg)
            return
        pending = (msg.headers or {}).get("Nats-Num-Pending", "0")
        page.done.set_result((status, int(pending) if pending.isdigit() else 0))

    async def _ask(self, subject_filter: str, start: int, batch: int) -> _Page:
        """Ask for a page (its answer is awaited with `_answer`: a read asks for the first
        pages of all its filters before it awaits any)."""
        prefix = await self._inbox.prefix()
        self._next += 1
        loop = asyncio.get_running_loop()
        page = _Page(subject_filter, str(self._next), loop.create_future())
        self._pages[page.token] = page
        page.expiry = loop.call_later(PAGE_TIMEOUT_S, _expire, page.done)
        body = json.dumps({"seq": start, "next_by_subj": subject_filter, "batch": batch}).encode()
        try:
            await self._nc.publish(self._api, body, reply=f"{prefix}.{page.token}")
        except BaseException:
            self._forget(page)
            raise
        return page

    def _forget(self, page: _Page) -> None:
        self._pages.pop(page.token, None)
        if page.expiry is not None:
            page.expiry.cancel()
        # A page left behind by a read that failed on another (they expire together) may hold
        # its own timeout: taken here, or asyncio logs it as never retrieved when it goes.
        if page.done.done() and not page.done.cancelled():
            page.done.exception()
        else:
            page.done.cancel()

    async def _answer(self, page: _Page) -> tuple[list[Msg], bool]:
        """The page's messages, and whether more follow them."""
        doing = f"reading {page.subject_filter} directly"
        try:
            status, pending = await page.done
        except TimeoutError:
            raise BusTimeout(doing, f"no answer within {PAGE_TIMEOUT_S:g} s") from None
        finally:
            self._forget(page)
        if status == "404":  # nothing on the filter from `start` on
            return [], False
        if status == "503":
            raise BusUnavailable(doing, "no responders (the stream is not there, or takes no direct gets)")
        if status != "204":
            raise BusRefused(doing, f"status {status}")
        return page.msgs, pending > 0

    async def page(self, subject_filter: str, start: int, batch: int) -> tuple[list[Msg], bool]:
        """Up to `batch` messages on `subject_filter` from stream sequence `start` on, and
        whether more follow them."""
        return await self._answer(await self._ask(subject_filter, start, batch))

    async def read(self, filters: list[str], after: int, upto: int, batch: int) -> AsyncGenerator[Stored, None]:
        """Every message on `filters` stored after sequence `after` and up to `upto`, in stream
        order. Each filter is read a page at a time, the first pages of all at once; a filter's
        next page is asked for once the merge has used up its last."""
        asked = [await self._ask(f, after + 1, batch) for f in filters]
        try:
            first = [await self._answer(p) for p in asked]
        finally:
            for p in asked:
                self._forget(p)
        queues: list[list[Stored]] = []  # each filter's messages not yet merged, the next one last
        more: list[bool] = []  # whether a filter has a page to come
        heads: list[tuple[int, int]] = []  # (seq, filter) of each filter's next message
        for i, (msgs, has_more) in enumerate(first):
            queue, last = _upto(msgs, upto)
            queues.append(queue)
            more.append(has_more and 0 < last < upto)
            if queue:
                heads.append((queue[-1].seq, i))
        heapq.heapify(heads)
        while heads:
            _, i = heapq.heappop(heads)
            msg = queues[i].pop()
            yield msg
            if not queues[i] and more[i]:
                msgs, has_more = await self.page(filters[i], msg.seq + 1, batch)
                queues[i], last = _upto(msgs, upto)
                more[i] = has_more and 0 < last < upto
            if queues[i]:
                heapq.heappush(heads, (queues[i][-1].seq, i))


def _upto(msgs: list[Msg], upto: int) -> tuple[list[Stored], int]:
    """A page's messages up to `upto`, the next one last, and the page's last sequence (0: none)."""
    stored = [_stored(m) for m in msgs]
    return [s for s in reversed(stored) if s.seq <= upto], stored[-1].seq if stored else 0


def _expire(done: asyncio.Future[tuple[str, int]]) -> None:
    if not done.done():
        done.set_exception(TimeoutError())


def _stored(msg: Msg) -> Stored:
    h = msg.headers or {}
    return Stored(h.get("Nats-Subject", ""), h, msg.data, int(h.get("Nats-Sequence", "0")))
