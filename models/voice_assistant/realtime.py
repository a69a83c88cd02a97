"""`voice_assistant` over `/v1/realtime`: its client events as realtime happenings.

- `listen` / `speak` (the Listener's turns) -> the caller started / stopped speaking
  (`input_audio_buffer.speech_started` / `speech_stopped` + `committed` under server VAD).
- `transcript` (the Recognizer, partial and final) -> input transcription events.
- `reply`, `audio`, `reply_end` (the Talker) -> one response, its audio and, piece by
  piece, the words it speaks as the audio transcript.
- `barge_in` -> the response is cut (cancelled, with the truncation point).

With manual commits the frontend sends a committed buffer and then `commit_padding_s` of
silence, longer than the Listener's `min_silence_s` (0.5 s), so each commit ends a turn.
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
    pcm16_from_b64,
)


class VoiceAssistantRealtime(RealtimeMapping):
    commit_padding_s = 1.0

    def __init__(self) -> None:
        self.piece = ""  # the reply piece the last audio chunk spoke

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        kind = output.get("type")
        if kind == "listen":
            return [SpeechStarted(float(output["at"]))]
        if kind == "speak":
            return [SpeechStopped(float(output["at"]))]
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
