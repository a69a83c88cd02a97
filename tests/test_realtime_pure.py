"""The realtime adapter's pure core, without NATS: client events in, server events and call
actions out; the model stood in for by its real partitions (echo) or by its outputs
(voice_assistant). Every event emitted is validated by the official `openai` SDK's models."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from models.echo import FRAME, EchoModel
from models.voice_assistant.realtime import VoiceAssistantRealtime
from services.frontend.realtime import events as ev
from services.frontend.realtime.session import (
    Close,
    EndCallInput,
    RealtimeSession,
    ResponseState,
    SendAudio,
    SessionLimits,
    SessionState,
    event_number,
)
from shared.sdk.audio import Resampler, b64_pcm16
from shared.sdk.realtime import ModelEvent, RealtimeMapping, ReplyAudio, ReplyEnded, ReplyStarted, ReplyText
from tests.support.realtime import MANUAL_16K, audio_of, check_event, check_responses, snr_db, tone


class Harness:
    """A session with echo's real mapping; `run_echo` plays the echo model on what was sent."""

    def __init__(self, mapping: RealtimeMapping | None = None, has_text: bool = False) -> None:
        self.s = RealtimeSession(
            "t1", "echo", mapping or EchoModel().realtime_mapping(), SessionLimits(16000, FRAME, 16000 * 60, 5.0, has_text), "tok"
        )
        self.events: list[dict[str, Any]] = []
        self.sent: list[np.ndarray] = []
        self.actions: list[Any] = []
        self.echoed = 0
        self.take(self.s.created())

    def take(self, out: Any) -> list[dict[str, Any]]:
        for e in out.events:
            check_event(e)
        self.events += out.events
        self.actions += out.actions
        self.sent += [a.pcm for a in out.actions if isinstance(a, SendAudio)]
        return list(out.events)

    def send(self, body: dict[str, Any] | str, now: float = 0.0) -> list[dict[str, Any]]:
        raw = body if isinstance(body, str) else json.dumps(body)
        try:
            event = ev.parse_event(raw)
        except ev.ClientError as e:
            return self.take(self.s.refused(e))
        return self.take(self.s.handle(event, now))

    def append(self, pcm: np.ndarray) -> list[dict[str, Any]]:
        return self.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(pcm)})

    def run_echo(self) -> None:
        """echo's Talker output for every whole frame sent so far (frame i = samples of frame i)."""
        stream = np.concatenate(self.sent) if self.sent else np.zeros(0, np.int16)
        while (self.echoed + 1) * FRAME <= len(stream):
            f = stream[self.echoed * FRAME : (self.echoed + 1) * FRAME]
            rms = float(np.sqrt(np.mean(f.astype(np.float64) ** 2)))
            self.take(self.s.on_output({"frame": self.echoed, "audio": b64_pcm16(f), "rms": rms}, 0.0))
            self.echoed += 1

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def test_manual_commit_comes_back_byte_exact_at_the_models_rate() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    clip = tone(0.3, 16000)
    h.append(clip[:1000])
    h.append(clip[1000:])
    assert h.sent == []  # held until the commit
    h.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
    assert sum(len(p) for p in h.sent) % FRAME == 0  # padded to whole items
    h.send({"type": "response.create"})
    h.run_echo()
    resp = [e for e in h.events if e["type"] == "response.done"]
    assert len(resp) == 1 and resp[0]["response"]["status"] == "completed"
    assert audio_of(h.events) == clip.tobytes()
    check_responses(h.events)
    committed = next(e for e in h.events if e["type"] == "input_audio_buffer.committed")
    added = [e for e in h.events if e["type"] == "conversation.item.added"]
    assert added[0]["item"]["id"] == committed["item_id"] and added[0]["item"]["role"] == "user"
    # A commit alone starts nothing (the reply is held); the client's response.create takes it:
    # a second response with its own audio, the padding of the first dropped.
    clip2 = tone(0.1, 16000, hz=880)
    h.append(clip2)
    h.send({"type": "input_audio_buffer.commit"})
    h.run_echo()
    assert len([e for e in h.events if e["type"] == "response.created"]) == 1
    h.send({"type": "response.create"})
    done = [e["response"]["id"] for e in h.events if e["type"] == "response.done"]
    assert len(done) == 2 and audio_of(h.events, done[1]) == clip2.tobytes()
    assert [event_number(e["event_id"]) for e in h.events] == list(range(1, len(h.events) + 1))


