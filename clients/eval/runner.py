"""The socket side of an eval: one `Attempt` per try of a sample (its own connection, a
reader task, a padding task), `run_sample` with the retry rules of `core.decide`, and
`run_eval` over a corpus with a bounded number of samples at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from clients.eval import protocols
from clients.eval.core import (
    MAX_RETRIES,
    Bounds,
    Drain,
    Event,
    Failure,
    Kind,
    Progress,
    Stage,
    Timeline,
    Verdict,
    decide,
)

Clock = Callable[[], float]


@dataclass
class Sample:
    """One clip. `schedule`, where given, is when to send what: (seconds after the input
    starts, PCM16 bytes), e.g. a recorded call's own pacing; otherwise the clip goes in
    appends of `Options.append_ms`."""

    name: str
    pcm: np.ndarray  # int16 mono
    rate: int
    reference: str | None = None
    schedule: list[tuple[float, bytes]] | None = None

    @property
    def duration_s(self) -> float:
        """How long the input takes to send at its pace (a schedule may pause)."""
        audio_s = len(self.pcm) / self.rate
        return max(audio_s, self.schedule[-1][0]) if self.schedule else audio_s


@dataclass
class Options:
    url: str
    protocol: str = "generate-ws"
    model: str | None = None
    pace: str = "realtime"  # or "fast": appends as fast as the socket takes them
    append_ms: int = 80
    bounds: Bounds = field(default_factory=Bounds)
    turn_detection: str | None = None
    response_create: bool = True
    transcription_model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    send_buffer: int | None = None  # SO_SNDBUF of the client socket (tests make stalls quick with a small one)

    def protocol_for(self, rate: int) -> protocols.Protocol:
        if self.protocol == "realtime":
            return protocols.Realtime(rate, self.model, self.turn_detection, self.response_create, self.transcription_model)
        return protocols.make(self.protocol, rate, self.model)


def schedule(sample: Sample, append_ms: int) -> list[tuple[float, bytes]]:
    """Appends of `append_ms`, each sent when its audio would have been recorded (its end)."""
    if sample.schedule is not None:
        return sample.schedule
    step = max(1, sample.rate * append_ms // 1000)
    out = []
    for start in range(0, len(sample.pcm), step):
        chunk = sample.pcm[start : start + step]
        out.append(((start + len(chunk)) / sample.rate, np.asarray(chunk, "<i2").tobytes()))
    return out


class StageError(Exception):
    def __init__(self, stage: Stage, failure: Failure, detail: str, trace: str | None = None) -> None:
        super().__init__(f"{stage.value}: {failure.value}: {detail}")
        self.stage, self.failure, self.detail, self.trace = stage, failure, detail, trace

    def summary(self) -> dict[str, Any]:
        return {"stage": self.stage.value, "reason": self.failure.value, "detail": self.detail}


class Attempt:
    """One try of a sample on a connection of its own. `run` raises StageError for a failed
    stage and lets any other exception (a bug in this client) through."""

    def __init__(self, sample: Sample, opts: Options, clock: Clock = time.monotonic) -> None:
        self.sample, self.opts, self.clock = sample, opts, clock
        self.bounds = opts.bounds
        self.proto = opts.protocol_for(sample.rate)
        self.progress = Progress()
        self.drain = Drain(self.bounds.quiet_s)
        self.timeline = Timeline(opened=clock())
        self.events: list[tuple[float, Event]] = []
        self.seen: set[str] = set()
        self.ws: websockets.ClientConnection | None = None
        self.changed = asyncio.Event()
        self.closed = False
        self.server_error: Event | None = None
        self.bug: BaseException | None = None  # raised in a task of ours: re-raised where the sample waits
        self.pad_failure: StageError | None = None
        self.commit_sent = False
        self.committed = False
        self._reader: asyncio.Task[None] | None = None
        self._padder: asyncio.Task[None] | None = None
        self._stop_padding = asyncio.Event()

    # -- what the server sends ------------------------------------------------------------

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for raw in self.ws:
                now = self.clock()
                for ev in self.proto.classify(raw):
                    self._on_event(ev, now)
                self.changed.set()
        except ConnectionClosed:
            pass
        except Exception as e:
            self.bug = e
        finally:
            self.closed = True
            self.changed.set()

    def _on_event(self, ev: Event, now: float) -> None:
        self.events.append((now, ev))
        self.seen.add(ev.name)
        self.timeline.on_event(ev, now)
        self.drain.on_event(ev, now)
        if ev.kind is Kind.COMMITTED and self.commit_sent:
            self.committed = True
        elif ev.kind is Kind.ERROR:
            if self.commit_sent and self.proto.commit_redundant(ev):
                self.committed = True
            elif self.server_error is None:
                self.server_error = ev
        elif ev.kind is Kind.REPLY_END and ev.failed and self.server_error is None:
            self.server_error = ev  # a failed response: the model's error

    # -- bounded waits ----------------------------------------------------------------------

    def _check(self, stage: Stage) -> None:
        if self.bug is not None:
            raise self.bug
        if self.server_error is not None:
            e = self.server_error
            raise StageError(stage, Failure.SERVER_ERROR, f"{e.name} {e.code}: {e.text}".strip())
        if self.pad_failure is not None:
            raise self.pad_failure

    def _closed_error(self, stage: Stage, waiting_for: str) -> StageError:
        code = self.ws.close_code if self.ws is not None else None
        return StageError(stage, Failure.CLOSED, f"the connection closed (code {code}) while waiting for {waiting_for}")

    async def _until(
        self, stage: Stage, done: Callable[[], bool], deadline: float, what: str, wake: Callable[[], float | None] = lambda: None
    ) -> None:
        bound = deadline - self.clock()
        while True:
            self._check(stage)
            if done():
                return
            if self.closed:
                raise self._closed_error(stage, what)
            now = self.clock()
            if now >= deadline:
                raise StageError(stage, Failure.STALL, f"no {what} within {bound:.1f}s")
            until = min(deadline, wake() or deadline)
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.0, until - now))

    async def _send(self, stage: Stage, msg: str, deadline: float) -> None:
        assert self.ws is not None
        self._check(stage)
        if self.closed:
            raise self._closed_error(stage, "a send")
        try:
            await asyncio.wait_for(self.ws.send(msg), max(0.0, deadline - self.clock()))
        except TimeoutError:
            raise StageError(stage, Failure.STALL, "a send did not go out in time: the server stopped reading") from None
        except ConnectionClosed:
            self._check(stage)
            raise self._closed_error(stage, "a send") from None

    # -- the stages ---------------------------------------------------------------------------

    def _seen(self, name: str) -> Callable[[], bool]:
        return lambda: name in self.seen

    def _enter(self, stage: Stage) -> float:
        now = self.clock()
        if stage is not Stage.CONNECT:
            self.timeline.leave(self.progress.stage, now)
            self.progress.to(stage)
        self.timeline.enter(stage, now)
        return now

    async def run(self) -> None:
        await self._connect()
        await self._handshake()
        await self._input()
        await self._commit()
        await self._drained()
        await self._close()
        self._enter(Stage.DONE)

    async def _connect(self) -> None:
        self._enter(Stage.CONNECT)
        inner, _ = self.bounds.close_bounds()
        url = self.proto.url(self.opts.url)
        try:
            sock = await self._socket(url) if self.opts.send_buffer else None
            connecting = websockets.connect(
                url,
                max_size=None,
                open_timeout=None,  # bounded here, with the socket's set-up
                close_timeout=inner,
                compression=None,
                additional_headers=self.opts.headers or None,
                sock=sock,
            )
            self.ws = await asyncio.wait_for(connecting, self.bounds.connect_s)
        except TimeoutError:
            raise StageError(Stage.CONNECT, Failure.STALL, f"no connection within {self.bounds.connect_s:.1f}s") from None
        except InvalidStatus as e:
            status = e.response.status_code
            raise StageError(Stage.CONNECT, Failure.SERVER_ERROR, f"the server refused the connection: HTTP {status}") from None
        except (OSError, InvalidHandshake, ConnectionClosed) as e:
            raise StageError(Stage.CONNECT, Failure.CLOSED, f"cannot connect: {e}") from None
        self._reader = asyncio.create_task(self._read())

    async def _socket(self, url: str) -> socket.socket:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "wss" else 80)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(self.opts.send_buffer or 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return sock

    async def _handshake(self) -> None:
        deadline = self._enter(Stage.HANDSHAKE) + self.bounds.handshake_s
        for step in self.proto.handshake():
            for msg in step.send:
                await self._send(Stage.HANDSHAKE, msg, deadline)
            if step.wait_for is not None:
                await self._until(Stage.HANDSHAKE, self._seen(step.wait_for), deadline, step.wait_for)
        self._check(Stage.HANDSHAKE)

    async def _input(self) -> None:
        start = self._enter(Stage.INPUT)
        self.timeline.input_started = start
        deadline = start + self.bounds.input_bound(self.sample.duration_s)
        paced = self.opts.pace == "realtime"
        for offset, pcm in schedule(self.sample, self.opts.append_ms):
            if paced:
                await asyncio.sleep(max(0.0, start + offset - self.clock()))
            else:
                await asyncio.sleep(0)  # let the reader keep up
            await self._send(Stage.INPUT, self.proto.append(pcm), deadline)
        self._check(Stage.INPUT)

    async def _commit(self) -> None:
        now = self._enter(Stage.COMMIT)
        deadline = now + self.bounds.commit_s
        self.timeline.input_ended = now
        self.drain.end_of_input(now)
        self.commit_sent = True
        if self.proto.pads_after_end:
            self._padder = asyncio.create_task(self._pad(now))
        for msg in self.proto.end_input():
            await self._send(Stage.COMMIT, msg, deadline)
        if self.proto.commit_acked:
            await self._until(Stage.COMMIT, lambda: self.committed, deadline, "acknowledgement of the end of input")
            self.timeline.committed = self.clock()

    async def _pad(self, start: float) -> None:
        """Silence appends of the same size as the clip's, on the media clock, until the
        reply has drained: the session's input is still open, and a model that steps on
        input must keep stepping to finish its reply."""
        step_s = self.opts.append_ms / 1000
        silence = bytes(2 * max(1, self.sample.rate * self.opts.append_ms // 1000))
        k = 0
        try:
            while not self._stop_padding.is_set():
                k += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_padding.wait(), max(0.0, start + k * step_s - self.clock()))
                if self._stop_padding.is_set() or self.closed:
                    return
                await self._send(self.progress.stage, self.proto.append(silence), self.clock() + self.bounds.drain_s)
                self.timeline.padding_appends += 1
        except StageError as e:
            self.pad_failure = e
        except Exception as e:
            self.bug = e
        finally:
            self.changed.set()

    async def _drained(self) -> None:
        now = self._enter(Stage.DRAIN)
        deadline = now + self.bounds.drain_s

        def done() -> bool:
            if self.closed and self.drain.reply_completed:
                return True  # the server went away after a complete reply: nothing more can come
            return self.drain.drained(self.clock())

        try:
            await self._until(Stage.DRAIN, done, deadline, "end of the reply", wake=self.drain.wake_at)
        finally:
            self._stop_padding.set()

    async def _close(self) -> None:
        start = self._enter(Stage.CLOSE)
        inner, outer = self.bounds.close_bounds()
        try:
            await asyncio.wait_for(self._goodbye(start + inner), outer)
        except TimeoutError:
            raise StageError(Stage.CLOSE, Failure.STALL, f"the close did not return within {outer:.1f}s") from None

    async def _goodbye(self, deadline: float) -> None:
        """The inner close: the call's end where the protocol has one, then the close handshake,
        both within one deadline. The handshake gets what the wait for the end left of it, not
        a `close_s` of its own: two full waits would outlast the outer bound (`close_s` plus
        the grace), which would then cut the inner one short before it could say what it saw."""
        assert self.ws is not None
        await self._stop_padder()
        if self.proto.close_after_terminal:
            await self._until(Stage.CLOSE, lambda: self.drain.terminal, deadline, "end of the call")
        if self.closed:
            return
        # Our own bound rather than the library's close timeout, which starts afresh here and
        # does not cover the close frame's send (it waits on a server that stopped reading).
        with contextlib.suppress(TimeoutError):  # not answered in time: said below; `close()` drops the socket
            await asyncio.wait_for(self.ws.close(), max(0.0, deadline - self.clock()))
        if self.ws.protocol.close_rcvd is None:
            raise StageError(Stage.CLOSE, Failure.STALL, "the server did not answer the close")

    async def _stop_padder(self) -> None:
        self._stop_padding.set()
        await _cancel(self._padder)

    async def close(self) -> None:
        """Cancel and await this attempt's tasks; drop the connection if it is still up."""
        await self._stop_padder()
        if self.ws is not None and not self.closed:
            self.ws.transport.abort()
        await _cancel(self._reader)

    # -- results ----------------------------------------------------------------------------------

    def reply_audio(self) -> tuple[np.ndarray, int]:
        chunks = [ev.audio for _, ev in self.events if ev.kind is Kind.REPLY_AUDIO]
        rate = next((ev.rate for _, ev in self.events if ev.kind is Kind.REPLY_AUDIO), self.sample.rate)
        return np.frombuffer(b"".join(chunks), dtype="<i2"), rate

    def texts(self, kind: Kind) -> str:
        return "".join(ev.text for _, ev in self.events if ev.kind is kind)

    def reply_text(self) -> str:
        deltas = self.texts(Kind.REPLY_TEXT)
        if deltas:
            return deltas
        return " ".join(ev.text for _, ev in self.events if ev.kind is Kind.REPLY_START and ev.text)

    def transcript(self) -> str:
        return " ".join(ev.text for _, ev in self.events if ev.kind is Kind.TRANSCRIPT and ev.text)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Outcome:
    """A sample's end: the attempt that ended it, and what ended it."""

    sample: Sample
    attempt: Attempt
    ok: bool
    retries: int
    error: StageError | None = None  # what failed it (or, where ok, the close that stalled after a completed reply)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # the failures that were retried


