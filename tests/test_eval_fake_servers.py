"""`duplexbus eval` against small in-test WebSocket servers that misbehave on purpose: each
stage stalls, padding is answered with listen acks, the socket closes early, errors come,
a response never ends. Each retry and no-retry rule of the eval (clients/eval/core.py) is
checked here through the real runner and sockets."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import websockets
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from clients.eval.core import Bounds, Failure, Stage
from clients.eval.protocols import COMMIT_EMPTY, Realtime
from clients.eval.runner import Options, Outcome, Sample, run_sample

# slow: in one process, but the runner's stall bounds are waited out for real (about 40 s in all).
pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

RATE = 16000
CLIP = (np.arange(RATE // 2) % 200 - 100).astype("<i2")  # 0.5 s
BOUNDS = Bounds(
    # Never waited out here on purpose (the connect stall has bounds of its own), and a
    # loopback connect took over 1 s once, at the suite's busiest start: a retry that is meant
    # to connect then failed (test_a_handshake_stall_is_retried_once).
    connect_s=10.0,
    handshake_s=2.0,  # waited out by the handshake stalls; a retry's handshake has this long
    input_slack_s=1.0,
    commit_s=1.0,
    drain_s=3.0,
    quiet_s=0.3,
    close_s=0.5,
    close_grace_s=0.5,
)

Handler = Callable[[ServerConnection], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(*handlers: Handler, small_buffers: bool = False) -> AsyncIterator[list[int]]:
    """A WebSocket server on loopback; connection i runs handlers[i] (the last one from then
    on). Yields the list of connections seen so far (its length). With small_buffers the
    socket takes little before a server that stops reading holds the client's sends up."""
    seen: list[int] = []
    tasks: list[asyncio.Task[Any]] = []
    sockets: list[ServerConnection] = []

    async def handle(ws: ServerConnection) -> None:
        seen.append(len(seen))
        sockets.append(ws)
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        await handlers[min(len(seen) - 1, len(handlers) - 1)](ws)

    sock = socket.socket()
    if small_buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    async with websockets.serve(handle, sock=sock, max_size=None, compression=None, max_queue=1, close_timeout=0.2) as server:
        port = server.sockets[0].getsockname()[1]
        seen_url.append(f"ws://127.0.0.1:{port}/v1/realtime")
        try:
            yield seen
        finally:
            for t in tasks:  # a handler that stalls on purpose would hold the server's close up
                t.cancel()
            for ws in sockets:  # and its socket, left open, would be reported unclosed when collected
                ws.transport.abort()


seen_url: list[str] = []


def url() -> str:
    return seen_url[-1]


async def run(protocol: str = "realtime", pace: str = "fast", clip: np.ndarray = CLIP, **kw: Any) -> Outcome:
    opts = Options(url=url(), protocol=protocol, pace=pace, bounds=kw.pop("bounds", BOUNDS), **kw)
    return await run_sample(Sample("clip", clip, RATE, "hello"), opts)


LONG = np.tile(CLIP, 6)  # 3 s: more than the socket's buffers hold once the server stops reading


