"""An item's tensor on the wire, and an output event's audio in either encoding (pure)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from models.echo import FRAME, Talker
from shared.bus import wire
from shared.sdk.audio import b64_pcm16, pcm16_bytes
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, Output, StepInput


@pytest.mark.parametrize(
    "a",
    [
        np.arange(FRAME, dtype="<i2"),
        np.arange(12, dtype="<f4").reshape(3, 4),
        np.zeros(0, dtype="<i2"),
        np.array(0.25, dtype="<f8"),  # 0-d: a model's scalar (it came back 1-d)
        np.arange(12, dtype="<f4").reshape(3, 4).T,  # not contiguous: a view
        np.arange(10, dtype="<i2")[::2],
    ],
    ids=["audio", "2-d", "empty", "0-d", "transposed", "strided"],
)
def test_a_tensor_comes_back_as_the_array_it_was(a: np.ndarray) -> None:
    msg = wire.decode(wire.encode(wire.InputItem(seq=0, item=wire.WireItem.from_item(Item(a)))))
    assert isinstance(msg, wire.InputItem)
    back = msg.item.to_item().data
    assert back is not None
    assert back.dtype == a.dtype and back.shape == a.shape and np.array_equal(back, a)


@pytest.mark.parametrize("shape", [[3], [2, 2]])
def test_a_tensor_whose_shape_does_not_hold_its_data_is_refused(shape: list[int]) -> None:
    with pytest.raises(ValueError):
        wire.Tensor("<i2", shape, bytes(10)).to_array()  # 5 samples


def test_the_dtypes_looked_up_are_bounded() -> None:
    """The lookup of dtypes keeps a handful; what a writer sends cannot grow it without end."""
    bound = wire._dtype.cache_info().maxsize
    assert bound is not None
    for n in range(1, 3 * bound):
        assert wire.Tensor(f"|S{n}", [1], b"a" * n).to_array()[0] == b"a" * n
    assert wire._dtype.cache_info().currsize <= bound


def test_audio_as_bytes_reaches_each_client_in_its_own_encoding() -> None:
    """`pcm16_bytes` in a binary field: msgpack keeps the bytes, and the JSON the worker writes
    for a JSON client is the same text as with `b64_pcm16`'s base64."""
    pcm = (np.sin(np.arange(FRAME) / 7) * 8000).astype("<i2")
    as_bytes = {"frame": 0, "audio": pcm16_bytes(pcm)}
    as_text = {"frame": 0, "audio": b64_pcm16(pcm)}
    assert msgspec.json.encode(as_bytes) == msgspec.json.encode(as_text)
    for event in (as_bytes, as_text):
        packed = msgspec.msgpack.decode(wire.pack_event(event, ("audio",)))
        assert packed["audio"] == pcm.tobytes()
        assert json.loads(wire.unpack_event(wire.pack_event(event, ("audio",)))) == as_text


def test_echo_answers_each_frame_with_its_samples_as_bytes() -> None:
    talker = Talker()
    talker.open_call(CallInfo("c", {}))
    pcm = np.arange(FRAME, dtype="<i2")
    out = talker.step([StepInput("c", {"frames": Chunk([Item(pcm, {"rms": 1.0})], 0)})])
    assert len(out) == 1 and isinstance(out[0], Output)
    assert out[0].data["audio"] == pcm.tobytes()
