"""`WS /v1/realtime?model=NAME`: the shell around the pure session (session.py).

One socket, one session, one live call opened through the frontend's own call machinery
(`FrontendService.open_call` / `append` / `end_input` / `abort`), so admission, limits and
timeouts are those of `/generate/ws`. Every server event is also stored in the stream
(`call.{cid}.rt`, `EventLog`): a client whose socket dropped comes back within
`realtime.resume_grace_s` with `session.resume` and gets every event it missed read back
from there, then the live ones. It may come back to any frontend: the token names the call,
the frontend holding the session answers for it on the bus (`subjects.realtime_take`) and
lets it go, and the one the client reached takes it up (`RealtimeHub.hand_over`, `_take`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.frontend import moves
from services.frontend.outbox import Outbox, Reply, to_json
from services.frontend.protocol import Append, EndInput, Opening, over_bytes, too_big_error
from services.frontend.realtime import events as ev
from services.frontend.realtime.session import (
    STATE_FORMAT,
    Close,
    EndCallInput,
    Out,
    RealtimeSession,
    SendAudio,
    SendText,
    SessionLimits,
    SessionState,
    event_number,
    resume_token,
    token_cid,
)
from services.frontend.relayed_call import RelayedCall
from services.frontend.service import FrontendService
from services.frontend.shares import Share, moved_in, open_shared
from services.frontend.socket_session import told
from services.frontend.websocket import SEND_NOW
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection, BusMsg, BusSubscription
from shared.runtime.errors import (
    BadRequest,
    BusError,
    BusNoResponders,
    DuplexError,
    LimitExceeded,
    Overloaded,
    ProtocolError,
    TooManyCalls,
)
from shared.runtime.process import TaskSet, cancel_and_wait
from shared.sdk.model import ClientFile, ClientInput, Model

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often waiting responses are checked against their deadline
RESUME_READ_S = 5.0  # how long a resume waits for the stream to hold every event it must send
LOG_DRAIN_S = 2.0  # how long a session that ends waits for its last events to be stored
CLOSE_FLUSH_S = 2.0  # how long a closing socket's queued events may take to go out (another ASGI server)
TAKE_S = 5.0  # how long a resume waits for the frontend holding the session to let it go
_decode_reply = msgspec.json.Decoder().decode


BETA_CODE = "beta_api_not_supported"
BETA_MESSAGE = (
    "The beta Realtime interface (OpenAI-Beta: realtime=v1) is not served: this endpoint speaks the GA"
    " Realtime API. Connect without the OpenAI-Beta header (the openai SDK's client.realtime.connect,"
    " not client.beta.realtime.connect)."
)


def asks_for_beta(header: str | None, subprotocols: list[str]) -> bool:
    """The `OpenAI-Beta: realtime=v1` header, or the subprotocol browsers send for it."""
    values = [v.strip().lower() for v in (header or "").split(",")]
    return "realtime=v1" in values or "openai-beta.realtime-v1" in subprotocols


def standalone_error(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An error for a socket that has no session (refused at connect)."""
    body = {"type": kind, "code": code, "message": message, "param": None, "event_id": None}
    return {"event_id": f"event_{secrets.token_hex(4)}_1", "type": "error", "error": body}


class EventLog:
    """The session's events in the stream, in order: published from one task (the sink that
    emits them cannot await), read back on resume. The only bus code of the endpoint."""

    def __init__(self, svc: FrontendService, cid: str) -> None:
        self.svc = svc
        self.subject = subjects.realtime(cid)
        self._queue: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, n: int, event_json: bytes) -> None:
        self._queue.append(wire.encode(wire.RealtimeEvent(n=n, json=event_json)))
        self._idle.clear()
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                body = self._queue.popleft()
                try:
                    await self.svc.bus.publish(self.subject, body)
                except BusError as e:  # lost to a resume only; a bug is raised, for the TaskSet to log
                    log.warning("storing a realtime event failed: %s", e)
            self._idle.set()

    async def drain(self) -> None:
        """Until every event put so far has been handed to the connection (the stream stores
        it a moment later: a resume reads until it has them all)."""
        await self._idle.wait()

    async def read(self, after: int) -> AsyncIterator[tuple[int, bytes, int]]:
        """(n, event JSON, stream seq) of what the stream holds after stream seq `after`."""
        async for _, body, seq in self.svc.bus.read_stored([self.subject], after=after):
            msg = wire.decode_as(body, wire.RealtimeEvent)
            yield msg.n, msg.json, seq


