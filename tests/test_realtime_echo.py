"""`WS /v1/realtime` end to end with the official `openai` SDK as the client, against a real
stack (nats-server, conductor, worker, frontend as processes) serving `echo`.

Every event received is validated by the SDK's typed event models (tests/support/realtime.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests.support.realtime import audio_of, check_responses, manual, sdk_append, sdk_client, sdk_turn, snr_db, tone, until
from tests.support.stack import Stack, running_stack

if TYPE_CHECKING:
    from openai import AsyncOpenAI


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo", "realtime": {"resume_grace_s": 3.0}}) as s:
        yield s


def client(stack: Stack) -> AsyncOpenAI:
    return sdk_client(stack.ports[0])


async def test_echo_16khz_manual_commits_come_back_byte_exact(stack: Stack) -> None:
    events: list[dict[str, Any]] = []
    async with client(stack).realtime.connect(model="echo") as conn:
        created = await until(conn, "session.created", events)
        assert created["session"]["model"] == "echo" and created["session"]["resume_token"]
        await conn.session.update(session=manual(16000))  # type: ignore[arg-type]
        await until(conn, "session.updated", events)
        clips = [tone(0.5, 16000), tone(0.23, 16000, hz=660)]
        for clip in clips:
            done = await sdk_turn(conn, clip, 320, events, create=True)  # 20 ms appends
            assert done["response"]["status"] == "completed"
            assert audio_of(events, done["response"]["id"]) == clip.tobytes()
        await conn.send({"type": "session.close"})  # type: ignore[arg-type]
        await until(conn, "session.closed", events)
    check_responses(events)
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.committed") == 2 and kinds.count("response.done") == 2


async def test_echo_24khz_comes_back_within_the_bound(stack: Stack) -> None:
    """The GA default rate: 24 kHz in and out, echo at 16 kHz between (soxr HQ both ways).
    Stated bound: the same sample count (+-2) and an SNR above 40 dB for a 440 Hz tone."""
    events: list[dict[str, Any]] = []
    async with client(stack).realtime.connect(model="echo") as conn:
        await conn.session.update(session=manual(24000))  # type: ignore[arg-type]
        await until(conn, "session.updated", events)
        clip = tone(1.0, 24000)
        done = await sdk_turn(conn, clip, 480, events)
    got = np.frombuffer(audio_of(events, done["response"]["id"]), dtype="<i2")
    assert abs(len(got) - len(clip)) <= 2
    assert snr_db(clip, got) > 40.0


@pytest.mark.parametrize(("input_rate", "output_rate"), [(48000, 48000), (8000, 24000)])
async def test_echo_at_other_rates_comes_back_at_the_output_rate(stack: Stack, input_rate: int, output_rate: int) -> None:
    """48 kHz both ways, and 8 kHz in with 24 kHz out: the reply is at the declared output
    rate, within the bound the pure test states (+-2 samples, SNR above 50 dB)."""
    events: list[dict[str, Any]] = []
    session = manual(input_rate)
    session["audio"]["output"]["format"] = {"type": "audio/pcm", "rate": output_rate}
    async with client(stack).realtime.connect(model="echo") as conn:
        await conn.session.update(session=session)  # type: ignore[arg-type]
        await until(conn, "session.updated", events)
        done = await sdk_turn(conn, tone(0.5, input_rate), input_rate // 50, events)
    got = np.frombuffer(audio_of(events, done["response"]["id"]), dtype="<i2")
    assert abs(len(got) - output_rate // 2) <= 2, (len(got), output_rate)
    assert snr_db(tone(0.5, output_rate), got) > 50.0


async def test_echo_server_vad_turn_comes_back_as_a_response(stack: Stack) -> None:
    events: list[dict[str, Any]] = []
    async with client(stack).realtime.connect(model="echo") as conn:
        fmt = {"type": "audio/pcm", "rate": 16000}
        session = {
            "type": "realtime",
            "audio": {"input": {"format": fmt, "turn_detection": {"type": "server_vad"}}, "output": {"format": fmt}},
        }
        await conn.session.update(session=session)  # type: ignore[arg-type]
        voiced = tone(0.4, 16000)[: 5 * 1280]
        audio = np.concatenate([np.zeros(2 * 1280, np.int16), voiced, np.zeros(10 * 1280, np.int16)])
        await sdk_append(conn, audio, 640)
        stopped = await until(conn, "input_audio_buffer.speech_stopped", events)
        done = await until(conn, "response.done", events)
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    assert started["audio_start_ms"] == 160 and stopped["item_id"] == started["item_id"]
    assert audio_of(events, done["response"]["id"]) == voiced.tobytes()