async def run_sample(sample: Sample, opts: Options, clock: Clock = time.monotonic) -> Outcome:
    earlier: list[dict[str, Any]] = []
    retries = 0
    while True:
        att = Attempt(sample, opts, clock)
        try:
            await att.run()
            return Outcome(sample, att, True, retries, earlier=earlier)
        except StageError as e:
            verdict = decide(e.stage, e.failure, att.drain.reply_completed, retries)
            if verdict is Verdict.COMPLETED:
                return Outcome(sample, att, True, retries, error=e, earlier=earlier)
            if verdict is Verdict.FAIL:
                return Outcome(sample, att, False, retries, error=e, earlier=earlier)
            earlier.append(e.summary())
            retries += 1
        except Exception as e:
            trace = "".join(traceback.format_exception(e))
            err = StageError(att.progress.stage, Failure.CLIENT_ERROR, f"{type(e).__name__}: {e}", trace)
            return Outcome(sample, att, False, retries, error=err, earlier=earlier)
        finally:
            await att.close()
        assert retries <= MAX_RETRIES


async def run_eval(
    samples: list[Sample],
    opts: Options,
    concurrency: int,
    on_done: Callable[[Outcome], Awaitable[None] | None],
) -> list[Outcome]:
    """Every sample, at most `concurrency` at once; `on_done` runs as each one ends (so a
    record is written the moment its sample completes, whatever happens to the run later)."""
    queue: asyncio.Queue[Sample] = asyncio.Queue()
    for s in samples:
        queue.put_nowait(s)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while True:
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            outcome = await run_sample(s, opts)
            outcomes.append(outcome)
            maybe = on_done(outcome)
            if maybe is not None:
                await maybe

    async with asyncio.TaskGroup() as tg:
        for _ in range(max(1, min(concurrency, len(samples)))):
            tg.create_task(worker())
    return outcomes
