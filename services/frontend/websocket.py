"""The frontend's WebSocket connection: uvicorn's sans-I/O protocol, tuned for many small messages.

A socket here carries many live calls, each sending and receiving a message every few tens
of milliseconds. uvicorn's protocol makes two system calls per message received (it
pauses reading after every message until the app takes it, then resumes) and one write
per message sent. At a few thousand messages a second those system calls, and the
context switches they cause on a loaded machine, cost more than the messages themselves.
This protocol changes four things and nothing else:

- Reading pauses only when `MAX_INBOUND` messages wait for the app (still bounded).
- Outgoing messages are written together: one transport write per event-loop turn. The
  app can send without awaiting (the `duplexbus.send_now` scope extension), so a call's
  output goes from the bus to the socket buffer in one callback, with no queue and task.
- On shutdown the socket stays open while the app drains its calls (`DRAIN`).
- Sending never waits on a slow client. A client that stops reading is disconnected once
  more than `max_send_buffer` bytes wait for it, and its calls are aborted as for any closed
  socket. Without this, a client that never reads would hold its calls (and
  their slots) open, and the frontend's memory, until its next message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

log = logging.getLogger(__name__)

MAX_INBOUND = 256  # client messages read ahead of the app before reading pauses
SEND_NOW = "duplexbus.send_now"  # ASGI scope extension: send a text message (UTF-8 bytes) without awaiting
DRAIN = "duplexbus.drain"  # lifespan state: starts (once) the app's drain, returns its task


class FrontendWebSocketProtocol(WebSocketsSansIOProtocol):
    max_send_buffer = 16 * 1024 * 1024  # bytes waiting for one client before it is disconnected

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_scheduled = False

    @classmethod
    def with_send_buffer(cls, max_bytes: int) -> type[FrontendWebSocketProtocol]:
        """This protocol with its own bound (uvicorn takes a class, not an instance)."""
        return type(cls.__name__, (cls,), {"max_send_buffer": max_bytes})

    # -- receiving -------------------------------------------------------------
    def send_receive_event_to_app(self) -> None:
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
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
        # uvicorn's receive() resumes reading once the queue is empty.
        if not self.read_paused and self.queue.qsize() >= MAX_INBOUND:
            self.read_paused = True
            self.transport.pause_reading()

    # -- sending ---------------------------------------------------------------
    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if not self.close_sent:  # accepted for the app: give it the direct send
            extensions = cast(dict[str, Any], self.scope["extensions"])
            extensions[SEND_NOW] = self.send_now

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

    def send_now(self, text: bytes) -> None:
        """Queue one text message (UTF-8) for the next write, without awaiting; raises
        ClientDisconnected where the socket is gone, or is dropped now because its client is
        not reading."""
        self._send_frame(self.conn.send_text, text)

    async def send(self, message: Any) -> None:
        if message["type"] != "websocket.send" or not self.handshake_complete or self.close_sent:
            self._flush()  # what was queued goes out before a close or a handshake reply
            await super().send(message)
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
        if self._out_bytes + self.transport.get_write_buffer_size() > self.max_send_buffer:
            self._give_up()
            raise ClientDisconnected()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()
        self._out_bytes = 0

    def _give_up(self) -> None:
        """The client has not read what was sent to it: drop the connection (its calls are
        aborted by the app when it sees the disconnect)."""
        log.warning(
            "closing a WebSocket whose client is not reading (%d bytes waiting, limit %d)",
            self._out_bytes + self.transport.get_write_buffer_size(),
            self.max_send_buffer,
        )
        self._out.clear()
        self._out_bytes = 0
        self.transport.abort()  # connection_lost() then tells the app: websocket.disconnect
