"""`Recognizer`: streaming speech recognition of each turn with pocketsphinx.

Configuration: pocketsphinx's bundled US English model (`pocketsphinx/model/en-us`:
the `en-us` continuous acoustic model, the `en-us.lm.bin` trigram language model and
`cmudict-en-us.dict`), 16 kHz input, pocketsphinx defaults otherwise (live CMN,
fwdtree + fwdflat + bestpath search, no dither, so decoding is deterministic);
logging off. Options for `Decoder(...)` may be passed as `decoder_options`.

One decoder per call: a turn is one utterance (`start_utt`, `process_raw` of each
audio item as it arrives, `end_utt`), so concurrent calls' turns interleave freely.
Decoders are costly to build (~0.5 s, ~90 MB each), so they come from a pool:
`warm_decoders` (1) are built when the partition starts and a background thread fills
the pool up to `pool_size` (8); a call takes one when its first turn begins (building
one, inside that step, only when more than `pool_size` calls hold one), and a
closed call's decoder goes back to the pool (up to `pool_size` kept) with its
cepstral mean reset to the initial one, so a call's result does not depend on which
calls used the decoder before. Live CMN adapts across the turns of one call.

Outputs to the client: `{"type": "transcript", "turn": k, "text": str, "final": bool}`:
partial hypotheses (`final: false`) after each step that fed a turn audio, when the hypothesis changed and is
not empty, and one final one per turn (`final: true`, possibly empty text). The
final transcript goes on edge `transcript` as meta `{"turn": k, "text": str,
"short": bool}`.

pocketsphinx has no batched API: a step loops over the calls in its batch.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexbus.sdk import CallInfo, EdgeItem, Emission, Item, Output, Partition, StepInput

SAMPLE_RATE = 16_000
log = logging.getLogger(__name__)


def new_decoder(**options: Any) -> Any:
    from pocketsphinx import Decoder

    opts: dict[str, Any] = {"loglevel": "FATAL", "samprate": SAMPLE_RATE}
    opts.update(options)
    return Decoder(**opts)


@dataclass
class _CallState:
    decoder: Any = None
    turn: int = 0  # turn of the open utterance (0: none open)
    in_utt: bool = False
    partial: str = ""
    turns: int = 0
    samples: int = 0
    partials: int = 0
    fed: int = 0  # samples of the open turn fed in this step
    audio: list[np.ndarray] = field(default_factory=list)  # the open turn's audio (engines that decode it whole)
    decoded: int = 0  # samples of the open turn covered by the last whole decode
    heard: int = 0  # samples of the open turn so far (engines that decode it whole)
    pause_due: bool = False  # the Listener said the caller paused: decode the turn so far now
    settled: str | None = None  # the text of the turn heard at its last pause (engines that decode it whole)
    since_pause: bool = False  # the turn ended in the silence of that pause: `settled` is its final


@dataclass(frozen=True)
class Later:
    """What `_end` returns for a final the engine decodes with the step's other finals, in one
    batch (`_decode_finals`): the turn's audio, taken at its end."""

    clip: np.ndarray


@dataclass(eq=False)  # found in the call's list by identity (its clip is an array)
class _Final:
    """A final transcript still to be decoded, where its emissions go in the call's list."""

    cid: str
    st: _CallState
    turn: int
    short: bool
    clip: np.ndarray