def test_24khz_round_trip_keeps_the_audio_within_the_stated_bound() -> None:
    """24 kHz in, resampled to echo's 16 kHz and back: a 440 Hz tone comes back at an SNR
    above 40 dB (soxr HQ both ways), with exactly as many samples as went in."""
    h = Harness()
    h.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    clip = tone(1.0, 24000)
    for i in range(0, len(clip), 480):  # 20 ms appends
        h.append(clip[i : i + 480])
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    h.run_echo()
    got = np.frombuffer(audio_of(h.events), dtype="<i2")
    assert abs(len(got) - len(clip)) <= 2, (len(got), len(clip))
    assert snr_db(clip, got) > 40.0


def rates(input_rate: int, output_rate: int) -> dict[str, Any]:
    """A session.update to these rates (GA shape) with manual commits."""
    audio = {
        "input": {"format": {"type": "audio/pcm", "rate": input_rate}, "turn_detection": None},
        "output": {"format": {"type": "audio/pcm", "rate": output_rate}},
    }
    return {"type": "session.update", "session": {"type": "realtime", "audio": audio}}


@pytest.mark.parametrize(
    ("input_rate", "output_rate"),
    [(8000, 8000), (48000, 48000), (8000, 48000), (48000, 8000), (24000, 16000), (11025, 44100)],
)
def test_any_rate_from_8_to_48_khz_comes_back_at_the_output_rate_within_the_bound(input_rate: int, output_rate: int) -> None:
    """A 440 Hz tone at the input rate, through echo's 16 kHz, comes back at the session's
    output rate: as many samples as a second at that rate (+-2) and an SNR above 50 dB
    against the same tone made at that rate (measured: 63-75 dB)."""
    h = Harness()
    updated = h.send(rates(input_rate, output_rate))[0]
    fmt = updated["session"]["audio"]
    assert RealtimeSession._format(input_rate) == fmt["input"]["format"]
    assert RealtimeSession._format(output_rate) == fmt["output"]["format"]
    assert updated["session"]["native_sample_rate_hz"] == 16000
    clip = tone(1.0, input_rate)
    step = input_rate // 50  # 20 ms appends
    for i in range(0, len(clip), step):
        h.append(clip[i : i + step])
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    assert sum(len(p) for p in h.sent) >= 16000  # what the model got: at its own rate
    h.run_echo()
    done = next(e for e in h.events if e["type"] == "response.done")
    assert done["response"]["status"] == "completed"
    assert done["response"]["audio"]["output"]["format"] == RealtimeSession._format(output_rate)
    got = np.frombuffer(audio_of(h.events), dtype="<i2")
    assert abs(len(got) - output_rate) <= 2, (len(got), output_rate)
    assert snr_db(tone(1.0, output_rate), got) > 50.0
    assert done["response"]["usage"]["audio_out_ms"] == len(got) * 1000 // output_rate
    check_responses(h.events)


def test_the_output_rate_changes_between_responses() -> None:
    """Each response is resampled at the output rate the session had when it began."""
    h = Harness()
    h.send(rates(16000, 16000))
    clip = tone(0.5, 16000)
    h.append(clip)
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    h.run_echo()
    h.send(rates(16000, 48000))
    h.append(clip)
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    h.run_echo()
    first, second = [e["response"]["id"] for e in h.events if e["type"] == "response.done"]
    assert audio_of(h.events, first) == clip.tobytes()  # the model's own rate: untouched
    got = np.frombuffer(audio_of(h.events, second), dtype="<i2")
    assert abs(len(got) - 24000) <= 2 and snr_db(tone(0.5, 48000), got) > 50.0


