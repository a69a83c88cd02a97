"""The frontend's WebSocket connection: uvicorn's sans-I/O protocol, tuned for many small
messages and bounded against hostile clients.

A socket here carries many live calls, each sending and receiving a message every few tens
of milliseconds. uvicorn's protocol makes two system calls per message received (it
pauses reading after every message until the app takes it, then resumes) and one write
per message sent. At a few thousand messages a second those system calls, and the
context switches they cause on a loaded machine, cost more than the messages themselves.
This protocol changes these things and nothing else:

- Reading pauses only when `MAX_INBOUND` messages (or `INBOUND_BYTES`) wait for the app.
- Outgoing messages are written together: one transport write per event-loop turn. The
  app sends without awaiting (the `OUTLET` scope extension), so a call's output goes from
  the bus to the socket buffer in one callback, with no queue and task.
- Sending never waits on a slow client. Past `max_send_buffer` bytes waiting for it,
  `has_room()` is False and the app stops relaying outputs to it (they wait in the stream,
  see `outputs.py`) until what waits has drained to half (`on_room`). Past twice that
  (replies the client's own messages caused), or with nothing read for `send_timeout_s`,
  the client is not reading: it is dropped and the app aborts its calls.
- Every connection is accounted to the frontend's `limits.Guard` (input held: partial and
  queued messages; output waiting) and ends itself when the guard says so, with a close
  code naming the limit: an unfinished message (1008), the memory budget (1013), an idle
  socket (1000).
- On shutdown the socket stays open while the app drains its calls (`DRAIN`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.frames import Frame
from websockets.protocol import State

from services.frontend.limits import Guard, Load, Shed

log = logging.getLogger(__name__)

MAX_INBOUND = 256  # client messages read ahead of the app before reading pauses
INBOUND_BYTES = 4 * 1024 * 1024  # or this many bytes of them (at most one message more)
FRAGMENT_COST = 64  # bytes a fragment costs beyond its payload (its object): tiny fragments add up
CLOSE_LINGER_S = 2.0  # after a close we send, how long what the client still sends is read and dropped
LINGER_MAX_BYTES = 1024 * 1024  # or how much of it: past this the connection is dropped
SEND_NOW = "duplexbus.send_now"  # ASGI scope extension: send a text message (UTF-8 bytes), or a binary one, without awaiting
OUTLET = "duplexbus.outlet"  # ASGI scope extension: the connection itself (send_now, has_room, on_room, busy)
DRAIN = "duplexbus.drain"  # lifespan state: starts (once) the app's drain, returns its task
GUARD = "duplexbus.guard"  # lifespan state: the frontend's limits.Guard, for every connection


OP_TEXT = 0x1
OP_BINARY = 0x2


def frame_header(opcode: int, n: int) -> bytes:
    """The header of a server's unfragmented, unmasked frame of `n` payload bytes (RFC 6455 5.2)."""
    if n < 126:
        return bytes((0x80 | opcode, n))
    if n < 1 << 16:
        return bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big")
    return bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big")


