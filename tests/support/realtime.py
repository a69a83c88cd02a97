"""Shared by the realtime tests: every server event checked against the official `openai`
SDK's typed event models, a count of response.done per response, and a raw realtime socket
on a test stack."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import websockets
from pydantic import TypeAdapter

from tests.support.client import WS
from tests.support.stack import Stack

if TYPE_CHECKING:
    from openai import AsyncOpenAI

# Our extensions (vllm-omni's names): not in the SDK's union, checked for their envelope.
EXTENSIONS = {"playback.acknowledged", "session.closed", "session.heartbeat", "session.resumed"}
_SERVER_EVENT: TypeAdapter[Any] | None = None

MANUAL_16K = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcm", "rate": 16000}},
        },
    },
}
"""A session.update to 16 kHz both ways (echo's own rate: nothing resampled) and manual commits."""


def check_event(e: dict[str, Any]) -> None:
    """The event validates against the SDK's model for its type (required fields and all)."""
    global _SERVER_EVENT
    assert isinstance(e.get("event_id"), str) and e["event_id"], e
    if e["type"] in EXTENSIONS:
        return
    if _SERVER_EVENT is None:
        from openai.types.realtime import RealtimeServerEvent

        _SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
    parsed = _SERVER_EVENT.validate_python(e)
    assert parsed.type == e["type"], (parsed.type, e["type"])


def check_responses(events: list[dict[str, Any]], closed: bool = True) -> None:
    """Each response.created has exactly one response.done, after it (all of them, if closed)."""
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    done = Counter(e["response"]["id"] for e in events if e["type"] == "response.done")
    assert all(n == 1 for n in done.values()), done
    assert set(done) <= set(created), (created, done)
    if closed:
        assert set(done) == set(created), (created, done)


def audio_of(events: list[dict[str, Any]], response_id: str | None = None) -> bytes:
    import base64

    return b"".join(
        base64.b64decode(e["delta"])
        for e in events
        if e["type"] == "response.output_audio.delta" and (response_id is None or e["response_id"] == response_id)
    )


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """Signal to noise of `got` against `ref`, over their common length, after the best
    alignment within +-64 samples (a resampler's residual delay)."""
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    best = -np.inf
    for lag in range(-64, 65):
        a = ref[max(0, -lag) :]
        b = got[max(0, lag) :]
        n = min(len(a), len(b))
        err = np.sum((a[:n] - b[:n]) ** 2)
        best = max(best, 10 * np.log10(np.sum(a[:n] ** 2) / max(err, 1e-9)))
    return float(best)


def tone(seconds: float, rate: int, hz: float = 440.0, amp: float = 8000.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.int16)


def url(stack: Stack, model: str = "echo") -> str:
    return f"ws://127.0.0.1:{stack.ports[0]}/v1/realtime?model={model}"


def sdk_client(port: int, api_key: str = "unused") -> AsyncOpenAI:
    """The official SDK's client for the stack's frontend on `port` (imported here: `openai`'s
    import takes 1.2 s, in every pytest process that collects a module naming it at its top)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(api_key=api_key, websocket_base_url=f"ws://127.0.0.1:{port}/v1")


class RT(WS):
    """A raw realtime socket: every event received is validated and kept in `seen`."""

    seen: list[dict[str, Any]]

    @classmethod
    async def open(cls, stack: Stack) -> RT:
        return await cls.at(url(stack))

    @classmethod
    async def at(cls, address: str) -> RT:
        """A socket to a /v1/realtime URL (a frontend's, or a gateway's before several)."""
        sock = cls(await websockets.connect(address, max_size=None, ping_interval=None))
        sock.seen = []
        return sock

    async def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        e = await super().recv(timeout)
        check_event(e)
        self.seen.append(e)
        return e

    async def next(self, kind: str, timeout: float = 20.0) -> dict[str, Any]:
        return await self.until(lambda e: e["type"] == kind, timeout)

    async def closed(self, timeout: float = 10.0) -> int | None:
        """Read until the server closes the socket; its close code."""
        try:
            while True:
                await self.recv(timeout)
        except websockets.ConnectionClosed:
            return self.ws.close_code


def calls(stack: Stack) -> int:
    with urllib.request.urlopen(stack.http_url() + "/healthz", timeout=5) as r:
        return int(json.loads(r.read())["calls"])


async def wait_calls(stack: Stack, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while calls(stack) != n:
        assert time.monotonic() < deadline, f"{calls(stack)} calls, expected {n}"
        await asyncio.sleep(0.1)


# -- the official SDK's client ------------------------------------------------------
async def until(conn: Any, kind: str, events: list[dict[str, Any]], timeout: float = 20.0) -> dict[str, Any]:
    """Events (each validated) until one of `kind`."""
    import asyncio

    async def read() -> dict[str, Any]:
        while True:
            raw = await conn.recv_bytes()
            e: dict[str, Any] = json.loads(raw)
            check_event(e)
            assert conn.parse_event(raw).type == e["type"]
            events.append(e)
            if e["type"] == kind:
                return e

    return await asyncio.wait_for(read(), timeout)


def manual(rate: int) -> dict[str, Any]:
    fmt = {"type": "audio/pcm", "rate": rate}
    return {"type": "realtime", "audio": {"input": {"format": fmt, "turn_detection": None}, "output": {"format": fmt}}}


async def sdk_append(conn: Any, clip: np.ndarray, step: int) -> None:
    """`clip` appended through the SDK in pieces of `step` samples."""
    from shared.sdk.audio import b64_pcm16

    for i in range(0, len(clip), step):
        await conn.input_audio_buffer.append(audio=b64_pcm16(clip[i : i + step]))


async def sdk_turn(conn: Any, clip: np.ndarray, step: int, events: list[dict[str, Any]], create: bool = True) -> dict[str, Any]:
    """One turn committed by hand: the clip appended, committed, and `response.create` sent
    (with manual turns a commit alone starts nothing); its `response.done`."""
    await sdk_append(conn, clip, step)
    await conn.input_audio_buffer.commit()
    if create:
        await conn.response.create()
    return await until(conn, "response.done", events)


async def sdk_echo_is_byte_exact(port: int) -> None:
    """One `echo` turn through the official SDK at 16 kHz, committed by hand: the response's
    audio is the committed buffer, byte for byte, and every event validates."""
    from openai import AsyncOpenAI

    events: list[dict[str, Any]] = []
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="echo") as conn:
        await until(conn, "session.created", events)
        await conn.session.update(session=manual(16000))  # type: ignore[arg-type]
        await until(conn, "session.updated", events)
        clip = tone(0.5, 16000)
        done = await sdk_turn(conn, clip, 320, events, create=True)
        assert done["response"]["status"] == "completed", done
        assert audio_of(events, done["response"]["id"]) == clip.tobytes()
    check_responses(events)


def agents_realtime() -> Any:
    """openai-agents' `agents.realtime`, tracing off, with uvicorn left as it was: importing it imports
    sse_starlette (through mcp), which replaces `uvicorn.Server.handle_exit` in the whole
    process, and a test after it in the same process (tests/test_dependencies.py reads
    uvicorn's own methods) would see sse_starlette's."""
    from uvicorn import Server

    original = Server.handle_exit
    try:
        from agents import realtime, set_tracing_disabled
    finally:
        Server.handle_exit = original  # type: ignore[method-assign]
    set_tracing_disabled(True)  # its traces would go to OpenAI's servers, from a thread of its own
    return realtime


@dataclass
class AgentRun:
    """What an openai-agents RealtimeSession gave: every event, and the server's own among them."""

    events: list[Any] = field(default_factory=list)
    server: list[dict[str, Any]] = field(default_factory=list)
    ends: int = 0


async def agent_turns(session: Any, turns: list[np.ndarray], step: int, timeout: float) -> AgentRun:
    """Speaks each turn into an openai-agents `session` (appends of `step` samples, 10 ms apart,
    faster than real time), the next one only after the agent's end of the last; collects every
    event until the last turn's end (each server event checked against the SDK's models)."""
    run = AgentRun()

    async def speak() -> None:
        for k, pcm in enumerate(turns):
            for i in range(0, len(pcm), step):
                await session.send_audio(pcm[i : i + step].tobytes())
                await asyncio.sleep(0.01)
            while run.ends <= k:
                await asyncio.sleep(0.02)

    async def listen() -> None:
        async for e in session:
            run.events.append(e)
            if e.type == "raw_model_event" and e.data.type == "raw_server_event":
                check_event(e.data.data)
                run.server.append(e.data.data)
            if e.type == "agent_end":
                run.ends += 1
                if run.ends == len(turns):
                    return

    speaker = asyncio.create_task(speak())
    try:
        await asyncio.wait_for(listen(), timeout)
        await asyncio.wait_for(speaker, 5)
    finally:
        speaker.cancel()
    return run


async def drop_and_resume(address: str, sessions: int) -> list[tuple[str, RT]]:
    """`sessions` realtime sessions at `address`, one after another, each dropped (its socket
    aborted, as a lost network does) right after a heartbeat and resumed on a new connection
    to the same address, which may reach another frontend. Each must resume with no error event
    and go on numbering its own events. Returns each session's token and resumed socket, open."""
    from services.frontend.realtime.session import event_number

    resumed: list[tuple[str, RT]] = []
    for _ in range(sessions):
        rt = await RT.at(address)
        token = (await rt.next("session.created"))["session"]["resume_token"]
        await rt.send({"type": "session.heartbeat"})
        last = (await rt.next("session.heartbeat"))["event_id"]
        rt.ws.transport.abort()
        again = await RT.at(address)
        await again.send({"type": "session.resume", "resume_token": token, "last_event_id": last})
        await again.send({"type": "session.heartbeat"})
        beat = await again.next("session.heartbeat")
        errors = [e for e in again.seen if e["type"] == "error"]
        assert errors == [], errors
        assert beat["event_id"].rsplit("_", 1)[0] == last.rsplit("_", 1)[0]  # the resumed session's own
        assert event_number(beat["event_id"]) == (event_number(last) or 0) + 1
        resumed.append((token, again))
    return resumed


async def moves_listed(nats_url: str, tokens: list[str], heartbeat_s: float, timeout: float = 10.0) -> dict[str, int]:
    """Once every session the tokens name is listed in a frontend's heartbeat (each once): each
    session's call and its number of moves (0: it stayed on the frontend that opened it)."""
    from services.frontend.realtime.session import token_cid
    from shared.bus import subjects, wire
    from tests.support.bus import bucket_keys, connected

    cids = {token_cid(t) for t in tokens}
    deadline = time.monotonic() + timeout
    while True:
        async with connected(nats_url) as nc:
            kv = await nc.jetstream().key_value(subjects.KV_FRONTENDS)
            beats = [wire.decode_as((await kv.get(k)).value or b"", wire.FrontendHeartbeat) for k in await bucket_keys(kv)]
        listed = [(c, hb.adopted.get(c, 0)) for hb in beats for c in hb.calls or [] if c in cids]
        if len(listed) == len(cids) and {c for c, _ in listed} == cids:  # each once (a move's old listing gone)
            return dict(listed)
        assert time.monotonic() < deadline, listed
        await asyncio.sleep(heartbeat_s / 2)