@dataclass
class RT:
    """A scripted realtime server for one connection. By default a well-behaved echo: each
    committed buffer comes back as one response."""

    hello: bool = True  # send session.created
    ack_update: bool = True
    ack_commit: bool = True
    reply: str = "audio"  # "audio", "none" (listening only), "open" (never done), "failed"
    listen_acks: bool = False  # answer every append after the commit with listen acks
    reply_after_padding: int = 0  # reply only once this many appends came after the commit
    reply_mid_input: bool = False  # a whole response after the first append
    stop_reading_after: int | None = None  # appends, then read nothing more (the input stalls)
    close_after: int | None = None  # appends, then close the socket
    error_on: str | None = None  # client event type answered with an error
    stall_close: bool = False  # after the reply, never answer the close
    stall_after_commit: bool = False  # from the commit on, read nothing: the close is never answered
    commit_empty: bool = False  # answer the commit with the "buffer empty" error (server VAD took it)
    got: list[str] = field(default_factory=list)
    appends: list[tuple[float, bool, bytes]] = field(default_factory=list)  # (arrival, after the commit, audio)
    committed_at: float | None = None

    async def __call__(self, ws: ServerConnection) -> None:
        ids = iter(range(10**6))

        async def send(kind: str, **fields: Any) -> None:
            await ws.send(json.dumps({"type": kind, "event_id": f"s{next(ids)}", **fields}))

        async def respond(audio: bytes) -> None:
            await send("response.created", response={"id": "r1", "status": "in_progress"})
            if self.reply == "failed":
                await send("response.done", response={"id": "r1", "status": "failed"})
                return
            await send("response.output_audio.delta", response_id="r1", delta=base64.b64encode(audio).decode())
            if self.reply == "audio":
                await send("response.done", response={"id": "r1", "status": "completed"})
            if self.stall_close:
                ws.transport.pause_reading()  # the client's close frame is never read, so never answered
                await asyncio.sleep(30)

        if self.hello:
            await send("session.created", session={"id": "sess_1"})
        buf, appends, committed, after = b"", 0, False, 0
        async for raw in ws:
            m = json.loads(raw)
            kind = m["type"]
            self.got.append(kind)
            if kind == self.error_on:
                await send("error", error={"type": "invalid_request_error", "code": "invalid_value", "message": "no"})
                continue
            if kind == "session.update" and self.ack_update:
                await send("session.updated", session=m["session"])
            elif kind == "input_audio_buffer.append":
                appends += 1
                self.appends.append((time.monotonic(), committed, base64.b64decode(m["audio"])))
                if committed:
                    after += 1
                    if self.listen_acks:
                        await send("input_audio_buffer.speech_started", audio_start_ms=0, item_id="i")
                        await send("conversation.item.added", item={"id": "i"})
                    if self.reply_after_padding and after == self.reply_after_padding:
                        await respond(buf)
                else:
                    buf += base64.b64decode(m["audio"])
                if self.reply_mid_input and appends == 1:
                    await send("response.created", response={"id": "r0"})
                    await send("response.output_audio.delta", response_id="r0", delta=m["audio"])
                    await send("response.done", response={"id": "r0", "status": "completed"})
                if appends == self.close_after:
                    await ws.close()
                    return
                if appends == self.stop_reading_after:
                    await asyncio.sleep(30)  # its receive queue fills, then the socket's buffers
            elif kind == "input_audio_buffer.commit":
                self.committed_at = time.monotonic()
                if self.commit_empty:
                    await send("input_audio_buffer.committed", item_id="i0")  # server VAD committed it first
                    await send("error", error={"type": "invalid_request_error", "code": COMMIT_EMPTY, "message": "empty"})
                elif self.ack_commit:
                    await send("input_audio_buffer.committed", item_id="i1")
                committed = True
                if self.stall_after_commit:  # as the commit is read: nothing sent after it is read
                    ws.transport.pause_reading()
                if self.reply != "none" and not self.reply_after_padding:
                    await respond(buf)
        await asyncio.sleep(0)


def failed(o: Outcome, stage: Stage, failure: Failure) -> bool:
    return not o.ok and o.error is not None and o.error.stage is stage and o.error.failure is failure


async def test_a_well_behaved_server_echo_comes_back_whole() -> None:
    server = RT()
    async with serving(server) as conns:
        o = await run()
    assert o.ok and o.retries == 0 and len(conns) == 1, o.error
    reply, rate = o.attempt.reply_audio()
    assert rate == RATE and reply.tobytes() == CLIP.tobytes()
    assert server.got[:2] == ["session.update", "input_audio_buffer.append"]
    assert o.attempt.timeline.committed is not None


async def test_a_handshake_stall_is_retried_once() -> None:
    async with serving(RT(hello=False), RT()) as conns:
        o = await run()
    assert o.ok and o.retries == 1 and len(conns) == 2
    assert o.earlier == [{"stage": "handshake", "reason": "stall", "detail": "no session.created within 2.0s"}]


async def test_a_server_that_never_answers_the_session_update_fails_after_one_retry() -> None:
    async with serving(RT(ack_update=False)) as conns:
        o = await run()
    assert failed(o, Stage.HANDSHAKE, Failure.STALL) and o.retries == 1 and len(conns) == 2


