"""How a model's outputs become OpenAI Realtime events: an optional declaration per model.

The frontend's `/v1/realtime` endpoint (services/frontend/realtime) runs one live call per
session and knows nothing of any model's outputs. A model that can be served there returns
a fresh `RealtimeMapping` from `Model.realtime_mapping()` for each session; the mapping
turns the model's own output events into the few things a realtime session is made of
(`ModelEvent`): the caller started or stopped speaking, a transcript of what they said, a
reply (started, audio, text, ended, or cut by a barge-in). No I/O here: a mapping is a pure
object, fed one output at a time, in order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class SpeechStarted:
    """The caller started speaking, `at_s` seconds into the call's audio (server VAD)."""

    at_s: float


@dataclass(frozen=True)
class SpeechStopped:
    """The caller's turn ended at `at_s`; the model takes it as committed input (server VAD).
    `speech_end_s`, where the model knows it: where the speech itself ended, before the
    silence that decided the turn (`at_s - speech_end_s`: the end of turn's own delay, which
    the session reports in each response's usage, `latency_ms`)."""

    at_s: float
    speech_end_s: float | None = None


@dataclass(frozen=True)
class InputTranscript:
    """What the caller said in the current turn: a partial hypothesis, or the final one."""

    text: str
    final: bool


@dataclass(frozen=True)
class ReplyStarted:
    """The model starts a reply (one realtime response)."""


@dataclass(frozen=True)
class ReplyAudio:
    """A piece of the reply's audio (PCM16 mono at `rate`), with the words it speaks, if any new."""

    pcm: np.ndarray = field(repr=False)
    rate: int
    transcript: str = ""


@dataclass(frozen=True)
class ReplyText:
    """Text of the reply (a model that answers in text)."""

    delta: str


@dataclass(frozen=True)
class ReplyEnded:
    """The reply is complete."""


@dataclass(frozen=True)
class ReplyCut:
    """The caller talked over the reply (barge-in); the client had played `played_s` of it."""

    played_s: float


@dataclass(frozen=True)
class TurnSettings:
    """The session's turn detection settings, as the client set them (`server_vad` or
    `semantic_vad`; None: not given, the model's own value applies). OpenAI's meanings:
    `threshold` 0.0 to 1.0 (higher: louder speech needed), `prefix_padding_ms` of audio kept
    before the detected start, `silence_duration_ms` of silence that ends a turn."""

    semantic: bool = False
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    eagerness: str | None = None  # semantic_vad: low, medium, high or auto

    def given(self) -> dict[str, object]:
        """The settings the client gave, by their OpenAI names."""
        names = ("threshold", "prefix_padding_ms", "silence_duration_ms", "eagerness")
        return {k: v for k in names if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class TurnTaking:
    """What the model's turn-taking runs with once a mapping has applied `TurnSettings`: the
    values in effect (reported in `session.updated`; None: the model has no such setting),
    and each setting the client gave that the model cannot honour, with why."""

    detector: str  # what decides turns, in words
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    unsupported: dict[str, str] = field(default_factory=dict)


ModelEvent = SpeechStarted | SpeechStopped | InputTranscript | ReplyStarted | ReplyAudio | ReplyText | ReplyEnded | ReplyCut


class RealtimeMapping(ABC):
    """One session's view of the model's outputs (a fresh object per session, no I/O).

    The session runs in one of two modes, told by `set_server_vad`:
    - server VAD (`turn_detection: server_vad`): audio streams into the call as it comes
      and the model's own turn-taking decides turns and replies.
    - manual (`turn_detection: null`): the client commits its buffer; the frontend sends each
      committed buffer to the call as one piece, followed by zeros up to a whole model item
      and `commit_padding_s` of silence, and tells the mapping which samples of the call's
      audio it covered (`committed`).
    """

    commit_padding_s: ClassVar[float] = 0.0
    """Silence sent after a manually committed buffer, so the model's turn-taking ends the turn."""

    barges_in: ClassVar[bool] = False
    """True: the model stops its own reply when the caller talks over it, and says so with
    `ReplyCut` (so `interrupt_response: false` cannot be honoured). False: the frontend cuts
    a reply the caller talks over where the session asks for it (`interrupt_response`)."""

    def set_server_vad(self, on: bool) -> None:  # noqa: B027 (optional: most mappings need not know)
        """The session's mode changed (server VAD on or off)."""

    def committed(self, start: int, samples: int) -> None:  # noqa: B027
        """A manual commit: the call's audio samples [start, start + samples) at the model's rate."""

    def set_turn_detection(self, settings: TurnSettings) -> TurnTaking:
        """Apply the session's turn detection settings to the model's turn-taking, as far as
        it can (called on every `session.update` that sets `server_vad` or `semantic_vad`).
        The default applies none: each setting given is reported as not honoured."""
        why = "this model's turn-taking takes no settings"
        return TurnTaking("the model's own", unsupported={k: why for k in settings.given()})

    @abstractmethod
    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        """The realtime meaning of one model output (none: an output with no realtime meaning)."""

    def state(self) -> dict[str, Any]:
        """What the session needs of this mapping to go on in another process: a session whose
        client resumes it on another frontend moves there, where a fresh mapping of the model
        (`Model.realtime_mapping()`) is given this (`restore`). By default the object's
        attributes, which must then be data: None, bool, int, float, str, bytes, lists,
        tuples, dicts, deques, numpy arrays and numbers, and this module's types. A mapping
        that holds anything else gives what it needs here and takes it back in `restore`
        (where it cannot, the session cannot move: a resume on another frontend is refused)."""
        return dict(vars(self))

    def restore(self, state: dict[str, Any]) -> None:
        """Take up where the mapping whose `state()` this is left off."""
        vars(self).update(state)