def test_server_vad_echo_turn_is_its_voiced_frames() -> None:
    h = Harness()  # server_vad is the default
    h.send(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                    "output": {"format": {"type": "audio/pcm", "rate": 16000}},
                },
            },
        }
    )
    quiet = np.zeros(FRAME * 3, np.int16)
    voiced = tone(FRAME * 5 / 16000, 16000)
    h.append(np.concatenate([quiet, voiced, np.zeros(FRAME * 8, np.int16)]))
    h.run_echo()
    kinds = h.types()
    i = kinds.index("input_audio_buffer.speech_started")
    assert kinds[i:].index("input_audio_buffer.speech_stopped") < kinds[i:].index("response.created")
    started = h.events[i]
    assert started["audio_start_ms"] == 240
    assert audio_of(h.events) == voiced.tobytes()
    check_responses(h.events)
    # A commit with server VAD on is refused; the session goes on.
    err = h.send({"type": "input_audio_buffer.commit", "event_id": "x"})
    assert err[0]["type"] == "error" and err[0]["error"]["event_id"] == "x"


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_event", None),
        ('{"type": "no.such.event", "event_id": "e1"}', "unknown_event", "type"),
        ('{"type": "input_audio_buffer.append", "audio": 5, "event_id": "e2"}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "@@@", "event_id": "e3"}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "AA=="}', "invalid_value", "audio"),
        (
            '{"type": "session.update", "session": {"type": "realtime", "instructions": 3}}',
            "invalid_value",
            "session.instructions",
        ),
        (
            '{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 4000}}}}}',
            "invalid_value",
            "session.audio.input.format.rate",
        ),
        ('{"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": "5"}', "invalid_value", "audio_end_ms"),
    ],
)
def test_bad_input_gets_an_error_with_a_code_and_the_session_goes_on(raw: str, code: str, param: str | None) -> None:
    h = Harness()
    out = h.send(raw)
    assert [e["type"] for e in out] == ["error"]
    err = out[0]["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    sent_id = json.loads(raw).get("event_id") if raw.startswith('{"') else None
    assert err["event_id"] == sent_id
    assert h.s.state is SessionState.ACTIVE
    assert h.send({"type": "session.heartbeat"})[0]["type"] == "session.heartbeat"


def test_unknown_fields_are_ignored_and_append_extras_accepted() -> None:
    h = Harness()
    out = h.send({"type": "session.update", "session": {"type": "realtime", "voice": "alloy", "tools": [], "whatever": 1}})
    assert out[0]["type"] == "session.updated"
    extras = {"duration_ms": 20, "audio_end_ms": 40, "format": "pcm16", "sample_rate_hz": 24000}
    assert h.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(0.02, 24000)), **extras}) == []