class TurnRecognizer(Partition):
    """What every recognizer of the voice assistant does with the `speech` edge, whatever
    engine hears it: a turn is the items of one `turn` number, up to its `end` item; each turn
    gets partial transcripts while it goes on (when the hypothesis changed and is not empty)
    and one final pair at its end (the client output and the `transcript` edge item), also
    when decoding fails (the turn then ends empty, and the call's engine state is dropped).

    An engine implements the hooks: `_begin` (a turn starts), `_feed` (its audio), `_hypothesis`
    (the partial text now, or None when none is due), `_end` (the final text, or `Later(clip)`:
    decoded with the step's other finals in one batch by `_decode_finals`) and `_release`
    (the call's engine state goes, at a close or after a fault). An engine whose final costs a
    decode of the whole turn also implements `_decode_pauses`: the turns whose caller paused
    (the Listener's `pause` item), decoded in one batch ahead of the end, so that a turn that
    ends in that pause has its final at once (`settled`, `since_pause`)."""

    # Partial decodes a step may make (None: one for each call with an open turn); the hook
    # `_behind` says which calls' partials are most due.
    partial_budget: int | None = None

    def __init__(self) -> None:
        self._calls: dict[str, _CallState] = {}

    def _behind(self, st: _CallState) -> int:
        """Samples of the open turn its last partial did not hear (the budget's order)."""
        return 0

    # -- engine hooks ----------------------------------------------------------
    @abstractmethod
    def _begin(self, st: _CallState) -> None: ...

    @abstractmethod
    def _feed(self, st: _CallState, pcm: np.ndarray) -> None: ...

    @abstractmethod
    def _hypothesis(self, st: _CallState) -> str | None: ...

    @abstractmethod
    def _end(self, st: _CallState) -> str | Later:
        """The turn's final text, or `Later(clip)` for one decoded with the step's others."""
        ...

    def _decode_finals(self, clips: list[np.ndarray]) -> list[str]:
        """The finals `_end` left for later, in one batch (engines that return `Later`)."""
        raise NotImplementedError(f"{type(self).__name__}._end returned Later without _decode_finals")

    def _decode_pauses(self, paused: list[_CallState]) -> list[str | None]:
        """The text of each paused turn so far, or None where none is decoded (the default:
        an engine that streams has its final at hand anyway)."""
        return [None] * len(paused)

    @abstractmethod
    def _release(self, st: _CallState, reuse: bool) -> None:
        """The call's engine state goes: at its close (`reuse`: it may serve another call) or
        after a fault (its state unknown: thrown away)."""
        ...

    # -- calls ---------------------------------------------------------------
    def open_call(self, call: CallInfo) -> None:
        self._calls[call.cid] = _CallState()

    def close_call(self, cid: str) -> dict[str, Any]:
        st = self._calls.pop(cid, None)
        if st is None:
            return {}
        self._release(st, reuse=True)
        return {"turns": st.turns, "speech_s": round(st.samples / SAMPLE_RATE, 3), "partials": st.partials}

    # -- stepping ------------------------------------------------------------
    def step(self, batch: list[StepInput]) -> list[Emission]:
        """Every call's items first (the turns that end get their finals), then the partials:
        at most `partial_budget` of them, the calls whose last partial heard least first, so a
        step of many calls that each decode their whole turn (Whisper) does not hold up the
        finals of the next one behind a partial decode of each call."""
        mine: dict[str, list[Emission | _Final]] = {}
        open_turns: list[tuple[str, _CallState]] = []
        for s in batch:
            st = self._calls.get(s.cid)
            if st is None:
                continue
            chunk = s.chunks.get("speech")
            emitted = mine.setdefault(s.cid, [])
            try:
                st.fed = 0
                for item in chunk.items if chunk is not None else []:
                    self._item(s.cid, st, item, emitted)
                if st.in_utt and s.inputs_ended:  # the Listener always closes a turn; a safety net
                    self._finish(s.cid, st, short=False, out=emitted)
                elif st.in_utt:
                    open_turns.append((s.cid, st))
            except Exception:  # one call's bad input or decoder fault stays with that call (I-4)
                log.exception("recognizer: call %s: decoding failed; its turn ends empty", s.cid)
                self._reset(s.cid, st, emitted)
        self._decode_later(mine)
        open_turns = self._settle_pauses(open_turns, mine)
        budget = self.partial_budget
        if budget is not None:
            open_turns.sort(key=lambda c: self._behind(c[1]), reverse=True)
        for cid, st in open_turns:
            if budget is not None and budget <= 0:
                break
            try:
                if self._partial(cid, st, mine[cid]) and budget is not None:
                    budget -= 1
            except Exception:
                log.exception("recognizer: call %s: decoding failed; its turn ends empty", cid)
                self._reset(cid, st, mine[cid])
        return [e for emitted in mine.values() for e in emitted if not isinstance(e, _Final)]

    def _decode_later(self, mine: dict[str, list[Emission | _Final]]) -> None:
        """The step's deferred finals decoded in one batch, each put where its turn ended. A
        batch that fails ends each of those turns empty and drops its calls' engine state."""
        later = [e for emitted in mine.values() for e in emitted if isinstance(e, _Final)]
        if not later:
            return
        try:
            texts = self._decode_finals([f.clip for f in later])
        except Exception:
            log.exception("recognizer: decoding %d final transcripts failed; their turns end empty", len(later))
            texts = [""] * len(later)
            for f in later:
                self._release(f.st, reuse=False)
        for f, text in zip(later, texts, strict=True):
            emitted = mine[f.cid]
            at = emitted.index(f)
            emitted[at : at + 1] = self._final_emissions(f.cid, f.turn, text, f.short)

    def _settle_pauses(
        self, open_turns: list[tuple[str, _CallState]], mine: dict[str, list[Emission | _Final]]
    ) -> list[tuple[str, _CallState]]:
        """The paused turns decoded in one batch, each text a partial and the turn's `settled`
        text; the open turns left for this step's partials. A batch that fails leaves them to
        their finals."""
        paused = [(cid, st) for cid, st in open_turns if st.pause_due]
        if not paused:
            return open_turns
        for _, st in paused:
            st.pause_due = False
        try:
            texts = self._decode_pauses([st for _, st in paused])
        except Exception:
            log.exception("recognizer: decoding %d paused turns failed; they wait for their finals", len(paused))
            return open_turns
        for (cid, st), text in zip(paused, texts, strict=True):
            if text is not None:
                st.settled = text
                self._partial_text(cid, st, text, mine[cid])
        decoded = {id(st) for _, st in paused}
        return [(cid, st) for cid, st in open_turns if id(st) not in decoded]

    def _reset(self, cid: str, st: _CallState, out: list[Emission | _Final]) -> None:
        """Throw the call's engine state away and end its open turn empty."""
        self._release(st, reuse=False)
        if st.in_utt:
            self._close(st)
            out.extend(self._final_emissions(cid, st.turn, "", short=False))

    def _item(self, cid: str, st: _CallState, item: Item, out: list[Emission | _Final]) -> None:
        meta = item.meta
        turn = int(meta.get("turn", 0))
        if st.in_utt and turn != st.turn:
            self._finish(cid, st, short=False, out=out)  # a turn whose end never came
        if not st.in_utt:
            if turn <= st.turns and turn != 0:
                return  # an item of a turn already finished
            self._begin(st)
            st.in_utt = True
            st.turn = turn
            st.partial = ""
            st.settled = None
        if item.data is not None and len(item.data):
            pcm = np.asarray(item.data).reshape(-1)
            if pcm.dtype != np.int16:
                pcm = np.clip(pcm, -32768, 32767).astype(np.int16)
            st.samples += len(pcm)
            st.fed += len(pcm)
            self._feed(st, pcm)
        if meta.get("pause"):
            st.pause_due, st.settled = True, None
        if meta.get("end"):
            st.since_pause = bool(meta.get("since_pause"))
            self._finish(cid, st, short=bool(meta.get("short", False)), out=out)

    def _partial(self, cid: str, st: _CallState, out: list[Emission | _Final]) -> bool:
        """The call's partial transcript, where one is due; whether one was decoded."""
        text = self._hypothesis(st)
        if text is None:
            return False
        self._partial_text(cid, st, text, out)
        return True

    @staticmethod
    def _partial_text(cid: str, st: _CallState, text: str, out: list[Emission | _Final]) -> None:
        """A partial transcript to the client, where it changed and is not empty."""
        if text and text != st.partial:
            st.partial = text
            st.partials += 1
            out.append(Output(cid, {"type": "transcript", "turn": st.turn, "text": text, "final": False}))

    def _finish(self, cid: str, st: _CallState, short: bool, out: list[Emission | _Final]) -> None:
        """Close the open turn: its final now, or in the step's batch (`Later`)."""
        text = self._end(st)
        self._close(st)
        if isinstance(text, Later):
            out.append(_Final(cid, st, st.turn, short, text.clip))
        else:
            out.extend(self._final_emissions(cid, st.turn, text, short))

    @staticmethod
    def _close(st: _CallState) -> None:
        st.in_utt = st.pause_due = st.since_pause = False
        st.settled = None
        st.turns = max(st.turns, st.turn)

    @staticmethod
    def _final_emissions(cid: str, turn: int, text: str, short: bool) -> list[Emission]:
        """The final transcript to the client and on the `transcript` edge."""
        return [
            Output(cid, {"type": "transcript", "turn": turn, "text": text, "final": True}),
            EdgeItem(cid, "transcript", Item(None, {"turn": turn, "text": text, "short": short})),
        ]