async def test_a_connect_stall_is_retried_once() -> None:
    # A TCP server that accepts and never answers the WebSocket upgrade.
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    seen_url.append(f"ws://127.0.0.1:{port}/v1/realtime")
    try:
        t0 = time.monotonic()
        o = await run(bounds=Bounds(connect_s=0.3))
    finally:
        server.close()
    assert failed(o, Stage.CONNECT, Failure.STALL) and o.retries == 1
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("status", [403, 500, 503])
async def test_a_refused_upgrade_is_a_server_error_and_not_retried(status: int) -> None:
    # 5xx too: the server said what happened (503: the deployment is full), and the eval
    # counts it rather than hiding it behind a retry (docs/eval.md, "Retries").
    calls = []

    def refuse(conn: ServerConnection, req: Request) -> Response:
        calls.append(req.path)
        return Response(status, "Refused", Headers(), b"no")

    async with websockets.serve(RT(), "127.0.0.1", 0, process_request=refuse) as server:
        seen_url.append(f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/realtime")
        o = await run()
    assert failed(o, Stage.CONNECT, Failure.SERVER_ERROR) and o.retries == 0 and len(calls) == 1
    assert o.error is not None and f"HTTP {status}" in o.error.detail


async def test_an_input_stall_is_retried_once() -> None:
    async with serving(RT(stop_reading_after=2), RT(), small_buffers=True) as conns:
        o = await run(send_buffer=4096, clip=LONG)
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] == "input" and o.earlier[0]["reason"] == "stall"


async def test_an_input_stall_under_a_completed_reply_is_retried() -> None:
    # The server answered the first append in full, then stopped reading: a reply does not
    # prove that the rest of the input arrived.
    first = RT(reply_mid_input=True, stop_reading_after=2)
    async with serving(first, RT(), small_buffers=True) as conns:
        o = await run(send_buffer=4096, clip=LONG)
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] == "input"
    assert o.attempt.reply_audio()[0].tobytes() == LONG.tobytes()  # the second attempt's whole reply


async def test_a_commit_stall_is_retried_once_even_under_a_completed_reply() -> None:
    async with serving(RT(ack_commit=False, reply_mid_input=True), RT()) as conns:
        o = await run()
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] == "commit" and o.earlier[0]["reason"] == "stall"


async def test_a_commit_the_server_vad_already_took_is_not_an_error() -> None:
    async with serving(RT(commit_empty=True)) as conns:
        o = await run()
    assert o.ok and o.retries == 0 and len(conns) == 1, o.error


async def test_a_response_that_never_ends_is_a_drain_stall_retried_once() -> None:
    async with serving(RT(reply="open"), RT()) as conns:
        o = await run()
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] == "drain" and o.earlier[0]["reason"] == "stall"


async def test_a_server_that_never_sends_a_terminal_event_fails_the_sample_in_bounded_time() -> None:
    t0 = time.monotonic()
    async with serving(RT(reply="open")) as conns:
        o = await run()
    assert failed(o, Stage.DRAIN, Failure.STALL) and o.retries == 1 and len(conns) == 2
    assert time.monotonic() - t0 < 2 * (BOUNDS.drain_s + 2.0)


async def test_listen_acks_to_padding_do_not_hold_the_drain() -> None:
    async with serving(RT(reply="none", listen_acks=True)) as conns:
        o = await run()
    assert o.ok and o.retries == 0 and len(conns) == 1, o.error
    t = o.attempt.timeline
    assert t.padding_appends >= 2 and t.listen_acks >= 2 * t.padding_appends - 2
    assert len(o.attempt.reply_audio()[0]) == 0  # answered with listening only
    assert t.stage_took["drain"] < BOUNDS.quiet_s + 1.0  # settled by the quiet window, not the drain bound


async def test_padding_keeps_a_model_that_steps_on_input_stepping() -> None:
    # This model answers only once it has had five more appends after the commit.
    async with serving(RT(reply_after_padding=5)) as conns:
        o = await run(bounds=Bounds(**{**BOUNDS.__dict__, "quiet_s": 0.8}))
    assert o.ok and len(conns) == 1, o.error
    assert o.attempt.reply_audio()[0].tobytes() == CLIP.tobytes()
    assert o.attempt.timeline.padding_appends >= 5


