"""One client socket's calls: its messages in, in order per call, and what ends with it."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from services.frontend.calls import InputState
from services.frontend.outbox import Outbox, pack
from services.frontend.protocol import (
    AbortCall,
    Append,
    ClientMessage,
    EndInput,
    Opening,
    ParseError,
    parse_frame,
    valid_request_id,
)
from services.frontend.relayed_call import RelayedCall, Sink
from services.frontend.shares import Share, open_shared
from shared.runtime.config import ServingConfig
from shared.runtime.errors import Aborted, BusError, Conflict, DuplexError, UnknownCall

log = logging.getLogger(__name__)

LANE_MAX = 256  # messages of one call waiting behind its opening or end: past it the socket waits
LANES_MAX = 64  # calls of one socket with an opening, end or abort under way: past it the socket waits
CLOSE_WAIT_S = 10.0  # on close, how long an opening under way may take before the socket's calls are aborted
NO_CALL = "no live call with this request_id on this socket (never opened here, or ended)"
INTERNAL = DuplexError("internal error")  # status 500: a bug, not the client's doing
BUS_TROUBLE = "the service's message bus did not take the request; try again"  # a BusError, as a client is told it


def told(err: DuplexError) -> str:
    """What a client is told of `err`: its message, which is written for the client, but for
    a bus failure's. That one names subjects, streams, servers and the server's own words,
    none of them the client's business: the client gets `BUS_TROUBLE` (and the status), the
    log the rest. An error made for the client from another exception (a model's decoding
    failure) names none of its cause: that goes to the log too."""
    if not isinstance(err, BusError):
        if err.__cause__ is not None:
            log.info("a client is told %d (%s), caused by: %r", err.status, err.message, err.__cause__)
        return err.message
    log.warning("a client is told %d (%s) for: %s", err.status, BUS_TROUBLE, err)
    return BUS_TROUBLE


def error_body(rid: str | None, err: DuplexError, append: bool = False) -> dict[str, Any]:
    """The client's error message: the call's, or (append=True) a refused append's."""
    body: dict[str, Any] = {"request_id": rid, "error": told(err), "status": err.status}
    if append:
        body["append"] = True
    return body


class Calls(Protocol):
    """What a session asks of the service (`service.FrontendService`)."""

    config: ServingConfig

    async def open_call(self, o: Opening, sink: Sink, on_end: Callable[[RelayedCall], None] | None = None) -> RelayedCall: ...
    async def append(self, call: RelayedCall, a: Append) -> None: ...
    async def end_input(self, call: RelayedCall, e: EndInput) -> None: ...
    async def abort(self, call: RelayedCall, reason: str, status: int, tell_client: bool = False) -> None: ...