def test_flat_beta_session_update() -> None:
    h = Harness()
    out = h.send(
        {
            "type": "session.update",
            "session": {
                "input_audio_format": "pcm16",
                "turn_detection": None,
                "sample_rate_hz": 16000,
                "modalities": ["audio", "text"],
            },
        }
    )
    s = out[0]["session"]
    assert (h.s.input_rate, h.s.output_rate, h.s.server_vad) == (16000, 16000, False)
    assert s["audio"]["input"]["turn_detection"] is None and s["audio"]["input"]["format"]["sample_rate_hz"] == 16000
    h.append(tone(0.1, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    assert "conversation.item.created" in h.types()  # beta clients wait for it
    bad = h.send({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}})
    assert bad[0]["error"]["param"] == "session.input_audio_format"


def test_response_cancel_ends_the_response_once_and_drops_the_rest() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.5, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    stream = np.concatenate(h.sent)
    h.sent = [stream[: FRAME * 2]]
    h.run_echo()  # two frames back: the response is speaking
    rid = next(e["response"]["id"] for e in h.events if e["type"] == "response.created")
    h.send({"type": "response.cancel", "response_id": rid})
    h.sent = [stream]
    h.run_echo()
    done = [e for e in h.events if e["type"] == "response.done"]
    assert len(done) == 1 and done[0]["response"]["status"] == "cancelled"
    assert done[0]["response"]["status_details"]["reason"] == "client_cancelled"
    assert len(audio_of(h.events)) == 2 * FRAME * 2
    err = h.send({"type": "response.cancel", "event_id": "again"})
    # OpenAI's code and words: LiveKit's plugin stays quiet for this message only.
    assert err[0]["error"]["code"] == "response_cancel_not_active"
    assert err[0]["error"]["message"] == "Cancellation failed: no active response found"


def test_manual_turns_wait_for_response_create_and_a_reply_that_came_first_is_held() -> None:
    """turn_detection null: the client decides. A commit alone starts no response; a quick
    model's reply that is complete before the client's response.create is held and is that
    request's response, audio and all."""
    h = Harness()
    h.send(MANUAL_16K)
    for clip in (tone(0.16, 16000), tone(0.12, 16000, hz=660)):
        h.append(clip)
        h.send({"type": "input_audio_buffer.commit"})
        h.run_echo()  # the whole reply, before the request
        assert "response.created" not in h.types()[-3:] and h.s.response is None
        created = h.send({"type": "response.create", "response": {"metadata": {"client_event_id": "c"}}})
        assert created[0]["type"] == "response.created" and created[0]["response"]["metadata"] == {"client_event_id": "c"}
        done = created[-1]
        assert done["type"] == "response.done" and done["response"]["status"] == "completed"
        assert done["response"]["metadata"] == {"client_event_id": "c"}
        assert audio_of(h.events, done["response"]["id"]) == clip.tobytes()
    assert h.types().count("response.done") == 2
    # Nothing unanswered: the models take no prompt of their own, so the response is empty, at once.
    empty = h.send({"type": "response.create"}, now=100.0)
    assert empty[0]["type"] == "response.created" and empty[-1]["response"]["status"] == "completed"
    assert h.s.response is None
    check_responses(h.events)


def test_a_requested_response_with_no_reply_ends_incomplete() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.2, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"}, now=0.0)
    assert h.s.response is not None and h.s.response.state is ResponseState.WAITING
    # One is in progress: a second is refused as OpenAI refuses it (clients handle the race).
    err = h.send({"type": "response.create", "event_id": "again"}, now=1.0)
    assert [e["type"] for e in err] == ["error"]
    assert (err[0]["error"]["code"], err[0]["error"]["event_id"]) == ("conversation_already_has_active_response", "again")
    assert h.s.response.id in err[0]["error"]["message"]
    assert h.take(h.s.tick(4.9)) == []
    out = h.take(h.s.tick(5.0))
    assert out[-1]["type"] == "response.done" and out[-1]["response"]["status"] == "incomplete"
    check_responses(h.events)


def test_session_close_ends_input_then_closes_after_the_call() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.2, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    h.send({"type": "session.close"})
    assert isinstance(h.actions[-1], EndCallInput)
    err = h.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(0.1, 16000)), "event_id": "late"})
    assert err[0]["error"]["code"] == "session_closed" and err[0]["error"]["event_id"] == "late"
    h.take(h.s.call_ended(200, "completed"))
    # mypy keeps h.actions[-1] narrowed to EndCallInput by the assert above across the calls that append to it.
    assert h.types()[-1] == "session.closed" and h.actions[-1] == Close(1000, "session closed")  # type: ignore[comparison-overlap]
    check_responses(h.events)


def test_a_failed_call_fails_its_response_and_closes() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.2, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    out = h.take(h.s.call_ended(503, "the frontend is stopping"))
    kinds = [e["type"] for e in out]
    assert kinds[-2:] == ["response.done", "error"] and out[-1]["error"]["code"] == "server_busy"
    assert out[-2]["response"]["status"] == "failed"
    assert h.actions[-1] == Close(1013, "try again later")
    check_responses(h.events)
    with pytest.raises(RuntimeError, match="closed -> closing"):
        h.s._move(SessionState.CLOSING)