@pytest.mark.parametrize("pace", ["realtime", "fast"])
async def test_padding_appends_are_silence_of_the_clips_shape_on_the_media_clock(pace: str) -> None:
    server = RT(reply_after_padding=6)
    async with serving(server):
        o = await run(pace=pace, bounds=Bounds(**{**BOUNDS.__dict__, "quiet_s": 0.5}))
    assert o.ok, o.error
    clip = [audio for _, after, audio in server.appends if not after]
    pads = [(t, audio) for t, after, audio in server.appends if after]
    step = RATE * 80 // 1000  # samples per append at the default --append-ms 80
    assert {len(a) for a in clip[:-1]} == {2 * step} and b"".join(clip) == CLIP.tobytes()
    assert len(pads) >= 6 and len(pads) == o.attempt.timeline.padding_appends
    # Real appends of silence, each the size of one of the clip's appends.
    assert all(audio == bytes(2 * step) for _, audio in pads)
    # On the media clock, whatever the pace of the clip: the k-th one goes when k appends'
    # worth of audio has passed since the end of input (never ahead of it, never a burst),
    # one append's duration apart.
    assert server.committed_at is not None
    for k, (t, _) in enumerate(pads, 1):
        assert t - server.committed_at >= k * 0.080 - 0.04, (k, t - server.committed_at)
    gaps = sorted(b - a for (a, _), (b, _) in itertools.pairwise(pads))
    assert 0.06 <= gaps[len(gaps) // 2] <= 0.11, gaps


async def test_an_early_close_is_retried_once() -> None:
    async with serving(RT(close_after=2), RT()) as conns:
        o = await run()
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] == "input" and o.earlier[0]["reason"] == "closed"


@pytest.mark.parametrize("event", ["input_audio_buffer.append", "input_audio_buffer.commit", "session.update"])
async def test_a_server_error_is_never_retried(event: str) -> None:
    async with serving(RT(error_on=event)) as conns:
        o = await run()
    assert not o.ok and o.retries == 0 and len(conns) == 1
    assert o.error is not None and o.error.failure is Failure.SERVER_ERROR and "invalid_value" in o.error.detail


async def test_a_failed_response_is_a_model_error_and_not_retried() -> None:
    async with serving(RT(reply="failed")) as conns:
        o = await run()
    assert failed(o, Stage.DRAIN, Failure.SERVER_ERROR) or failed(o, Stage.COMMIT, Failure.SERVER_ERROR)
    assert o.retries == 0 and len(conns) == 1


async def test_a_close_that_stalls_after_a_completed_reply_is_published_completed() -> None:
    async with serving(RT(stall_close=True)) as conns:
        o = await run()
    assert o.ok and o.retries == 0 and len(conns) == 1
    assert o.error is not None and o.error.stage is Stage.CLOSE and o.error.failure is Failure.STALL
    # the inner close reported it (the outer wait, close_s + grace, did not have to cut it short)
    assert o.error.detail == "the server did not answer the close"
    assert o.attempt.reply_audio()[0].tobytes() == CLIP.tobytes()


async def test_a_close_that_stalls_without_a_completed_reply_is_retried() -> None:
    """Listening only, then the close never answered. (The server once stopped reading 50 ms
    after it saw the commit, from a task of its own: in a full run under load that task came
    after the client's close, which was answered, and nothing was retried.)"""
    async with serving(RT(reply="none", stall_after_commit=True), RT()) as conns:
        o = await run()
    assert o.ok and o.retries == 1 and len(conns) == 2, o.error
    assert o.earlier[0]["stage"] in ("drain", "close")


async def test_a_bug_in_the_client_fails_the_sample_with_its_traceback_not_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Realtime.classify

    def broken(self: Realtime, raw: str | bytes) -> Any:
        if b"response.created" in (raw if isinstance(raw, bytes) else raw.encode()):
            raise ZeroDivisionError("a bug in the client")
        return real(self, raw)

    monkeypatch.setattr(Realtime, "classify", broken)
    t0 = time.monotonic()
    async with serving(RT()) as conns:
        o = await run()
    assert failed(o, Stage.COMMIT, Failure.CLIENT_ERROR) or failed(o, Stage.DRAIN, Failure.CLIENT_ERROR)
    assert o.retries == 0 and len(conns) == 1
    assert o.error is not None and o.error.trace is not None
    assert "ZeroDivisionError: a bug in the client" in o.error.trace and "in broken" in o.error.trace
    assert time.monotonic() - t0 < BOUNDS.drain_s  # seen at once, not after a bound ran out


# -- generate-ws ------------------------------------------------------------------------------