class EventSender:
    """One socket's sending side: the frontend's bounded `outbox.Outbox`, as `/generate/ws`
    has it. Sending never awaits. Under the frontend's own protocol each event is handed to
    the connection at once (`SEND_NOW`), which bounds what waits for the client and drops one
    that does not read (`websocket.py`). Under another ASGI server events wait for a writer
    task, up to twice `max_send_buffer_mb`: past that the client is not reading, and nothing
    is dropped silently: it is logged, `on_overflow` counts it, nothing more is sent and the
    socket is closed with 1008 "client not reading". Either way the socket is gone as after
    any drop and the session waits for a resume, which reads what the client missed from the
    stream (`gone` is set for the receive loop)."""

    def __init__(self, ws: WebSocket, max_bytes: int, on_overflow: Callable[[], None] | None = None) -> None:
        self.ws = ws
        self.on_overflow = on_overflow
        self.gone = asyncio.Event()
        send_now: Callable[[bytes], None] | None = ws.scope.get("extensions", {}).get(SEND_NOW)
        self.box = Outbox(send_now, pause_at=max_bytes, on_overflow=self._overflowed)
        self.writer = None if self.box.direct else asyncio.get_running_loop().create_task(self._write())

    def send(self, data: bytes) -> None:
        self.box.send(data)

    def _overflowed(self) -> None:
        waiting, bound = self.box.queued_bytes, 2 * self.box.pause_at
        log.warning("closing a /v1/realtime socket (1008), client not reading: %d bytes wait for it (bound %d)", waiting, bound)
        self.gone.set()
        if self.on_overflow is not None:
            self.on_overflow()

    async def _write(self) -> None:
        try:
            while (msg := await self.box.get()) is not None and not self.box.overflowed:
                await self.ws.send_text(to_json(msg).decode())
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client left: the receive loop sees it too
            self.gone.set()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """What waits goes out (for CLOSE_FLUSH_S at most; nothing more once overflowed),
        then the socket closes with `code` (1008 once overflowed)."""
        self.box.close()
        if self.writer is not None:
            try:
                if not self.box.overflowed:
                    await asyncio.wait({self.writer}, timeout=CLOSE_FLUSH_S)
                await cancel_and_wait(self.writer)  # a send stuck on a client that does not read is cut short
            finally:
                self.writer.cancel()  # cancelled with the caller: it must not outlive the socket
        if self.box.overflowed:
            code, reason = 1008, "client not reading"
        await self._close_socket(code, reason)

    async def _close_socket(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code, reason)
        # Gone already: closed, or the client left (Starlette turns the server's
        # ClientDisconnected into WebSocketDisconnect): nothing for uvicorn to log as an error.
        except (WebSocketDisconnect, RuntimeError, OSError) as e:
            log.debug("closing a realtime socket (%d %s): %r", code, reason, e)


