"""The Recognizer closes a turn with one final transcript pair, also when decoding fails."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from models.voice_assistant.recognizer import Recognizer
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, EdgeItem, Emission, Output, StepInput
from tests.support.needs import installed

installed("pocketsphinx")


@pytest.fixture(scope="module")
def recognizer() -> Recognizer:
    return Recognizer(pool_size=2)


def speech(cid: str, *items: Item) -> StepInput:
    return StepInput(cid, {"speech": Chunk(list(items), 0)})


def finals(out: list[Emission]) -> list[tuple[str, Any]]:
    got: list[tuple[str, Any]] = []
    for e in out:
        if isinstance(e, Output) and e.data.get("final"):
            got.append(("output", (e.data["turn"], e.data["text"])))
        elif isinstance(e, EdgeItem) and e.edge == "transcript":
            got.append(("edge", (e.item.meta["turn"], e.item.meta["text"], e.item.meta["short"])))
    return got


def test_a_turn_ends_with_one_final_pair(recognizer: Recognizer) -> None:
    recognizer.open_call(CallInfo("ok"))
    quiet = np.zeros(1600, dtype=np.int16)
    out = recognizer.step(
        [speech("ok", Item(quiet, {"turn": 1, "end": False}), Item(None, {"turn": 1, "end": True, "short": True}))]
    )
    assert finals(out) == [("output", (1, "")), ("edge", (1, "", True))]
    assert recognizer.close_call("ok")["turns"] == 1


class Broken:
    def process_raw(self, *_: Any) -> None:
        raise RuntimeError("decoder fault")


def test_a_decoder_fault_ends_the_turn_empty(recognizer: Recognizer) -> None:
    recognizer.open_call(CallInfo("bad"))
    quiet = np.zeros(1600, dtype=np.int16)
    recognizer.step([speech("bad", Item(quiet, {"turn": 1, "end": False}))])
    st = recognizer._calls["bad"]
    good = st.decoder
    st.decoder = Broken()
    out = recognizer.step([speech("bad", Item(quiet, {"turn": 1, "end": False}))])
    assert finals(out) == [("output", (1, "")), ("edge", (1, "", False))]
    assert st.decoder is None and not st.in_utt
    good.end_utt()
    assert recognizer.close_call("bad")["turns"] == 1