def gws(
    finish: bool = True,
    reply_markers: bool = True,
    error: dict[str, Any] | None = None,
    finish_after: float = 0.0,
    stall_close: bool = False,
) -> Handler:
    """A scripted /generate/ws: echoes each append as audio; at end_input sends a reply end
    (voice_assistant's markers) and, `finish_after` seconds later, the finish, unless told
    otherwise. With `stall_close` it then never reads again, so the close is never answered."""

    async def handler(ws: ServerConnection) -> None:
        async for raw in ws:
            m = json.loads(raw)
            rid = m["request_id"]
            if error is not None:
                await ws.send(json.dumps({"request_id": rid, **error}))
                continue
            if "append" in m:
                data = m["append"][0]["data"]
                if reply_markers and not getattr(handler, "started", False):
                    handler.started = True  # type: ignore[attr-defined]
                    await ws.send(json.dumps({"request_id": rid, "output": {"type": "reply", "text": "hi"}}))
                await ws.send(json.dumps({"request_id": rid, "output": {"type": "audio", "audio": data}}))
            elif m.get("end_input"):
                if reply_markers:
                    await ws.send(json.dumps({"request_id": rid, "output": {"type": "reply_end"}}))
                if finish:
                    await asyncio.sleep(finish_after)
                    await ws.send(json.dumps({"request_id": rid, "finish": {"reason": "completed", "call_id": "c1"}}))
                if stall_close:
                    ws.transport.pause_reading()
                    await asyncio.sleep(30)

    return handler


async def test_generate_ws_echo_ends_with_the_finish() -> None:
    async with serving(gws(reply_markers=False)) as conns:
        o = await run("generate-ws")
    assert o.ok and o.retries == 0 and len(conns) == 1 and o.error is None
    assert o.attempt.reply_audio()[0].tobytes() == CLIP.tobytes()
    assert o.attempt.proto.call_id == "c1"
    assert o.attempt.timeline.padding_appends == 0  # end_input ends the input: nothing to pad


@pytest.mark.parametrize(
    ("status", "why"),
    [
        (400, "file 'mic.pcm': expected 1 channel"),
        (503, "the server is at max_concurrent_requests"),  # admission: counted, not retried
        (500, "internal error"),
    ],
)
async def test_generate_ws_a_refused_call_is_not_retried(status: int, why: str) -> None:
    async with serving(gws(error={"error": why, "status": status})) as conns:
        o = await run("generate-ws")
    assert not o.ok and o.retries == 0 and len(conns) == 1
    assert o.error is not None and o.error.failure is Failure.SERVER_ERROR and f"error {status}: {why}" in o.error.detail


async def test_generate_ws_a_completed_reply_without_its_finish_is_published_completed() -> None:
    async with serving(gws(finish=False)) as conns:
        o = await run("generate-ws")
    assert o.ok and o.retries == 0 and len(conns) == 1
    assert o.error is not None and o.error.stage is Stage.CLOSE and "end of the call" in o.error.detail


async def test_generate_ws_audio_without_an_end_or_a_finish_is_retried() -> None:
    async with serving(gws(finish=False, reply_markers=False), gws(reply_markers=False)) as conns:
        o = await run("generate-ws")
    assert o.ok and o.retries == 1 and len(conns) == 2
    assert o.earlier[0]["stage"] == "close"


async def test_generate_ws_a_late_finish_and_a_stalled_close_share_one_inner_bound() -> None:
    # The finish comes 0.6 s into the close, then the close handshake is never answered. The
    # inner close (the finish, then the handshake) has close_s in all: it reports the stall
    # itself, before the outer wait (close_s + grace) would cut it short. Two waits of
    # close_s each would take 1.6 s, past the outer 1.3 s.
    bounds = Bounds(**{**BOUNDS.__dict__, "close_s": 1.0, "close_grace_s": 0.3})
    async with serving(gws(finish_after=BOUNDS.quiet_s + 0.6, stall_close=True)) as conns:
        o = await run("generate-ws", bounds=bounds)
        ended = time.monotonic()
    assert o.ok and o.retries == 0 and len(conns) == 1  # the finish came: published completed
    assert o.attempt.proto.call_id == "c1"
    assert o.error is not None and o.error.stage is Stage.CLOSE and o.error.failure is Failure.STALL
    assert o.error.detail == "the server did not answer the close"  # the inner close's word, not the outer cut
    assert ended - o.attempt.timeline.stage_started["close"] < bounds.close_s + bounds.close_grace_s