class SocketSession:
    """One WebSocket's calls, and the order its messages are handled in.

    The session holds its calls (each told to the session when it ends, `_forget`); the
    service knows only the calls, not who opened them. Messages go out through the
    socket's `Outbox`. Its calls count against its `share` (`shares.py`: the socket's and
    its token's caps; None: no cap).
    """

    def __init__(self, outbox: Outbox, service: Calls, share: Share | None = None) -> None:
        self.outbox = outbox
        self.service = service
        self.share = share
        self.calls: dict[str, RelayedCall] = {}  # the live ones with a request_id, by it
        self.unnamed: set[RelayedCall] = set()  # one-shots without a request_id
        # Messages of a call whose opening, end of input or abort is under way, by request_id:
        # they wait for it, while other calls' messages on this socket go on.
        self.lanes: dict[str | None, deque[ClientMessage | ParseError]] = {}
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._lane_moved = asyncio.Event()
        self.closed = False
        self._max_bytes = service.config.max_message_bytes  # a property computed anew each time: read once

    def send(self, msg: dict[str, Any], binary: bool = False) -> None:
        """A reply of the socket's own (not a call's), in JSON or (`binary`) msgpack; one
        under the request_id of a live call of this socket goes in that call's encoding, as
        all its messages do."""
        call = self.live(msg.get("request_id"))
        if call is not None:
            binary = call.binary
        self.outbox.send(pack(msg) if binary else msg)

    def live(self, rid: str | None) -> RelayedCall | None:
        return self.calls.get(rid) if rid is not None else None

    @property
    def has_calls(self) -> bool:
        """A call of this socket is live, or a message about one is under way."""
        return bool(self.calls or self.unnamed or self.lanes)

    def _forget(self, call: RelayedCall) -> None:
        """The call ended: its request_id is free on this socket (and the socket holds no
        trace of it, however many calls it runs over its life)."""
        if call.request_id is None:
            self.unnamed.discard(call)
        elif self.calls.get(call.request_id) is call:
            del self.calls[call.request_id]

    def append_error(self, rid: str | None, err: DuplexError, binary: bool = False) -> None:
        """The reply to an append, end_input or abort that was refused; no call ends by it."""
        self.send(error_body(rid, err, append=True), binary)

    async def handle(self, data: str | bytes) -> None:
        """One client message. A plain append is handled at once; an opening, an end of input
        or an abort waits on round trips to the bus, so it runs in a lane of its call's own,
        and that call's later messages queue behind it, in order: one call's slow opening
        does not hold up the appends of the others on the socket."""
        msg = parse_frame(data, max_bytes=self._max_bytes)
        rid = msg.request_id
        # Backpressure: past either bound the socket reads no more until a lane moves on.
        while ((lane := self.lanes.get(rid)) is not None and len(lane) >= LANE_MAX) or (
            lane is None and not _plain_append(msg) and len(self.lanes) >= LANES_MAX
        ):
            self._lane_moved.clear()
            await self._lane_moved.wait()
        if lane is not None:
            lane.append(msg)
        elif _plain_append(msg):
            await self._handle(msg)
        else:
            self.lanes[rid] = deque()
            task = asyncio.get_running_loop().create_task(self._run_lane(rid, msg))
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)

    async def _run_lane(self, rid: str | None, first: ClientMessage | ParseError) -> None:
        lane = self.lanes[rid]
        try:
            await self._handle(first)
            while lane:
                msg = lane.popleft()
                self._lane_moved.set()
                await self._handle(msg)
        finally:
            del self.lanes[rid]
            self._lane_moved.set()

    async def _handle(self, msg: ClientMessage | ParseError) -> None:
        try:
            if isinstance(msg, ParseError):
                await self._refused(msg)
            elif isinstance(msg, Opening):
                await self._open(msg)
            elif isinstance(msg, Append | EndInput):
                await self._append(msg)
            else:
                await self._abort(msg)
        except DuplexError as e:
            self.send(error_body(msg.request_id, e), msg.binary)
        except Exception:  # I-4: a bug here ends at most the call it concerns, never the socket
            log.exception("handling a %s failed", type(msg).__name__)
            call = None if isinstance(msg, Opening) else self.live(msg.request_id)
            if call is not None:
                await self.service.abort(call, INTERNAL.message, INTERNAL.status, tell_client=True)
            else:
                self.send(error_body(msg.request_id, INTERNAL), msg.binary)

    async def _refused(self, p: ParseError) -> None:
        call = self.live(p.request_id) if valid_request_id(p.request_id) else None
        if p.append:
            if call is not None:  # a malformed append is a rejected append: it ends the call
                await self._reject_append(call, p.error)
            else:
                self.append_error(p.request_id, p.error, p.binary)
            return
        if p.kind == "opening" and call is not None:
            # An opening under a live request_id is a 409 whatever else is wrong with it: an
            # error reply of any other status under a live request_id means that call ended.
            err = Conflict(f"request_id {p.request_id!r} is already in use by a live call ({p.error.message})")
            self.send(error_body(p.request_id, err))
            return
        self.send(error_body(p.request_id, p.error), p.binary)

    async def _open(self, o: Opening) -> None:
        if self.live(o.request_id) is not None:
            raise Conflict(f"request_id {o.request_id!r} is already in use by a live call")
        call = await open_shared(self.share, self.service.open_call, o, self.outbox, on_end=self._forget)
        if self.closed:  # the socket closed while the call was opening
            await self.service.abort(call, "socket closed", 499)
            return
        if call.ended.is_set():  # ended while it opened (_forget has run already)
            return
        if o.request_id is None:
            self.unnamed.add(call)
        else:
            self.calls[o.request_id] = call

    async def _append(self, a: Append | EndInput) -> None:
        call = self.live(a.request_id)
        if call is None:
            self.append_error(a.request_id, UnknownCall(NO_CALL), a.binary)
            return
        if call.input.state is not InputState.OPEN:
            self.append_error(a.request_id, Conflict("the call's input has ended (end_input); the call goes on"))
            return
        try:
            if isinstance(a, Append):
                await self.service.append(call, a)
            else:
                await self.service.end_input(call, a)
        except DuplexError as e:
            await self._reject_append(call, e)

    async def _abort(self, a: AbortCall) -> None:
        call = self.live(a.request_id)
        if call is None:
            self.append_error(a.request_id, UnknownCall(NO_CALL), a.binary)
        else:
            err = Aborted("aborted by the client")
            await self.service.abort(call, err.message, err.status, tell_client=True)

    async def _reject_append(self, call: RelayedCall, e: DuplexError) -> None:
        """A rejected append ends the call with its error and no finish."""
        await self.service.abort(call, told(e), e.status, tell_client=True)

    async def close(self) -> None:
        """The socket closed: abort its calls, which frees their admission slots.

        What its lanes still held is dropped; an opening under way is let finish (for up to
        CLOSE_WAIT_S), and a call it opens after this is aborted at once (`_open`).
        One-shots first (they may be queued): were a live call's slot freed first, the
        conductor could admit this socket's own queued one-shot into it, ahead of others.
        """
        self.closed = True
        for lane in self.lanes.values():
            lane.clear()
        if self._lane_tasks:
            await asyncio.wait(list(self._lane_tasks), timeout=CLOSE_WAIT_S)
        mine = [*self.unnamed, *self.calls.values()]
        for call in sorted(mine, key=lambda c: c.live):
            await self.service.abort(call, "socket closed", 499)


def _plain_append(msg: ClientMessage | ParseError) -> bool:
    """An append that ends no stream: it is framed and published without a round trip."""
    return isinstance(msg, Append) and msg.end_input is None