class FrontendWebSocketProtocol(WebSocketsSansIOProtocol):
    max_send_buffer = 16 * 1024 * 1024  # bytes waiting for one client before its outputs wait in the stream

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard: Guard | None = self.app_state.get(GUARD)
        if self.guard is not None:
            self.max_send_buffer = self.guard.limits.send_buffer_bytes
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._written = 0  # bytes handed to the transport, ever
        self._flush_scheduled = False
        self._frames_bytes = 0  # the message being received, so far
        self._queued_bytes = 0  # messages waiting for the app
        self._message_since: float | None = None
        self._seen_delivered = 0
        self._progress_at = time.monotonic()
        self._unread_at = 0.0  # (loop time) the last moment reading was paused: what the client sent waited here
        self._active_at = time.monotonic()  # the last message, or the last time the app had calls
        self.on_room: Callable[[], None] | None = None  # the app: what waits drained to half
        self.busy: Callable[[], bool] | None = None  # the app: the socket has calls (it is not idle)

    @classmethod
    def with_send_buffer(cls, max_bytes: int) -> type[FrontendWebSocketProtocol]:
        """This protocol with its own bound (uvicorn takes a class, not an instance)."""
        return type(cls.__name__, (cls,), {"max_send_buffer": max_bytes})

    # -- the connection --------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # Told (resume_writing) when what waits for the client has drained to half the bound.
        with contextlib.suppress(NotImplementedError):  # a transport that has no such limits
            transport.set_write_buffer_limits(high=self.max_send_buffer, low=self.max_send_buffer // 2)
        if self.guard is not None:
            self.guard.adopt(self)  # admitted as an HTTP connection (`http.FrontendHttpProtocol`)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.frames = []
        self._frames_bytes = 0
        if self.guard is not None:
            self.guard.release(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.on_room is not None:
            self.on_room()

    def keepalive_timeout(self) -> None:
        """A pong can only come once the client has read what was sent before the ping: while
        output waits for it, whether the client reads at all is `send_timeout_s`'s to judge.
        Nor can it come before this side has read what the client sent before the pong: while
        reading is paused (the app, or the bus behind it, takes a fast upload at its own pace)
        and for a ping_timeout after, the client is not taken for dead. A client that is gone
        sends nothing more, so reading resumes and stays so, and the next timeout ends it."""
        waited = self.read_paused or self.loop.time() - self._unread_at < (self.ping_timeout or 20.0)
        if (self.backlog() > 0 or waited) and not self.close_sent and not self.transport.is_closing():
            self.pong_timer = self.loop.call_later(self.ping_timeout or 20.0, self.keepalive_timeout)
            return
        super().keepalive_timeout()

    # -- receiving -------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.close_sent and len(self.conn.reader.buffer) > LINGER_MAX_BYTES and not self.transport.is_closing():
            self.transport.abort()  # closing, and the client sends a large frame all the same
            return
        if self.guard is None or self.disconnected:
            return
        now = time.monotonic()
        partial = self._frames_bytes > 0 or len(self.conn.reader.buffer) > 0
        if not partial:
            self._message_since = None
        elif self._message_since is None:
            self._message_since = now
        self._report(now)

    def handle_text(self, event: Frame) -> None:
        if self.close_sent:
            return  # closing: nothing more is kept
        self._frames_bytes = len(event.data) + FRAGMENT_COST
        super().handle_text(event)

    def handle_bytes(self, event: Frame) -> None:
        if self.close_sent:
            return
        self._frames_bytes = len(event.data) + FRAGMENT_COST
        super().handle_bytes(event)

    def handle_cont(self, event: Frame) -> None:
        if self.close_sent:
            return
        self._frames_bytes += len(event.data) + FRAGMENT_COST
        super().handle_cont(event)

    def send_receive_event_to_app(self) -> None:
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        self._frames_bytes = 0
        self._active_at = time.monotonic()
        if self.close_sent:
            return  # the app is past websocket.close: discard, as uvicorn does
        if self.curr_msg_data_type == "text":
            try:
                self.queue.put_nowait({"type": "websocket.receive", "text": data.decode()})
            except UnicodeDecodeError:
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        else:
            self.queue.put_nowait({"type": "websocket.receive", "bytes": data})
        self._queued_bytes += len(data)
        # uvicorn's receive() resumes reading once the queue is empty.
        if not self.read_paused and (self.queue.qsize() >= MAX_INBOUND or self._queued_bytes >= INBOUND_BYTES):
            self.read_paused = True
            self._unread_at = self.loop.time()
            self.transport.pause_reading()

    async def receive(self) -> Any:
        paused = self.read_paused
        message = await super().receive()
        if paused and not self.read_paused:
            self._unread_at = self.loop.time()
        if paused and not self.read_paused and self._message_since is not None:
            # The socket was not read (the app was behind, or held input for the bus): an
            # unfinished message's time counts from now, it was not the client's to finish.
            self._message_since = time.monotonic()
        body = message.get("text") or message.get("bytes")
        if isinstance(body, str | bytes):
            self._queued_bytes = max(0, self._queued_bytes - len(body))
        return message

    # -- sending ---------------------------------------------------------------
    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if not self.close_sent:  # accepted for the app: give it the direct send
            extensions = cast(dict[str, Any], self.scope["extensions"])
            extensions[SEND_NOW] = self.send_now
            extensions[OUTLET] = self

    def shutdown(self) -> None:
        """The server is stopping. uvicorn would close the socket at once (1012), aborting its
        live calls; instead the app drains first (no new calls, live ones may end, the rest end
        with 503), and the socket closes after that."""
        drain = self.app_state.get(DRAIN)
        if drain is None or self.close_sent or not self.handshake_complete or self.disconnected:
            super().shutdown()
            return
        drain().add_done_callback(self._shut_after_drain)

    def _shut_after_drain(self, drained: asyncio.Future[None]) -> None:
        if not drained.cancelled() and drained.exception() is not None:
            log.error("draining failed; closing the socket", exc_info=drained.exception())
        self._flush()
        if not self.disconnected:
            super().shutdown()

    def handle_close(self, event: Any) -> None:
        self._flush()  # what was queued goes out before the reply to the client's close
        super().handle_close(event)

    def send_now(self, payload: bytes, binary: bool = False) -> None:
        """Queue one text message (UTF-8), or a binary one, for the next write, without
        awaiting; raises ClientDisconnected where the socket is gone, or is dropped now
        because its client is not reading.

        Every output of every call comes this way. Where the frame is the plain one (an open
        connection without extensions: no per-message deflate, which the frontend does not
        offer), its header is written here (`frame_header`): websockets' framing cost four
        times as much, for the same bytes."""
        if self.conn.extensions or self.conn.state is not State.OPEN or self.conn.writes:
            self._send_frame(self.conn.send_binary if binary else self.conn.send_text, payload)
            return
        if not self.handshake_complete or self.close_sent or self.disconnected or self.transport.is_closing():
            raise ClientDisconnected()
        head = frame_header(OP_BINARY if binary else OP_TEXT, len(payload))
        self._out.append(head)
        self._out.append(payload)
        self._out_bytes += len(head) + len(payload)
        self._sent()

    def backlog(self) -> int:
        """Bytes waiting for the client: queued for this turn's write, and in the transport."""
        if self.transport is None:
            return 0
        return self._out_bytes + self.transport.get_write_buffer_size()

    def has_room(self) -> bool:
        """Under `max_send_buffer` bytes wait for the client: outputs may be relayed to it."""
        return self.backlog() < self.max_send_buffer

    async def send(self, message: Any) -> None:
        if message["type"] != "websocket.send" or not self.handshake_complete or self.close_sent:
            self._flush()  # what was queued goes out before a close or a handshake reply
            await super().send(message)
            if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
                # A refusal at the handshake (an HTTP response: `app._deny`) is over, as uvicorn
                # marks its own 403: else it logs an error ("returned without completing handshake").
                self.handshake_complete = True
            return
        data = message.get("bytes")
        if data is None:
            self._send_frame(self.conn.send_text, message["text"].encode())
        else:
            self._send_frame(self.conn.send_binary, data)

    def _send_frame(self, frame: Callable[[bytes], None], payload: bytes) -> None:
        if not self.handshake_complete or self.close_sent or self.disconnected or self.transport.is_closing():
            raise ClientDisconnected()
        try:
            frame(payload)
        except InvalidState:
            raise ClientDisconnected() from None
        for chunk in self.conn.data_to_send():
            self._out.append(chunk)
            self._out_bytes += len(chunk)
        self._sent()

    def _sent(self) -> None:
        """A frame was queued: the bound, the turn's write, the guard's account."""
        if self.backlog() > 2 * self.max_send_buffer:
            self._give_up("replies past twice max_send_buffer_mb", self.backlog())
            raise ClientDisconnected()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        self._report(time.monotonic())

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
            self._written += self._out_bytes
        self._out.clear()
        self._out_bytes = 0

    def _give_up(self, why: str, waiting: int) -> None:
        """The client has not read what was sent to it: drop the connection (its calls are
        aborted by the app when it sees the disconnect)."""
        bound = self.max_send_buffer
        log.warning("dropping a WebSocket, client not reading: %s (%d bytes waiting, bound %d)", why, waiting, bound)
        self._out.clear()
        self._out_bytes = 0
        self.transport.abort()  # connection_lost() then tells the app: websocket.disconnect

    # -- limits (`limits.Guard`) -----------------------------------------------
    def _report(self, now: float) -> None:
        if self.guard is None:
            return
        held = self._frames_bytes + len(self.conn.reader.buffer) + self._queued_bytes + self.backlog()
        for conn, why in self.guard.report(self, held, now):
            conn.shed(why)

    def load(self, now: float) -> Load:
        waiting = self.transport.get_write_buffer_size() if self.transport is not None else 0
        delivered = self._written - waiting
        if waiting == 0 or delivered != self._seen_delivered:
            self._seen_delivered = delivered
            self._progress_at = now
        if self.busy is not None and self.busy():
            self._active_at = now
        return Load(
            input=self._frames_bytes + len(self.conn.reader.buffer) + self._queued_bytes,
            output=self._out_bytes + waiting,
            message_since=None if self.read_paused else self._message_since,  # not read: not the client's delay
            stalled_since=self._progress_at if waiting else None,
            # A message under way is judged by message_timeout_s alone: with both timeouts alike,
            # whichever the check met first closed it, as idle (1000) or as unfinished (1008).
            idle_since=self._active_at if self._may_idle() else None,
        )

    def _may_idle(self) -> bool:
        """Whether the socket counts as idle: an app socket past its handshake, with no message under way."""
        return self.busy is not None and self.handshake_complete and self._message_since is None

    def shed(self, why: Shed) -> None:
        """End the connection for the limit `why` names (`limits.Limits.verdict`)."""
        if self.disconnected or self.transport is None or self.transport.is_closing():
            return
        self.frames = []
        self._frames_bytes = 0
        if why.drop or not self.handshake_complete or self.close_sent:
            self._give_up(why.reason, self.backlog())
            return
        log.warning("closing a WebSocket (%d): %s", why.ws_code, why.reason)
        self._flush()
        if self.transport.get_write_buffer_size() > 0:
            self._give_up(why.reason, self.backlog())  # it is not reading what waits: a goodbye would wait too
            return
        self.conn.send_close(why.ws_code, why.reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.queue.put_nowait({"type": "websocket.disconnect", "code": why.ws_code, "reason": why.reason})
        # The closing handshake: what the client still sends is read and dropped until its
        # close frame comes (handle_close then closes) or for CLOSE_LINGER_S; closing at once
        # would answer its next bytes with a reset, which loses our close frame on the way.
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(CLOSE_LINGER_S, self.transport.abort)