class LiveSession:
    """One session's I/O: its call, its socket (none while detached) and its event log."""

    def __init__(self, hub: RealtimeHub, model_name: str, model: Model, core: RealtimeSession, rid: str) -> None:
        self.hub = hub
        self.svc = hub.svc
        self.model_name = model_name
        self.model = model
        self.core = core
        self.rid = rid
        self.call: RelayedCall | None = None
        self.log: EventLog | None = None
        self.outbox: EventSender | None = None
        self.tasks = TaskSet()  # its event log's writer and its ticks (a failure is logged as it ends)
        self.expiry: asyncio.TimerHandle | None = None
        self.closed = asyncio.Event()  # the session is over (socket to be closed)
        self.close_code = (1000, "")
        self.share: Share | None = None  # its call's share of the frontend (`shares.py`)
        self.started = time.monotonic()  # for realtime.max_session_s
        # A client event's outcome, the session's end and its move to another frontend: one at a time.
        self.busy = asyncio.Lock()
        self.moved = False  # it moved to another frontend: nothing of it is done here any more
        self.take_sub: BusSubscription | None = None  # where other frontends ask for it

    # -- the call ------------------------------------------------------------------------
    async def open(self, share: Share | None = None) -> None:
        """Open the session's call, within `share` (its token's, `shares.py`: given back when
        the call ends, whichever socket holds the session then)."""
        # Every message reaches `sink` (as JSON bytes), with no bound of the call's own: the
        # session's events go to its socket through the session's outbox.
        opening = Opening(self.rid, self.model_name, ClientInput())
        self.share = share
        call = await open_shared(share, self.svc.open_call, opening, Outbox(self.sink))
        self.call = call
        self.core.resume_token = resume_token(call.cid, self.core.resume_token)
        self.start(call)

    def start(self, call: RelayedCall) -> None:
        """The session's tasks, once it holds its call (opened, or taken over)."""
        self.log = EventLog(self.svc, call.cid)
        self.tasks.spawn(self.log.run())
        self.tasks.spawn(self._ticks())

    def sink(self, reply: Reply) -> None:
        """The call's messages (relayed outputs, its finish or error), from the service."""
        if self.moved:
            return
        msg = reply if isinstance(reply, dict) else _decode_reply(to_json(reply))
        now = time.monotonic()
        if "output" in msg:
            out = msg["output"]
            self.deliver(self.core.on_output(out, now) if isinstance(out, dict) else Out())
        elif "finish" in msg:
            self.deliver(self.core.call_ended(200, "completed"))
        elif "error" in msg and not msg.get("append"):
            self.deliver(self.core.call_ended(int(msg.get("status", 500)), str(msg["error"])))

    def deliver(self, out: Out) -> None:
        """Events to the log and the socket (if one is attached); a Close ends the session."""
        if self.moved:  # another frontend numbers its events now
            return
        for e in out.events:
            data = to_json(e)
            n = event_number(e["event_id"])
            if self.log is not None and n is not None:
                self.log.put(n, data)
            if self.outbox is not None:
                self.outbox.send(data)
        for a in out.actions:
            if isinstance(a, Close):
                self.close_code = (a.code, a.reason)
                self.closed.set()
        for turn in out.turns:
            for stage, ms in turn.figures_ms().items():
                if ms is not None:
                    self.svc.metrics.turn_seconds.labels(stage).observe(ms / 1000)

    async def act(self, out: Out) -> None:
        """A client event's outcome: its events, then its call actions, in order."""
        self.deliver(out)
        call = self.call
        for a in out.actions:
            if call is None or isinstance(a, Close):
                continue
            try:
                if isinstance(a, SendAudio):
                    data = a.pcm.astype("<i2", copy=False).tobytes()
                    await self.svc.append(call, Append(self.rid, ClientInput(files=[ClientFile("a.pcm", data)])))
                elif isinstance(a, SendText):
                    await self.svc.append(call, Append(self.rid, ClientInput(text=a.text)))
                elif isinstance(a, EndCallInput):
                    await self.svc.end_input(call, EndInput(self.rid, True))
            except LimitExceeded as e:
                eid = a.event_id if isinstance(a, SendAudio | SendText) else None
                self.deliver(self.core.error("limit_exceeded", e.message, e.limit, eid))
            except BusError as e:  # not the client's doing: no "invalid_value", nor the bus's own words
                eid = a.event_id if isinstance(a, SendAudio | SendText) else None
                self.deliver(self.core.error("server_error", told(e), None, eid))
            except DuplexError as e:
                eid = a.event_id if isinstance(a, SendAudio | SendText) else None
                self.deliver(self.core.error("invalid_value", told(e), None, eid))

    async def _ticks(self) -> None:
        limit = self.svc.config.realtime.max_session_s
        while self.core.state is not SessionState.CLOSED and not self.moved:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            call = self.call
            if call is not None and self.outbox is not None:
                # A session lives while its socket does (the server's pings find a dead client):
                # a client that waits is no idle call for request_timeout_s.
                call.input.touch(now)
            if call is not None and now - self.started >= limit and not call.ended.is_set():
                why = f"the session reached its maximum duration of {limit:g} s (realtime.max_session_s)"
                await self.svc.abort(call, why, 408, tell_client=True)
            self.deliver(self.core.tick(now))

    async def handle(self, data: str | bytes) -> None:
        limit = self.svc.config.max_message_bytes
        if over_bytes(data, limit):  # as on /generate/ws: refused unread, the session goes on
            e = too_big_error(data, limit)
            self.deliver(self.core.error("limit_exceeded", e.message, e.limit))
            return
        try:
            event = ev.parse_event(data)
        except ev.ClientError as e:
            self.deliver(self.core.refused(e))
            return
        async with self.busy:
            if self.moved:
                return  # its socket is being closed
            if self.call is not None:
                self.call.input.touch(time.monotonic())
            await self.act(self.core.handle(event, time.monotonic()))

    # -- sockets -------------------------------------------------------------------------
    def attach(self, outbox: EventSender) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        self.outbox = outbox

    def detach(self) -> None:
        """The socket dropped: keep the call for the grace period, then end it."""
        self.outbox = None
        grace = self.svc.config.realtime.resume_grace_s
        self.hub.detached[self.core.resume_token] = self
        self.expiry = asyncio.get_running_loop().call_later(grace, lambda: self.hub.spawn(self.end("resume grace period over")))

    async def end(self, reason: str) -> None:
        """The session is over without a goodbye: abort its call (frees its slot) and stop.
        Nothing where it moved to another frontend (its grace period ran out meanwhile)."""
        async with self.busy:
            if self.moved:
                return
            self.hub.detached.pop(self.core.resume_token, None)
            if self.expiry is not None:
                self.expiry.cancel()
            if self.call is not None and not self.call.ended.is_set():
                await self.svc.abort(self.call, reason, 499)
            await self.stop()

    def unlisten(self) -> None:
        """Other frontends ask for the session no more (it ended, or moved)."""
        sub, self.take_sub = self.take_sub, None
        if sub is not None:
            self.hub.spawn(BusConnection.unsubscribe_all([sub]))

    async def stop(self) -> None:
        self.unlisten()
        if self.log is not None:
            try:
                await asyncio.wait_for(self.log.drain(), LOG_DRAIN_S)
            except TimeoutError:  # a resume could not have read them all
                log.warning("realtime session %s: its last events were not all stored within %g s", self.rid, LOG_DRAIN_S)
        await self.tasks.close()

    async def replay(self, outbox: EventSender, last_seen: int) -> None:
        """Send what the client missed (events after `last_seen`) from the stream, then attach:
        the check that all were sent and the attach happen with no await in between."""
        assert self.log is not None
        after, sent = 0, last_seen
        deadline = time.monotonic() + RESUME_READ_S
        while True:
            await self.log.drain()
            async for n, data, seq in self.log.read(after):
                after = seq
                if n == sent + 1:
                    outbox.send(data)
                    sent = n
            if sent >= self.core.n:
                self.attach(outbox)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stream holds events up to {sent} of {self.core.n}")
            await asyncio.sleep(0.05)


