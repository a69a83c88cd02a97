"""The realtime adapter's pure core, continued: what agent frameworks rely on (item retrieve
and delete, response metadata, OpenAI's error codes and words) and turn-taking that follows
the session (server VAD's settings through the model's mapping, create_response,
interrupt_response, manual turns, semantic_vad, idle_timeout_ms). No NATS; every event
emitted is validated by the official `openai` SDK's models (tests/test_realtime_pure.py's
Harness)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from duplexbus.sdk import b64_pcm16
from models.echo import FRAME
from models.voice_assistant.realtime import VoiceAssistantRealtime
from services.frontend.realtime import events as ev
from services.frontend.realtime.session import TurnLatency
from shared.sdk.realtime import ModelEvent, RealtimeMapping, ReplyAudio, ReplyEnded, ReplyStarted, SpeechStarted
from tests.support.realtime import MANUAL_16K, audio_of, check_responses, tone
from tests.test_realtime_pure import Harness


def vad(**settings: Any) -> dict[str, Any]:
    """A session.update to 16 kHz both ways with server_vad (or semantic_vad) and these settings."""
    fmt = {"type": "audio/pcm", "rate": 16000}
    td = {"type": "server_vad", **settings}
    return {
        "type": "session.update",
        "session": {"type": "realtime", "audio": {"input": {"format": fmt, "turn_detection": td}, "output": {"format": fmt}}},
    }


def frames(*parts: tuple[float, int]) -> np.ndarray:
    """(amplitude, frames) pieces of a 440 Hz tone, 80 ms frames at 16 kHz (0: silence)."""
    return np.concatenate([tone(n * FRAME / 16000, 16000, amp=a) if a else np.zeros(n * FRAME, np.int16) for a, n in parts])


def speak(h: Harness, pcm: np.ndarray) -> None:
    h.append(pcm)
    h.run_echo()


def test_retrieve_and_delete_items_as_the_agents_sdk_and_livekit_do() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.2, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    user = next(e["item_id"] for e in h.events if e["type"] == "input_audio_buffer.committed")
    h.send({"type": "response.create"})
    h.run_echo()
    assistant = next(e["item"]["id"] for e in h.events if e["type"] == "response.output_item.added")
    got = h.send({"type": "conversation.item.retrieve", "item_id": assistant, "event_id": "r1"})
    assert got[0]["type"] == "conversation.item.retrieved"
    assert got[0]["item"]["role"] == "assistant" and got[0]["item"]["status"] == "completed"
    assert h.send({"type": "conversation.item.retrieve", "item_id": user})[0]["item"]["role"] == "user"
    # Deleted (LiveKit's chat-context sync, and its truncate at 0 ms): gone for a retrieve too.
    deleted = h.send({"type": "conversation.item.delete", "item_id": assistant, "event_id": "d1"})
    assert deleted == [{"event_id": deleted[0]["event_id"], "type": "conversation.item.deleted", "item_id": assistant}]
    assert h.s.last_item == user
    again = h.send({"type": "conversation.item.delete", "item_id": assistant, "event_id": "d2"})
    assert (again[0]["error"]["code"], again[0]["error"]["event_id"]) == ("item_delete_invalid_item_id", "d2")
    gone = h.send({"type": "conversation.item.retrieve", "item_id": assistant})
    assert gone[0]["error"]["code"] == "item_retrieve_invalid_item_id"
    # A created item with an id the conversation has: LiveKit takes this code as "already there".
    dup = h.send({"type": "conversation.item.create", "item": {"id": user, "role": "system", "content": []}})
    assert dup[0]["error"]["code"] == "item_create_duplicate_item_id"
    bad = h.send({"type": "conversation.item.delete"})
    assert (bad[0]["error"]["code"], bad[0]["error"]["param"]) == ("invalid_value", "item_id")


def test_a_final_transcript_is_in_the_retrieved_item() -> None:
    h = Harness(VoiceAssistantRealtime())
    for o in (
        {"type": "listen", "turn": 1, "at": 0.5},
        {"type": "speak", "turn": 1, "at": 1.8, "speech_s": 1.3, "reason": "silence"},
        {"type": "transcript", "turn": 1, "text": "what time is it", "final": True},
    ):
        h.take(h.s.on_output(o, 0.0))
    item = next(e["item_id"] for e in h.events if e["type"] == "input_audio_buffer.committed")
    got = h.send({"type": "conversation.item.retrieve", "item_id": item})[0]["item"]
    assert got["content"] == [{"type": "input_audio", "transcript": "what time is it"}]


def test_commits_follow_openais_rules_and_words() -> None:
    h = Harness()  # server VAD: the buffer streams to the model, which commits turns itself
    err = h.send({"type": "input_audio_buffer.commit", "event_id": "c0"})[0]["error"]
    assert (err["code"], err["event_id"]) == ("input_audio_buffer_commit_empty", "c0")
    assert err["message"].startswith("Error committing input audio buffer: buffer too small. Expected at least 100ms")
    h.send(MANUAL_16K)
    h.append(tone(0.02, 16000))
    short = h.send({"type": "input_audio_buffer.commit"})[0]["error"]
    assert short["code"] == "input_audio_buffer_commit_empty" and "only has 20.00ms" in short["message"]
    assert h.s.buffered == 320 and h.sent == []  # kept: more may come
    h.append(tone(0.08, 16000))
    assert h.send({"type": "input_audio_buffer.commit"})[0]["type"] == "input_audio_buffer.committed"


def test_turn_detection_null_starts_nothing_until_response_create() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    clip = tone(0.3, 16000)
    h.append(clip)
    h.send({"type": "input_audio_buffer.commit"})
    h.run_echo()
    assert "response.created" not in h.types()
    done = h.send({"type": "response.create"})[-1]
    assert done["type"] == "response.done" and audio_of(h.events, done["response"]["id"]) == clip.tobytes()
    # The request may also come first: the reply fills it when it begins.
    h.append(clip)
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create", "response": {"metadata": {"client_event_id": "x"}}})
    h.run_echo()
    last = [e for e in h.events if e["type"] == "response.done"][-1]["response"]
    assert last["metadata"] == {"client_event_id": "x"} and audio_of(h.events, last["id"]) == clip.tobytes()
    check_responses(h.events)


def test_create_response_false_holds_the_turns_reply_for_the_clients_request() -> None:
    h = Harness()
    h.send(vad(create_response=False))
    voiced = frames((8000, 4))
    speak(h, np.concatenate([frames((0, 2)), voiced, frames((0, 8))]))
    kinds = h.types()
    assert "input_audio_buffer.speech_stopped" in kinds and "input_audio_buffer.committed" in kinds
    assert "response.created" not in kinds
    out = h.send({"type": "response.create", "response": {"metadata": {"client_event_id": "lk"}}})
    assert out[0]["response"]["metadata"] == {"client_event_id": "lk"}
    assert out[-1]["type"] == "response.done" and audio_of(h.events, out[-1]["response"]["id"]) == voiced.tobytes()
    # One response per request: the next request, with nothing unanswered, is an empty one.
    assert audio_of(h.events, h.send({"type": "response.create"})[-1]["response"]["id"]) == b""
    check_responses(h.events)


def test_server_vad_settings_reach_echos_turn_taking() -> None:
    h = Harness()
    updated = h.send(vad(threshold=0.9, silence_duration_ms=160, prefix_padding_ms=160))[0]
    td = updated["session"]["audio"]["input"]["turn_detection"]
    assert (td["threshold"], td["silence_duration_ms"], td["prefix_padding_ms"]) == (0.9, 160, 160)
    assert "unsupported" not in td and td["create_response"] and td["interrupt_response"]
    # threshold 0.9 is -16 dBFS: a tone of RMS -21 dBFS (amplitude 4000) is not speech.
    speak(h, frames((0, 2), (4000, 4), (0, 4)))
    assert "input_audio_buffer.speech_started" not in h.types()
    h.send(vad(threshold=0.5, silence_duration_ms=160, prefix_padding_ms=160))
    quiet_then_voiced = frames((100, 3), (8000, 4))
    speak(h, np.concatenate([quiet_then_voiced, frames((0, 2))]))  # 2 quiet frames (160 ms) end it
    started = next(e for e in h.events if e["type"] == "input_audio_buffer.speech_started")
    # 10 frames before it (the first, unheard turn), 3 quiet, then voiced: the start is 2 frames early.
    assert started["audio_start_ms"] == (10 + 1) * 80
    done = next(e for e in h.events if e["type"] == "response.done")
    assert audio_of(h.events, done["response"]["id"]) == quiet_then_voiced[FRAME:].tobytes()
    # A later update without a setting puts echo's default back (the object is replaced whole).
    td = h.send(vad())[0]["session"]["audio"]["input"]["turn_detection"]
    assert (td["threshold"], td["silence_duration_ms"], td["prefix_padding_ms"]) == (0.5, 480, 0)


def test_a_model_that_cannot_honour_a_setting_says_so() -> None:
    h = Harness(VoiceAssistantRealtime())
    td = h.send(vad(threshold=0.5, silence_duration_ms=500, prefix_padding_ms=300))[0]["session"]["audio"]["input"][
        "turn_detection"
    ]
    assert "unsupported" not in td  # OpenAI's defaults are its Listener's own
    td = h.send(vad(threshold=0.8, silence_duration_ms=900, interrupt_response=False))[0]["session"]["audio"]["input"][
        "turn_detection"
    ]
    assert set(td["unsupported"]) == {"threshold", "silence_duration_ms", "interrupt_response"}
    assert td["threshold"] == 0.5 and td["silence_duration_ms"] == 500 and "silero" in td["detector"]


def test_semantic_vad_is_served_by_the_models_own_detector() -> None:
    h = Harness()
    update = vad()
    update["session"]["audio"]["input"]["turn_detection"] = {"type": "semantic_vad", "eagerness": "low"}
    td = h.send(update)[0]["session"]["audio"]["input"]["turn_detection"]
    assert td["type"] == "semantic_vad" and td["eagerness"] == "low" and "energy" in td["detector"]
    assert set(td["unsupported"]) == {"eagerness"}
    assert h.s.server_vad
    speak(h, frames((0, 2), (8000, 4), (0, 8)))
    assert h.types().count("response.done") == 1


class NoBargeIn(RealtimeMapping):
    """A model that goes on talking over the caller (no ReplyCut of its own)."""

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        kind = output["kind"]
        if kind == "speech":
            return [SpeechStarted(1.0)]
        if kind == "start":
            return [ReplyStarted()]
        if kind == "end":
            return [ReplyEnded()]
        return [ReplyAudio(tone(0.08, 16000), 16000)]


@pytest.mark.parametrize("interrupt", [True, False])
def test_interrupt_response_cuts_a_reply_the_caller_talks_over_or_not(interrupt: bool) -> None:
    h = Harness(NoBargeIn())
    h.send(vad(interrupt_response=interrupt))
    for kind in ("start", "audio", "speech", "audio", "end"):
        h.take(h.s.on_output({"kind": kind}, 0.0))
    done = next(e for e in h.events if e["type"] == "response.done")["response"]
    if interrupt:
        assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
        assert len(audio_of(h.events)) == 2 * 1280  # the audio after the caller spoke is dropped
    else:
        assert done["status"] == "completed" and len(audio_of(h.events)) == 2 * 2 * 1280
    check_responses(h.events)


def test_idle_timeout_commits_the_silence_and_answers_it() -> None:
    h = Harness()
    h.send(vad(idle_timeout_ms=2000), now=10.0)
    assert h.take(h.s.tick(11.9)) == []
    speak(h, frames((0, 5)))  # 400 ms of silence streamed: no speech
    out = h.take(h.s.tick(12.0))
    kinds = [e["type"] for e in out]
    assert kinds[:2] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed"]
    assert out[0]["audio_start_ms"] == 0 and out[0]["audio_end_ms"] == 400 and out[1]["item_id"] == out[0]["item_id"]
    assert kinds[-1] == "response.done" and out[-1]["response"]["status"] == "completed"
    # Armed again after the (empty) response; speech holds it off.
    assert h.take(h.s.tick(13.9)) == [] and h.take(h.s.tick(14.0))[0]["type"] == "input_audio_buffer.timeout_triggered"
    h.append(frames((8000, 2)))
    h.run_echo()
    assert h.s.speech_item is not None and h.take(h.s.tick(100.0)) == []
    check_responses(h.events)


def test_output_audio_buffer_clear_is_answered_and_pipecats_interruption_sequence_works() -> None:
    """Pipecat on a barge-in: output_audio_buffer.clear, response.cancel, then a truncate of
    the assistant item at the audio it played."""
    h = Harness()
    assert h.send({"type": "output_audio_buffer.clear"}) == []  # no response yet: nothing to name
    h.send(MANUAL_16K)
    h.append(tone(0.5, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    stream = np.concatenate(h.sent)
    h.sent = [stream[: FRAME * 3]]
    h.run_echo()
    r = h.s.response
    assert r is not None
    cleared = h.send({"type": "output_audio_buffer.clear"})
    assert cleared[0]["type"] == "output_audio_buffer.cleared" and cleared[0]["response_id"] == r.id
    assert h.send({"type": "response.cancel"})[-1]["response"]["status"] == "cancelled"
    # After the response (the cancel may come too late): cleared names the last one.
    assert h.send({"type": "output_audio_buffer.clear"})[0]["response_id"] == r.id
    cut = h.send({"type": "conversation.item.truncate", "item_id": r.item_id, "content_index": 0, "audio_end_ms": 120})
    assert cut[0]["type"] == "conversation.item.truncated" and cut[0]["audio_end_ms"] == 120
    check_responses(h.events)


@pytest.mark.parametrize(
    ("turn_detection", "param"),
    [
        ({"type": "server_vad", "threshold": 1.5}, "threshold"),
        ({"type": "server_vad", "silence_duration_ms": -1}, "silence_duration_ms"),
        ({"type": "server_vad", "create_response": "yes"}, "create_response"),
        ({"type": "semantic_vad", "eagerness": "eager"}, "eagerness"),
        ({"type": "near_field"}, "type"),
    ],
)
def test_bad_turn_detection_settings_are_invalid_value(turn_detection: dict[str, Any], param: str) -> None:
    update = vad()
    update["session"]["audio"]["input"]["turn_detection"] = turn_detection
    with pytest.raises(ev.ClientError) as e:
        ev.parse_event(json.dumps(update))
    assert e.value.code == "invalid_value" and e.value.param == f"session.audio.input.turn_detection.{param}"


def test_each_reply_says_its_turns_latency_in_its_usage() -> None:
    """response.done's usage.latency_ms (duplexbus's own field; the openai SDK's models take
    it): end of speech to the turn decided (the Listener's `at - end_at`), the decision to the
    final transcript, end of speech to the reply's first audio, on the session's clock. A
    reply with no new turn decided before it has none."""
    h = Harness(VoiceAssistantRealtime())
    chunk = {"type": "audio", "turn": 1, "chunk": 0, "audio": b64_pcm16(np.full(1764, 100, np.int16)), "sample_rate": 22050}
    turns: list[TurnLatency] = []
    for o, now in (
        ({"type": "listen", "turn": 1, "at": 0.5}, 9.0),
        ({"type": "speak", "turn": 1, "at": 1.8, "speech_s": 0.76, "end_at": 1.26, "reason": "silence"}, 10.0),
        ({"type": "transcript", "turn": 1, "text": "what time is it", "final": True}, 10.12),
        ({"type": "reply", "turn": 1, "text": "it is noon"}, 10.2),
        ({**chunk, "text": "it is noon"}, 10.31),
        ({**chunk, "chunk": 1, "text": "it is noon"}, 10.4),
        ({"type": "reply_end", "turn": 1, "audio_s": 0.16}, 11.0),
    ):
        out = h.s.on_output(o, now)
        turns += out.turns  # what the frontend's histograms take
        h.take(out)
    done = [e for e in h.events if e["type"] == "response.done"]
    figures = {"end_of_turn": 540, "transcript": 120, "first_audio": 850}
    assert [d["response"]["usage"]["latency_ms"] for d in done] == [figures]
    assert [t.figures_ms() for t in turns] == [figures]
    for o in ({"type": "reply", "turn": 1, "text": "again"}, {**chunk, "text": "again"}, {"type": "reply_end", "turn": 1}):
        h.take(h.s.on_output(o, 12.0))
    done = [e for e in h.events if e["type"] == "response.done"]
    assert len(done) == 2 and "latency_ms" not in done[-1]["response"]["usage"]