def test_truncate_is_clamped_to_the_audio_sent() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.16, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    h.run_echo()
    item = next(e["item"]["id"] for e in h.events if e["type"] == "response.output_item.added")
    out = h.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 99999})
    assert out[0]["type"] == "conversation.item.truncated" and out[0]["audio_end_ms"] == 160
    bad = h.send({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 1})
    assert (bad[0]["error"]["code"], bad[0]["error"]["param"]) == ("item_truncate_invalid_item_id", "item_id")


def test_audio_item_is_one_turn_and_text_needs_a_text_stream() -> None:
    h = Harness()
    clip = tone(0.2, 24000)
    h.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": b64_pcm16(clip)}]},
        }
    )
    assert "conversation.item.added" in h.types() and sum(len(p) for p in h.sent) % FRAME == 0
    err = h.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        }
    )
    assert err[0]["error"]["code"] == "invalid_value"
    playback = h.send({"type": "playback.ack", "response_id": "r", "played_ms": 120})
    assert playback[0]["type"] == "playback.acknowledged" and playback[0]["played_ms"] == 120


class TextReplies(RealtimeMapping):
    """A hand-made mapping of a model that answers in text (neither served model does):
    `{"reply": "start" | "end"}`, `{"text": delta}`, `{"audio": b64, "words": ...}`."""

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        if output.get("reply") == "start":
            return [ReplyStarted()]
        if output.get("reply") == "end":
            return [ReplyEnded()]
        if "text" in output:
            return [ReplyText(output["text"])]
        pcm = np.frombuffer(base64.b64decode(output["audio"]), dtype="<i2")
        return [ReplyAudio(pcm, 16000, output.get("words", ""))]