class Recognizer(TurnRecognizer):
    """pocketsphinx: one streaming decoder per call, from a pool (see the module's docstring)."""

    def __init__(self, pool_size: int = 8, warm_decoders: int = 1, decoder_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.decoder_options = dict(decoder_options or {})
        self.pool_size = max(pool_size, warm_decoders, 1)
        first = new_decoder(**self.decoder_options)
        self.initial_cmn = first.get_cmn(False)
        self._pool: list[Any] = [first]
        self._pool += [new_decoder(**self.decoder_options) for _ in range(warm_decoders - 1)]
        # Fill the rest of the pool off the step path: a fresh worker's first calls then find
        # a decoder ready instead of building one (~0.5 s) inside a step that holds every call.
        # list.append/pop are atomic, so the filler needs no lock against _acquire/_release.
        threading.Thread(target=self._fill_pool, name="decoder-pool", daemon=True).start()

    def _fill_pool(self) -> None:
        while len(self._pool) < self.pool_size:
            try:
                self._pool.append(new_decoder(**self.decoder_options))
            except Exception:
                return

    # -- decoders ------------------------------------------------------------
    def _acquire(self) -> Any:
        return self._pool.pop() if self._pool else new_decoder(**self.decoder_options)

    def _give_back(self, decoder: Any, in_utt: bool) -> None:
        try:
            if in_utt:
                decoder.end_utt()
            decoder.set_cmn(self.initial_cmn)
        except Exception:
            return  # a decoder in a bad state is not reused
        if len(self._pool) < self.pool_size:
            self._pool.append(decoder)

    # -- the hooks -------------------------------------------------------------
    def _begin(self, st: _CallState) -> None:
        if st.decoder is None:
            st.decoder = self._acquire()
        st.decoder.start_utt()

    def _feed(self, st: _CallState, pcm: np.ndarray) -> None:
        st.decoder.process_raw(pcm.astype("<i2", copy=False).tobytes(), False, False)

    def _hypothesis(self, st: _CallState) -> str | None:
        hyp = st.decoder.hyp()
        return hyp.hypstr.strip() if hyp is not None else ""

    def _end(self, st: _CallState) -> str:
        st.decoder.end_utt()
        return self._hypothesis(st) or ""

    def _release(self, st: _CallState, reuse: bool) -> None:
        decoder, st.decoder = st.decoder, None
        if decoder is not None and reuse:
            self._give_back(decoder, st.in_utt)