class RealtimeHub:
    """The frontend's realtime sessions: connect, resume, and sessions waiting to be resumed."""

    def __init__(self, svc: FrontendService) -> None:
        self.svc = svc
        self.detached: dict[str, LiveSession] = {}
        self.attached: dict[str, LiveSession] = {}
        self.tasks = TaskSet()  # ends of sessions and closes of replaced sockets
        self.overflows = 0  # sockets closed because their client was not reading (`EventSender`)

    def _overflowed(self) -> None:
        self.overflows += 1

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.tasks.spawn(coro)

    async def close(self) -> None:
        for s in list(self.detached.values()):
            await s.end("the frontend is stopping")
        await self.tasks.close()

    def _session(self, name: str, model: Model) -> LiveSession:
        mapping = model.realtime_mapping()
        assert mapping is not None
        conn = model.client_edges()[model.default_stream() or ""]
        limits = conn.limits
        assert limits is not None and limits.sample_rate and limits.item_size
        cfg = self.svc.config
        caps = [cfg.max_call_input_bytes // 2]
        max_items = self.svc.stream_limits(name).get(conn.edge_name)
        if max_items is not None:
            caps.append(max_items * limits.item_size)
        sid = secrets.token_hex(6)
        core = RealtimeSession(
            sid,
            name,
            mapping,
            SessionLimits(
                limits.sample_rate, limits.item_size, min(caps), cfg.realtime.response_wait_s, model.text_stream() is not None
            ),
            secrets.token_urlsafe(24),
        )
        return LiveSession(self, name, model, core, f"rt-{sid}")

    async def serve(self, ws: WebSocket, subprotocol: str | None = None, share: Share | None = None) -> None:
        """One socket from accept to close (accepted with `subprotocol`: the one that carried
        its token); its session's call counts against `share`."""
        try:
            await ws.accept(subprotocol=subprotocol)
        except WebSocketDisconnect:  # the client left during the handshake: nothing to serve or log
            return
        outbox = EventSender(ws, self.svc.config.max_send_buffer_bytes, self._overflowed)
        if asks_for_beta(ws.headers.get("openai-beta"), ws.scope.get("subprotocols", [])):
            # Refused at once, as OpenAI now refuses its beta interface: a beta client would
            # read none of the GA events (the SDK's beta client got no audio at all).
            outbox.send(to_json(standalone_error(BETA_CODE, BETA_MESSAGE)))
            await outbox.close(1008, "beta interface not served")
            return
        name = ws.query_params.get("model") or self.svc.default_model
        try:
            model = self.svc.model(name)
            if model.realtime_mapping() is None or model.default_stream() is None:
                raise BadRequest(f"model {name!r} is not served over /v1/realtime")
        except BadRequest as e:
            outbox.send(to_json(standalone_error("model_not_found", e.message)))
            await outbox.close(1008, "model")
            return
        session: LiveSession | None = self._session(name, model)
        assert session is not None
        try:
            await session.open(share)
        except TooManyCalls as e:  # the token's share of this frontend is taken (max_calls_per_token)
            outbox.send(to_json(standalone_error("too_many_calls", e.message)))
            await outbox.close(1013, "try again later")
            return
        except Overloaded as e:  # the frontend is starting or stopping (the conductor's cap comes later, as a 503)
            outbox.send(to_json(standalone_error("server_busy", e.message, "server_error")))
            await outbox.close(1013, "try again later")
            return
        except DuplexError as e:
            outbox.send(to_json(standalone_error("server_error", told(e), "server_error")))
            await outbox.close(1011, "open failed")
            return
        session.attach(outbox)
        self.attached[session.core.resume_token] = session
        session.deliver(session.core.created())
        await self._listen(session)
        await self._run(ws, outbox, session)

    async def resume(self, outbox: EventSender, event: ev.ClientEvent, fresh: LiveSession | None) -> LiveSession | None:
        """`session.resume`: the session named by its token takes this socket, and the fresh
        session this socket had opened (if any) is ended. A session held by another frontend
        is taken over from it (`_take`). An unknown token: an error, and the fresh session
        goes on."""
        assert isinstance(event.action, ev.Resume)
        token, last = event.action.token, event.action.last_event_id
        old = self.detached.get(token) or self.attached.get(token)
        seen = event_number(last) if last else 0
        cid = token_cid(token)
        if old is None and seen is not None and cid is not None:
            return await self._take(outbox, event, fresh, cid, seen)
        if old is None or old is fresh or seen is None or seen > old.core.n:
            if old is None or old is fresh:
                return await self._refuse(outbox, fresh, self._unknown(event.event_id))
            return await self._refuse(outbox, fresh, self._bad_last(event.event_id))
        async with old.busy:  # not while it moves to another frontend (a resume there at once)
            if old.moved:
                return await self._refuse(outbox, fresh, self._unknown(event.event_id))
            if fresh is not None:
                self.attached.pop(fresh.core.resume_token, None)
                await fresh.end("replaced by a resumed session")
            if old.outbox is not None:  # its old socket has not noticed yet: this one takes over
                previous = old.outbox
                old.outbox = None
                self.spawn(previous.close(4000, "resumed on another socket"))
            self.detached.pop(token, None)
            self.attached[token] = old
            return await self._replay(old, outbox, seen)

    def _unknown(self, event_id: str | None) -> ev.ClientError:
        grace = self.svc.config.realtime.resume_grace_s
        why = (
            "no session to resume with this token: unknown, ended, or dropped more than"
            f" realtime.resume_grace_s ({grace:g} s) ago"
        )
        return ev.ClientError("invalid_resume_token", why, "resume_token", event_id)

    @staticmethod
    def _bad_last(event_id: str | None) -> ev.ClientError:
        return ev.ClientError("invalid_value", "unknown last_event_id", "last_event_id", event_id)

    @staticmethod
    def _refusal(err: ev.ClientError) -> wire.RealtimeMove:
        """A move refused: the error the asker gives its client."""
        return wire.RealtimeMove(ok=False, code=err.code, error=err.message, param=err.param or "")

    async def _refuse(self, outbox: EventSender, fresh: LiveSession | None, err: ev.ClientError) -> LiveSession | None:
        """A resume refused: the error to this socket's own session, which goes on (none: the
        error, and the socket closed)."""
        if fresh is None:
            outbox.send(to_json(standalone_error(err.code, err.message)))
            await outbox.close(1008, "resume")
            return None
        fresh.deliver(fresh.core.refused(err))
        return fresh

    async def _replay(self, session: LiveSession, outbox: EventSender, seen: int) -> LiveSession | None:
        """What the client missed, then the socket attached (`LiveSession.replay`)."""
        try:
            await session.replay(outbox, seen)
        except Exception:  # a bug too: this socket still gets its error and close, the session waits for another
            log.exception("resuming a realtime session failed")
            outbox.send(to_json(standalone_error("server_error", "resume failed", "server_error")))
            session.detach()
            await outbox.close(1011, "resume failed")
            return None
        return session

    # -- sessions that move between frontends ----------------------------------------------
    async def _listen(self, session: LiveSession) -> None:
        """The session answers other frontends' asks for it (its client resumed it there)."""
        assert session.call is not None

        async def asked(msg: BusMsg) -> None:
            await self._asked(session, msg)

        try:
            session.take_sub = await self.svc.bus.subscribe(subjects.realtime_take(session.call.cid), asked)
        except BusError as e:
            log.warning("realtime session %s can be resumed on this frontend only: %s", session.rid, e)

    async def _asked(self, session: LiveSession, msg: BusMsg) -> None:
        try:
            take = wire.decode_as(msg.data, wire.RealtimeTake)
        except ProtocolError as e:
            log.warning("an ask for realtime session %s that cannot be read: %s", session.rid, e)
            return
        sub = session.take_sub
        move = await self.hand_over(session, take)
        try:
            await self.svc.bus.answer(msg, wire.encode(move))
        except BusError as e:  # it was let go all the same: the asker gives up, and the call ends with no holder
            log.warning("realtime session %s: the answer to %s was not sent: %s", session.rid, take.frontend_id, e)
        if move.ok and sub is not None:
            # Last: unsubscribing stops the task this runs in.
            self.spawn(BusConnection.unsubscribe_all([sub]))

    async def hand_over(self, session: LiveSession, take: wire.RealtimeTake) -> wire.RealtimeMove:
        """Another frontend asks for the session (its client resumed it there): unless the
        token or last_event_id is wrong or the session is over, it is let go. What its
        resamplers held goes out first; then, with no await in between, it stops here (its
        old socket, if still open, is closed with 4000, and its grace period ends nothing)
        and its call is handed over as it stands (`moves.hand_over`); its last events are
        stored before the answer goes. The asker gets the session's state and its call's."""
        async with session.busy:
            refused = self._why_not(session, take)
            if refused is not None:
                return refused
            call = session.call
            assert call is not None
            await session.act(session.core.let_go())
            now = time.monotonic()
            try:
                state = session.core.snapshot(now)
            except TypeError as e:  # the model's mapping holds what cannot move: the session stays here
                log.warning("realtime session %s cannot move to another frontend: %s", session.rid, e)
                return wire.RealtimeMove(ok=False, code="server_error", error=f"the session cannot move to another frontend: {e}")
            if call.ended.is_set() or call.fin is not None:  # it ended while its resamplers' tails went out
                return self._refusal(self._unknown(None))
            session.moved = True
            self.detached.pop(session.core.resume_token, None)
            self.attached.pop(session.core.resume_token, None)
            if session.expiry is not None:
                session.expiry.cancel()
                session.expiry = None
            previous, session.outbox = session.outbox, None
            if previous is not None:
                self.spawn(previous.close(4000, "resumed on another socket"))
            move = moves.hand_over(call, self.svc.frontend_id, state, now - session.started)
            session.take_sub = None  # unsubscribed once the answer is sent (`_asked`)
            await self.svc.hand_over(call)
            await session.stop()  # its last events stored, its tasks stopped
            log.info("realtime session %s (call %s) moved to frontend %s", session.rid, call.cid, take.frontend_id)
            return move

    def _why_not(self, session: LiveSession, take: wire.RealtimeTake) -> wire.RealtimeMove | None:
        """Why the session is not let go to the asker (None: it is)."""
        call = session.call
        ended = session.closed.is_set() or session.core.state is not SessionState.ACTIVE
        if session.moved or call is None or ended or call.ended.is_set() or call.fin is not None:
            return self._refusal(self._unknown(None))
        if not secrets.compare_digest(take.token.encode(), session.core.resume_token.encode()):
            return self._refusal(self._unknown(None))
        if take.last_seen > session.core.n:
            return self._refusal(self._bad_last(None))
        if take.session_format != STATE_FORMAT:
            why = "the frontend holding the session runs another release: resume it there (or once both run one)"
            return wire.RealtimeMove(ok=False, code="server_error", error=why)
        return None

    async def _take(
        self, outbox: EventSender, event: ev.ClientEvent, fresh: LiveSession | None, cid: str, seen: int
    ) -> LiveSession | None:
        """A resume of a session this frontend does not hold: the frontend that holds it is
        asked for it on the bus (only it answers). Once it has let go, the fresh session this
        socket opened is ended, the session is taken up here, with its call (`_adopt`), and
        what the client missed is read from the stream, as for a resume here."""
        assert isinstance(event.action, ev.Resume)
        if not self.svc.ready.is_set():  # stopping: it could not hold the session once it was let go
            why = "this frontend is stopping; resume the session on another"
            return await self._refuse(outbox, fresh, ev.ClientError("server_busy", why, None, event.event_id))
        take = wire.RealtimeTake(
            token=event.action.token, last_seen=seen, frontend_id=self.svc.frontend_id, session_format=STATE_FORMAT
        )
        try:
            answer = await self.svc.bus.request(subjects.realtime_take(cid), wire.encode(take), TAKE_S)
            move = wire.decode_as(answer, wire.RealtimeMove)
        except BusNoResponders:  # no frontend holds it
            return await self._refuse(outbox, fresh, self._unknown(event.event_id))
        except (BusError, ProtocolError) as e:
            log.warning("resuming realtime session of call %s: asking for it failed: %s", cid, e)
            why = "the frontend holding the session did not answer in time; try again"
            return await self._refuse(outbox, fresh, ev.ClientError("server_error", why, None, event.event_id))
        if not move.ok:
            err = ev.ClientError(move.code or "invalid_resume_token", move.error, move.param or None, event.event_id)
            return await self._refuse(outbox, fresh, err)
        # Let go there: nobody but this frontend holds the session and its call now.
        share = fresh.share if fresh is not None else None
        if fresh is not None:
            self.attached.pop(fresh.core.resume_token, None)
            await fresh.end("replaced by a resumed session")
        try:
            session = await self._adopt(cid, move, share)
        except Exception as e:  # the call was aborted (`FrontendService.adopt`); a bug is logged too
            if not isinstance(e, DuplexError | ValueError):
                log.exception("taking up realtime session of call %s failed", cid)
            else:
                log.warning("taking up realtime session of call %s failed: %s", cid, e)
            outbox.send(to_json(standalone_error("server_error", "resume failed", "server_error")))
            await outbox.close(1011, "resume failed")
            return None
        self.attached[session.core.resume_token] = session
        return await self._replay(session, outbox, seen)

    async def _adopt(self, cid: str, move: wire.RealtimeMove, share: Share | None) -> LiveSession:
        """The session another frontend let go, held here: its state taken up, its call held
        (listed as adopted in a heartbeat stored before that frontend is told it may stop
        listing it), asked for here from now on."""
        model = self.svc.model(move.model)
        mapping = model.realtime_mapping()
        now = time.monotonic()
        try:
            if mapping is None:
                raise ValueError(f"model {move.model!r} is not served over /v1/realtime here")
            core = RealtimeSession.restored(move.session, mapping, now)
        except Exception as e:  # a state this frontend cannot take up: nobody holds the call, so it ends
            await self.svc.abort_unheld(cid, f"the session's state could not be taken up: {e!r}")
            raise
        session = LiveSession(self, move.model, model, core, move.request_id or f"rt-{core.sid}")
        session.share = share
        session.started = now - move.age_s
        call = await self.svc.adopt(cid, move, Outbox(session.sink))
        call.on_end = moved_in(share)
        session.call = call
        session.start(call)
        await self._listen(session)
        try:
            await self.svc.beat_now()
        except BusError as e:  # the other frontend lists the call for LEND_S, and a periodic beat comes first
            log.warning("realtime session %s: a heartbeat listing its call now failed: %s", session.rid, e)
        try:
            taken = wire.RealtimeTaken(frontend_id=self.svc.frontend_id)
            await self.svc.bus.publish(subjects.realtime_taken(cid), wire.encode(taken))
        except BusError as e:  # it lists the call for LEND_S
            log.warning("realtime session %s: telling frontend %s it holds the call failed: %s", session.rid, move.frontend_id, e)
        return session

    async def _run(self, ws: WebSocket, outbox: EventSender, session: LiveSession) -> None:
        first = True
        code = 1006
        loop = asyncio.get_running_loop()
        waiter = loop.create_task(session.closed.wait())
        gone = loop.create_task(outbox.gone.wait())  # the client is not reading (or left)
        receive: asyncio.Task[Any] | None = None
        try:
            while True:
                receive = loop.create_task(ws.receive())
                done, _ = await asyncio.wait({receive, waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if receive not in done:
                    break  # the session is over, or the socket gone (code 1006: resumable); the receive is stopped below
                done_receive, receive = receive, None
                try:
                    msg = done_receive.result()
                except (WebSocketDisconnect, RuntimeError):  # Starlette: the socket is gone already
                    break
                if msg["type"] == "websocket.disconnect":
                    code = int(msg.get("code") or 1006)
                    break
                data = msg.get("text")
                if data is None:
                    data = msg.get("bytes") or b""
                resume = first and not over_bytes(data, self.svc.config.max_message_bytes)
                first = False
                if resume:  # a resume is the first event; anything else goes to the session
                    with contextlib.suppress(ev.ClientError):
                        event = ev.parse_event(data)
                        if isinstance(event.action, ev.Resume):
                            resumed = await self.resume(outbox, event, session)
                            if resumed is None:
                                return
                            if resumed is not session:
                                session = resumed
                                waiter.cancel()
                                waiter = loop.create_task(session.closed.wait())
                            continue
                if session.outbox is not outbox:
                    return  # another socket resumed this session
                # Not under the receive's catch: a failure of our own is not a client leaving.
                await session.handle(data)
        finally:
            pending = [t for t in (receive, waiter, gone) if t is not None]
            for t in pending:
                t.cancel()
            try:
                await self._left(session, outbox, code)
            finally:
                # Last: where the handler itself is being cancelled, `stop` raises it on.
                await cancel_and_wait(*pending)

    async def _left(self, session: LiveSession, outbox: EventSender, code: int) -> None:
        if session.moved or (session.outbox is not outbox and session.outbox is not None):
            return  # taken over by a resumed socket (here, or on another frontend: this one was closed then)
        if session.closed.is_set() or session.core.state is SessionState.CLOSED:
            self.attached.pop(session.core.resume_token, None)
            await session.stop()
            await outbox.close(*session.close_code)
            return
        self.attached.pop(session.core.resume_token, None)
        if code in (1000, 1001) or self.svc.config.realtime.resume_grace_s <= 0:
            await session.end("socket closed")
        else:
            session.detach()
        await outbox.close(1001, "session detached")  # its writer, and a socket not gone yet (1008 if overflowed)
