"""`/generate/ws`'s client-stream limits on `WS /v1/realtime`, over a raw socket against an
echo stack whose limits are small: an oversize event and the call's input bound are `error`
events (`limit_exceeded`, `param` the config key) and the session goes on; a session whose
socket is open lives past the input timeout, and `realtime.max_session_s` ends it
(`session_expired`, close 1008)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from shared.runtime.config import ServingConfig
from shared.sdk.audio import b64_pcm16
from tests.support.realtime import MANUAL_16K, RT, audio_of, check_responses, tone, wait_calls
from tests.support.stack import Stack, running_stack

REQUEST_TIMEOUT_S = 1.5
MAX_SESSION_S = 6.0
CONFIG = {
    "model": "echo",
    "max_message_mb": 0.05,  # 52 KB: 1 s of 16 kHz audio (43 KB of base64) fits, 1.5 s does not
    "max_call_input_mb": 0.1,  # 3.3 s of 16 kHz audio per session
    "request_timeout_s": REQUEST_TIMEOUT_S,
    "realtime": {"resume_grace_s": 0, "max_session_s": MAX_SESSION_S},
}
LIMITS = msgspec.convert(CONFIG, ServingConfig)
VAD_16K = {"type": "session.update", "session": {"input_audio_format": "pcm16", "sample_rate_hz": 16000}}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def test_an_event_over_max_message_mb_is_limit_exceeded_and_the_session_goes_on(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    big = {"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(1.5, 16000)), "event_id": "big"}
    await rt.send(big)
    err = (await rt.next("error"))["error"]
    assert (err["code"], err["param"], err["type"]) == ("limit_exceeded", "max_message_mb", "invalid_request_error"), err
    assert f"over the limit of {LIMITS.max_message_bytes} bytes" in err["message"], err
    # Refused unread (not even its event_id): the session goes on, and what was refused is not in the buffer.
    clip = tone(0.5, 16000)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    done = await rt.next("response.done")
    assert audio_of(rt.seen, done["response"]["id"]) == clip.tobytes()
    check_responses(rt.seen)
    await rt.close()
    await wait_calls(stack, 0)


async def test_past_max_call_input_mb_an_append_is_limit_exceeded_and_the_session_goes_on(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(VAD_16K)  # server VAD: every append goes to the call as it comes
    await rt.next("session.updated")
    for i in range(4):  # 1 s each: the fourth passes 3.3 s
        await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(1.0, 16000)), "event_id": f"a{i}"})
    err = (await rt.next("error"))["error"]
    assert (err["code"], err["param"], err["event_id"]) == ("limit_exceeded", "max_call_input_mb", "a3"), err
    await rt.send({"type": "session.heartbeat"})
    await rt.next("session.heartbeat")
    await rt.close()
    await wait_calls(stack, 0)


async def test_a_manual_buffer_past_max_call_input_mb_is_input_audio_buffer_full(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    for i in range(4):
        await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(1.0, 16000)), "event_id": f"a{i}"})
    err = (await rt.next("error"))["error"]
    assert (err["code"], err["param"], err["event_id"]) == ("input_audio_buffer_full", "audio", "a3"), err
    assert "max_call_input_mb" in err["message"]
    # What the buffer holds (3 s) still goes out on a commit.
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    done = await rt.next("response.done")
    assert len(audio_of(rt.seen, done["response"]["id"])) == 3 * 16000 * 2
    await rt.close()
    await wait_calls(stack, 0)


async def test_a_session_that_waits_lives_past_request_timeout_s(stack: Stack) -> None:
    """A push-to-talk client waits with its socket open and sends nothing: the session is not
    idle (request_timeout_s is /generate/ws's input timeout) and answers when it speaks."""
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    await asyncio.sleep(2 * REQUEST_TIMEOUT_S + 0.5)
    assert not [e for e in rt.seen if e["type"] == "error"]
    clip = tone(0.2, 16000)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    done = await rt.next("response.done")
    assert audio_of(rt.seen, done["response"]["id"]) == clip.tobytes()
    await rt.close()
    await wait_calls(stack, 0)


async def test_a_session_past_realtime_max_session_s_expires_though_it_is_alive(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    start = time.monotonic()

    async def beat() -> None:  # signs of life all along
        while True:
            await rt.send({"type": "session.heartbeat"})
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    try:
        err = (await rt.next("error", timeout=MAX_SESSION_S + 15))["error"]
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
    assert (err["code"], err["type"]) == ("session_expired", "invalid_request_error"), err
    assert "realtime.max_session_s" in err["message"], err
    assert time.monotonic() - start >= MAX_SESSION_S - 1.0
    assert await rt.closed() == 1008
    assert rt.ws.close_reason == "session expired"
    await wait_calls(stack, 0)