def test_a_text_reply_is_output_text_deltas_and_done_as_the_sdk_types_them() -> None:
    from openai.types.realtime import ResponseTextDeltaEvent, ResponseTextDoneEvent

    h = Harness(TextReplies(), has_text=True)
    h.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
    h.send({"type": "conversation.item.create", "item": {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    h.send({"type": "response.create", "event_id": "r1"})
    h.take(h.s.on_output({"reply": "start"}, 0.0))
    h.take(h.s.on_output({"text": "Hello"}, 0.0))
    # Audio of a reply in a text response: its words are text, its samples are not sent.
    h.take(h.s.on_output({"audio": b64_pcm16(tone(0.1, 16000)), "words": ", world"}, 0.0))
    h.take(h.s.on_output({"text": "."}, 0.0))
    h.take(h.s.on_output({"reply": "end"}, 0.0))
    deltas = [ResponseTextDeltaEvent.model_validate(e) for e in h.events if e["type"] == "response.output_text.delta"]
    done = [ResponseTextDoneEvent.model_validate(e) for e in h.events if e["type"] == "response.output_text.done"]
    assert [d.delta for d in deltas] == ["Hello", ", world", "."]
    assert len(done) == 1 and done[0].text == "Hello, world."
    resp = next(e for e in h.events if e["type"] == "response.done")["response"]
    ids = {(d.response_id, d.item_id, d.output_index, d.content_index) for d in deltas}
    ids |= {(d.response_id, d.item_id, d.output_index, d.content_index) for d in done}
    assert ids == {(resp["id"], resp["output"][0]["id"], 0, 0)}
    assert resp["status"] == "completed" and resp["output_modalities"] == ["text"]
    assert resp["output"][0]["content"] == [{"type": "output_text", "text": "Hello, world."}]
    part = next(e for e in h.events if e["type"] == "response.content_part.done")["part"]
    assert part == {"type": "text", "text": "Hello, world."}
    kinds = h.types()
    assert not any(k.startswith("response.output_audio") for k in kinds)
    assert kinds.index("response.output_text.done") < kinds.index("response.content_part.done") < kinds.index("response.done")
    check_responses(h.events)


def test_a_text_response_that_is_cancelled_still_ends_its_text() -> None:
    from openai.types.realtime import ResponseTextDoneEvent

    h = Harness(TextReplies(), has_text=True)
    h.send({"type": "conversation.item.create", "item": {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    h.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
    h.take(h.s.on_output({"reply": "start"}, 0.0))
    h.take(h.s.on_output({"text": "Partial"}, 0.0))
    h.send({"type": "response.cancel"})
    h.take(h.s.on_output({"text": " dropped"}, 0.0))
    done = [ResponseTextDoneEvent.model_validate(e) for e in h.events if e["type"] == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == "Partial"
    resp = next(e for e in h.events if e["type"] == "response.done")["response"]
    assert resp["status"] == "cancelled" and resp["status_details"]["reason"] == "client_cancelled"
    check_responses(h.events)


def test_voice_assistant_mapping_turn_transcript_reply_and_barge_in() -> None:
    h = Harness(VoiceAssistantRealtime())
    h.send(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"transcription": {"model": "pocketsphinx"}}}},
        }
    )
    audio = b64_pcm16(tone(0.08, 22050))
    outputs = [
        {"type": "listen", "turn": 1, "at": 0.5},
        {"type": "transcript", "turn": 1, "text": "what", "final": False},
        {"type": "transcript", "turn": 1, "text": "what time", "final": False},
        {"type": "speak", "turn": 1, "at": 1.8, "speech_s": 1.3, "reason": "silence"},
        {"type": "transcript", "turn": 1, "text": "what time is it", "final": True},
        {"type": "reply", "turn": 1, "text": "You said: what time is it."},
        {"type": "audio", "turn": 1, "chunk": 0, "audio": audio, "sample_rate": 22050, "text": "You said: what time is it."},
        {"type": "audio", "turn": 1, "chunk": 1, "audio": audio, "sample_rate": 22050, "text": "You said: what time is it."},
        {"type": "reply_end", "turn": 1, "audio_s": 0.16},
        {"type": "listen", "turn": 2, "at": 3.0},
        {"type": "reply", "turn": 1, "text": "x"},
        {"type": "audio", "turn": 1, "chunk": 0, "audio": audio, "sample_rate": 22050, "text": "x"},
        {"type": "barge_in", "turn": 1, "by_turn": 3, "sent_s": 0.08, "played_s": 0.05},
    ]
    for o in outputs:
        h.take(h.s.on_output(o, 0.0))
    kinds = h.types()
    assert kinds.count("input_audio_buffer.speech_started") == 2 and kinds.count("input_audio_buffer.committed") == 1
    deltas = [e["delta"] for e in h.events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas == ["what", " time"]
    done = next(e for e in h.events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["transcript"] == "what time is it"
    transcript = next(e for e in h.events if e["type"] == "response.output_audio_transcript.done")
    assert transcript["transcript"] == "You said: what time is it."
    statuses = [e["response"]["status"] for e in h.events if e["type"] == "response.done"]
    assert statuses == ["completed", "cancelled"]
    cut = [e for e in h.events if e["type"] == "conversation.item.truncated"]
    assert cut and cut[0]["audio_end_ms"] == 50
    # 22.05 kHz reply audio reaches a 24 kHz client resampled: 2 chunks of 80 ms -> 160 ms at 24 kHz.
    first = next(e["response"]["id"] for e in h.events if e["type"] == "response.done")
    assert abs(len(audio_of(h.events, first)) // 2 - 3840) <= 2
    check_responses(h.events)


def test_manual_buffer_is_bounded_by_the_calls_limit() -> None:
    h = Harness()
    h.s.limits.max_samples = 16000
    h.send(MANUAL_16K)
    assert h.append(tone(0.9, 16000)) == []
    err = h.append(tone(0.2, 16000))
    assert err[0]["error"]["code"] == "input_audio_buffer_full"
    h.send({"type": "input_audio_buffer.clear"})
    assert h.s.buffered == 0 and h.types()[-1] == "input_audio_buffer.cleared"


def test_resampler_passes_the_native_rate_through_untouched() -> None:
    x = tone(0.1, 16000)
    r = Resampler(16000, 16000)
    assert r.push(x) is x and len(r.flush()) == 0
    r24 = Resampler(24000, 16000)
    total = len(r24.push(tone(0.5, 24000))) + len(r24.flush())
    assert total == 8000
    assert base64.b64decode(b64_pcm16(x)) == x.tobytes()
