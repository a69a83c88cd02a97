"""`voice_assistant` over `/v1/realtime`: its client events as realtime happenings.

- `listen` / `speak` (the Listener's turns) -> the caller started / stopped speaking
  (`input_audio_buffer.speech_started` / `speech_stopped` + `committed` under server VAD).
- `transcript` (the Recognizer, partial and final) -> input transcription events.
- `reply`, `audio`, `reply_end` (the Talker) -> one response, its audio and, piece by
  piece, the words it speaks as the audio transcript.
- `barge_in` -> the response is cut (cancelled, with the truncation point).

With manual commits the frontend sends a committed buffer and then `commit_padding_s` of
silence, longer than the Listener's `min_silence_s` (0.5 s), so each commit ends a turn.

Turn detection settings: the Listener decides turns on a worker, with settings fixed when
the call opens, which is at connect, before any `session.update`. So it runs with its own
(threshold 0.5, 300 ms before the start, 500 ms of silence: OpenAI's server_vad defaults),
and a session that asks for other values is told they are not honoured (`session.updated`).
`semantic_vad` is served by silero-vad, the best detector the model has. Its Talker stops a
reply the caller talks over by itself (`barges_in`), so `interrupt_response: false` is not
honoured either.
"""

from __future__ import annotations

from typing import Any

from duplexbus.sdk import (
    InputTranscript,
    ModelEvent,
    RealtimeMapping,
    ReplyAudio,
    ReplyCut,
    ReplyEnded,
    ReplyStarted,
    SpeechStarted,
    SpeechStopped,
    TurnSettings,
    TurnTaking,
    pcm16_from_b64,
)
from models.voice_assistant.listener import MIN_SILENCE_S, PREROLL_S, THRESHOLD

FIXED = "voice_assistant's Listener decides turns with settings fixed when the call opens (at connect, before any session.update)"


class VoiceAssistantRealtime(RealtimeMapping):
    commit_padding_s = 1.0
    barges_in = True

    def set_turn_detection(self, settings: TurnSettings) -> TurnTaking:
        own = {
            "threshold": THRESHOLD,
            "prefix_padding_ms": round(PREROLL_S * 1000),
            "silence_duration_ms": round(MIN_SILENCE_S * 1000),
        }
        unsupported = {k: f"{FIXED}: it runs with {own[k]}" for k, v in settings.given().items() if k in own and v != own[k]}
        if settings.eagerness is not None:
            unsupported["eagerness"] = "semantic_vad is served by silero-vad (the Listener), which has no eagerness"
        prefix, silence = own["prefix_padding_ms"], own["silence_duration_ms"]
        return TurnTaking("silero-vad (the Listener)", THRESHOLD, int(prefix), int(silence), unsupported)

    def __init__(self) -> None:
        self.piece = ""  # the reply piece the last audio chunk spoke

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        kind = output.get("type")
        if kind == "listen":
            return [SpeechStarted(float(output["at"]))]
        if kind == "speak":
            end = output.get("end_at")
            return [SpeechStopped(float(output["at"]), float(end) if isinstance(end, int | float) else None)]
        if kind == "transcript":
            return [InputTranscript(str(output["text"]), bool(output["final"]))]
        if kind == "reply":
            self.piece = ""
            return [ReplyStarted()]
        if kind == "audio":
            text = str(output.get("text", ""))
            words = ""
            if text != self.piece:
                words = text if not self.piece else " " + text
                self.piece = text
            return [ReplyAudio(pcm16_from_b64(output["audio"]), int(output["sample_rate"]), words)]
        if kind == "reply_end":
            return [ReplyEnded()]
        if kind == "barge_in":
            return [ReplyCut(float(output["played_s"]))]
        return []
