"""tiny_duplex turns every item into one frame, malformed ones too (padded, cut, cleaned)."""

from __future__ import annotations

import numpy as np

from models.tiny_duplex import FRAME, TinyDuplexModel, TinyDuplexPartition, frame_to_float
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, Output, StepInput
from tests.support.needs import installed

installed("torch")

SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab": 64, "window": 8, "max_calls": 6, "device": "cpu"}


def partition() -> TinyDuplexPartition:
    p = TinyDuplexModel(**SMALL).create_partition("Duplex")
    assert isinstance(p, TinyDuplexPartition)
    return p


def test_frame_to_float_pads_cuts_scales_and_cleans() -> None:
    assert not frame_to_float(None, 4).any()
    assert frame_to_float(np.array([16384, -32768], dtype="<i2"), 4).tolist() == [0.5, -1.0, 0.0, 0.0]
    assert frame_to_float(np.array([0.25, np.nan, np.inf, -np.inf, 0.5]), 4).tolist() == [0.25, 0.0, 1.0, -1.0]
    row = np.zeros((2, 3), dtype=np.float32)
    second = row[1]
    assert frame_to_float(np.array([0.5]), 3, out=second) is second
    assert row.tolist() == [[0, 0, 0], [0.5, 0, 0]]


def test_step_runs_malformed_items_as_their_converted_frames() -> None:
    rng = np.random.default_rng(0)
    odd: list[np.ndarray | None] = [
        None,
        rng.integers(-30000, 30000, FRAME // 3).astype("<i2"),  # short
        rng.uniform(-0.5, 0.5, FRAME + 100).astype(np.float32),  # long
        np.full(FRAME, np.nan),
    ]
    p, ref = partition(), partition()
    for q in (p, ref):
        for cid in ("a", "b"):
            q.open_call(CallInfo(cid))
    batch = [StepInput(cid, {"audio_in": Chunk([Item(d) for d in odd], 0)}) for cid in ("a", "b")]
    got = [(o.cid, o.data["frame"], o.data["token"]) for o in p.step(batch) if isinstance(o, Output)]
    expected = []
    for i, d in enumerate(odd):
        x = np.stack([frame_to_float(d, FRAME)] * 2)
        tokens, _ = ref.forward(["a", "b"], x)
        expected += [("a", i, tokens[0]), ("b", i, tokens[1])]
    assert got == expected
