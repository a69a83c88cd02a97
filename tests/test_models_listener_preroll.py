"""The Listener's preroll: the audio kept from before a turn's start, `preroll_s` long (0 allowed)."""

from __future__ import annotations

import numpy as np

from models.voice_assistant.listener import WINDOW, Listener
from shared.sdk.model import CallInfo, EdgeItem, Emission
from tests.support.needs import installed

installed("silero_vad")


def turn_audio(preroll_s: float, silent_windows: int) -> np.ndarray:
    """The first `speech` item of a turn that starts after `silent_windows` quiet windows.

    Turn decisions are driven with given probabilities (no VAD run), window k holding the value k.
    """
    listener = Listener(preroll_s=preroll_s)
    listener.open_call(CallInfo("c"))
    st = listener._calls["c"]
    out: list[Emission] = []
    for k in range(silent_windows):
        listener._decide("c", st, 0.0, np.full(WINDOW, k, dtype=np.int16), out)
    listener._decide("c", st, 1.0, np.full(WINDOW, silent_windows, dtype=np.int16), out)
    listener._flush_audio("c", st, out, end_meta=None)
    speech = [e for e in out if isinstance(e, EdgeItem) and e.edge == "speech"]
    assert len(speech) == 1
    data = speech[0].item.data
    assert data is not None
    return np.asarray(data)


def windows_of(audio: np.ndarray) -> list[int]:
    return [int(w[0]) for w in audio.reshape(-1, WINDOW)]


def test_no_preroll_keeps_only_the_turn() -> None:
    assert windows_of(turn_audio(0.0, 5)) == [5]


def test_preroll_keeps_the_fewest_windows_that_cover_it() -> None:
    # 0.3 s = 4800 samples: 10 windows of 512 cover it, 9 do not.
    assert windows_of(turn_audio(0.3, 20)) == list(range(10, 21))
    assert windows_of(turn_audio(WINDOW / 16000, 4)) == [3, 4]


def test_preroll_before_enough_silence_keeps_what_there_is() -> None:
    assert windows_of(turn_audio(0.3, 2)) == [0, 1, 2]
