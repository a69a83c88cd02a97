"""tiny_duplex's prefill walk (pure, no NATS): with `prefill=True` the frames a call had
gathered by its first step run as one sequence pass under walk `prefill`, every other frame
under `decode`, never both in one batch, and the tokens are those of one-at-a-time decoding."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from models.registry import model_class
from models.tiny_duplex import (
    DECODE,
    EDGE,
    FRAMES_EDGE,
    PARTITION,
    PREFILL,
    TinyDuplexModel,
    TinyDuplexPartition,
    TinyDuplexPrefillModel,
)
from services.worker.engine import LocalPipeline
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, Output, StepInput
from shared.sdk.topology import PartitionTopology

SMALL: dict[str, Any] = {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab": 64, "window": 16, "max_calls": 4, "device": "cpu"}


def pcm16_frames(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.round(rng.uniform(-0.5, 0.5, 1280) * 32767).astype("<i2") for _ in range(n)]


def recorded(pipe: LocalPipeline) -> list[list[tuple[str, str]]]:
    """Duplex's batches as (cid, walk) lists, kept as it is stepped."""
    part = pipe.engines[PARTITION].partition
    batches: list[list[tuple[str, str]]] = []
    step = part.step

    def keep(batch: list[StepInput]) -> Any:
        batches.append([(s.cid, s.walk) for s in batch])
        return step(batch)

    part.step = keep  # type: ignore[method-assign]
    return batches


def upload_and_live(pipe: LocalPipeline, upload: list[np.ndarray], live: list[np.ndarray]) -> None:
    """`upload` all in before the first step; `live` one frame per round of steps."""
    pipe.open("upload")
    pipe.open("live")
    for seq, f in enumerate(upload):
        pipe.push("upload", EDGE, seq, Item(f))
    pipe.end("upload", EDGE, len(upload))
    for seq, f in enumerate(live):
        pipe.push("live", EDGE, seq, Item(f))
        pipe.run_once()
    pipe.end("live", EDGE, len(live))
    for _ in range(100):
        if not pipe.run_once():
            break
    assert pipe.finished("upload") and pipe.finished("live")


def tokens(pipe: LocalPipeline, cid: str) -> list[tuple[int, int]]:
    return [(int(d["frame"]), int(d["token"])) for _, d in pipe.result(cid).outputs]


def test_the_backlog_is_prefilled_and_live_frames_decoded_one_walk_per_batch() -> None:
    upload, live = pcm16_frames(1, 7), pcm16_frames(2, 5)
    walked = LocalPipeline(TinyDuplexModel(**SMALL, prefill=True))
    batches = recorded(walked)
    upload_and_live(walked, upload, live)
    plain = LocalPipeline(TinyDuplexModel(**SMALL))  # one partition, one frame a step
    upload_and_live(plain, upload, live)

    for cid in ("upload", "live"):
        assert tokens(walked, cid) == tokens(plain, cid)  # the same tokens, each frame once, in order
        assert [f for f, _ in tokens(walked, cid)] == list(range(7 if cid == "upload" else 5))
    part = walked.engines[PARTITION].partition
    assert isinstance(part, TinyDuplexPartition) and part.prefilled == 7  # the upload, in one pass
    assert all(len({w for _, w in b}) == 1 for b in batches)
    assert {w for b in batches for c, w in b if c == "upload"} == {PREFILL}
    assert {w for b in batches for c, w in b if c == "live"} == {DECODE}
    assert sum(1 for b in batches for c, _ in b if c == "upload") == 1


def test_without_the_walk_the_marks_still_prefill_but_batches_mix_the_passes() -> None:
    """The walk "" (the frames edge's consumer_walk taken away, as a producer that names none
    would leave it): Duplex sorts its calls itself, and a step then runs both kinds of pass."""
    model = TinyDuplexModel(**SMALL, prefill=True)
    topo = model.topology
    model.topology = PartitionTopology(
        topo.partitions,
        [dataclasses.replace(c, consumer_walk=None) if c.edge_name == FRAMES_EDGE else c for c in topo.connections],
    )
    pipe = LocalPipeline(model)
    batches = recorded(pipe)
    upload_and_live(pipe, pcm16_frames(1, 7), pcm16_frames(2, 5))
    part = pipe.engines[PARTITION].partition
    assert isinstance(part, TinyDuplexPartition) and part.prefilled == 7
    assert {w for b in batches for _, w in b} == {""}
    assert any({c for c, _ in b} == {"upload", "live"} for b in batches)  # a prefill and a decode in one step


@pytest.mark.parametrize(
    ("walk", "backlog", "prefilled"), [(PREFILL, False, True), (DECODE, True, False), ("", True, True), ("", False, False)]
)
def test_the_partition_prefills_a_fresh_call_by_its_walk_or_else_by_its_mark(walk: str, backlog: bool, prefilled: bool) -> None:
    part = TinyDuplexModel(**SMALL, prefill=True).create_partition(PARTITION)
    assert isinstance(part, TinyDuplexPartition)
    part.open_call(CallInfo("c"))
    chunk = Chunk([Item(f, {"backlog": backlog}) for f in pcm16_frames(3, 3)], 0, walk=walk)
    out = part.step([StepInput("c", {FRAMES_EDGE: chunk}, walk=walk)])
    assert [o.data["frame"] for o in out if isinstance(o, Output)] == [0, 1, 2] and len(out) == 3
    assert part.prefilled == (3 if prefilled else 0)
    # a call past its first frame is decoded whatever its walk says
    again = Chunk([Item(f) for f in pcm16_frames(4, 2)], 3, walk=PREFILL)
    assert part.plan([StepInput("c", {FRAMES_EDGE: again}, walk=PREFILL)])[0] == []


def test_the_prefill_topology_drives_duplex_from_frames() -> None:
    topo = TinyDuplexModel(**SMALL, prefill=True).topology
    assert topo.partitions == ["Frames", PARTITION]
    assert topo.producer_triggered_partitions() == {PARTITION}
    assert topo.walk_drivers()[PARTITION].edge_name == FRAMES_EDGE
    assert TinyDuplexModel(**SMALL).topology.producer_triggered_partitions() == set()
    # served by path under a name of its own (its topology differs from the default's)
    served = model_class("models.tiny_duplex:TinyDuplexPrefillModel")
    assert served is TinyDuplexPrefillModel and served.name == "tiny_duplex_prefill"
    assert TinyDuplexPrefillModel(**SMALL).topology.partitions == ["Frames", PARTITION]
