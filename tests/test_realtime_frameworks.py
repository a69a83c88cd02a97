"""Agent frameworks over `WS /v1/realtime`, with the real packages from PyPI (the dev extra
pins them), against one real echo stack: openai-agents' `RealtimeRunner` over two spoken
turns, LiveKit's OpenAI plugin (`RealtimeModel(base_url=...)`, no LiveKit room) with
`generate_reply`, truncate, item delete, a chat-context update and an interruption, and
Pipecat's interruption sequence replayed over a raw socket (pipecat-ai itself is too heavy
a test dependency). Each must run with no error event and no timeout; voice_assistant's
run of openai-agents is in tests/test_realtime_voice.py, beside its stack."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from shared.sdk.audio import b64_pcm16
from tests.support.realtime import (
    MANUAL_16K,
    RT,
    agent_turns,
    agents_realtime,
    audio_of,
    check_event,
    check_responses,
    tone,
    url,
    wait_calls,
)
from tests.support.stack import Stack, running_stack

RATE = 24_000  # both frameworks' default


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "realtime": {"resume_grace_s": 0}}) as s:
        yield s


def turn(lead_s: float = 0.2) -> np.ndarray:
    """A spoken turn for echo's energy detector: a little silence, 0.8 s of tone, 1 s of silence."""
    return np.concatenate([np.zeros(round(lead_s * RATE), np.int16), tone(0.8, RATE), np.zeros(RATE, np.int16)])


async def test_openai_agents_realtime_runner_holds_two_spoken_turns(stack: Stack) -> None:
    """Its defaults: semantic_vad with interrupt_response, 24 kHz PCM16. The second turn starts
    while the first reply is still playing (by its playback tracker): it truncates that reply
    and retrieves the item (`conversation.item.retrieve` was an unknown event)."""
    rt = agents_realtime()
    RealtimeAgent, RealtimeRunner = rt.RealtimeAgent, rt.RealtimeRunner

    runner = RealtimeRunner(RealtimeAgent(name="echo", instructions="Say it back."))
    config = {"url": url(stack), "api_key": "unused"}
    session = await runner.run(model_config=config)
    async with session:
        run = await agent_turns(session, [turn(0.2), turn(0.0)], RATE // 10, 20)  # 100 ms appends
    events, server = run.events, run.server
    errors = [e for e in events if e.type == "error"]
    assert errors == [], errors
    kinds = [e["type"] for e in server]
    assert kinds.count("response.done") == 2 and kinds.count("input_audio_buffer.speech_started") == 2
    assert kinds.count("conversation.item.retrieved") == kinds.count("conversation.item.truncated")
    assert len([e for e in events if e.type == "audio"]) > 0
    check_responses(server)
    await wait_calls(stack, 0)


async def test_livekit_plugin_replies_truncates_deletes_and_interrupts(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    """Its defaults: semantic_vad, create_response, 24 kHz. generate_reply waits for a
    response.created carrying its response.metadata.client_event_id (it timed out after 10 s);
    a truncate at 0 ms and a chat-context update send conversation.item.delete; interrupt()
    sends response.cancel, answered in OpenAI's words when nothing is active (which the plugin
    alone stays quiet for). No error event, nothing logged at ERROR."""
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins.openai.realtime import RealtimeModel

    model = RealtimeModel(base_url=f"http://127.0.0.1:{stack.ports[0]}/v1", model="echo", api_key="unused")
    session = model.session()
    server: list[dict[str, Any]] = []
    errors: list[Any] = []
    session.on("openai_server_event_received", server.append)
    session.on("error", errors.append)

    async def seen(kind: str, count: int = 1, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while len(matching := [e for e in server if e["type"] == kind]) < count:
            assert time.monotonic() < deadline, f"no {kind} (#{count}): {[e['type'] for e in server]}"
            await asyncio.sleep(0.02)
        return matching[count - 1]

    try:
        with caplog.at_level(logging.WARNING, logger="livekit"):
            created = await asyncio.wait_for(session.generate_reply(), 10)
            assert created.user_initiated
            await seen("response.done")
            # A spoken turn: the server's turn-taking answers it by itself (create_response).
            pcm = turn()
            for i in range(0, len(pcm), RATE // 10):
                session.push_audio(rtc.AudioFrame(pcm[i : i + RATE // 10].tobytes(), RATE, 1, RATE // 10))
            done = await seen("response.done", 2)
            spoken = len(audio_of(server, done["response"]["id"])) // 2
            assert 0.8 * RATE <= spoken <= 0.96 * RATE, spoken  # the tone, to echo's whole 80 ms frames
            reply = done["response"]["output"][0]["id"]
            session.truncate(message_id=reply, modalities=["audio"], audio_end_ms=300)
            assert (await seen("conversation.item.truncated"))["audio_end_ms"] == 300
            session.truncate(message_id=reply, modalities=["audio"], audio_end_ms=0)  # LiveKit deletes it
            assert (await seen("conversation.item.deleted"))["item_id"] == reply
            # A chat-context update that drops the user's turn: a delete the plugin waits for.
            ctx = session.chat_ctx.copy()
            user = next(i for i in ctx.items if isinstance(i, llm.ChatMessage) and i.role == "user")
            ctx.items.remove(user)
            await session.update_chat_ctx(ctx)
            assert [e["item_id"] for e in server if e["type"] == "conversation.item.deleted"] == [reply, user.id]
            # Interrupted as it asks for a reply: response.cancel, whatever state the response is in.
            asking = session.generate_reply()
            session.interrupt()
            await asyncio.wait_for(asking, 10)
            await seen("response.done", 3)
            await asyncio.sleep(0.2)  # the cancel's answer
        assert errors == [], errors
        assert [r for r in caplog.records if r.name.startswith("livekit") and r.levelno >= logging.ERROR] == []
        for e in server:
            check_event(e)
        check_responses(server)
        refusals = [e["error"] for e in server if e["type"] == "error"]
        assert all(r["message"] == "Cancellation failed: no active response found" for r in refusals), refusals
    finally:
        await session.aclose()
        await model.aclose()
    await wait_calls(stack, 0)


async def test_pipecats_interruption_sequence_over_a_raw_socket(stack: Stack) -> None:
    """Pipecat on a barge-in: output_audio_buffer.clear, response.cancel, then a truncate of
    the assistant item at the audio it had played. Sent at once, in one burst, as the reply
    begins: each is answered, the response ends once (cancelled, or completed just before the
    cancel, which is then answered in OpenAI's words), and the truncate is clamped to what
    was sent."""
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(1.0, 16000))})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    created = await rt.next("response.created")
    item = (await rt.next("response.output_item.added"))["item"]["id"]
    await rt.send({"type": "output_audio_buffer.clear", "event_id": "clear"})
    await rt.send({"type": "response.cancel", "event_id": "cancel"})
    await rt.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 40})
    truncated = await rt.next("conversation.item.truncated")
    assert truncated["item_id"] == item and truncated["audio_end_ms"] <= 40
    kinds = [e["type"] for e in rt.seen]
    assert "output_audio_buffer.cleared" in kinds
    done = [e for e in rt.seen if e["type"] == "response.done"]
    assert [d["response"]["id"] for d in done] == [created["response"]["id"]]
    if done[0]["response"]["status"] != "cancelled":
        err = next(e["error"] for e in rt.seen if e["type"] == "error")
        assert (err["event_id"], err["message"]) == ("cancel", "Cancellation failed: no active response found")
    check_responses(rt.seen)
    await rt.close()
    await wait_calls(stack, 0)
