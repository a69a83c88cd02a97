"""`echo`: the plumbing oracle. What goes in comes back, in order.

Client stream `audio_in` (16 kHz PCM16, 80 ms frames) -> partition `Encoder`
(frame energy) -> edge `frames` -> partition `Talker`, which emits one output per
frame and finishes with usage {"frames": N}. Two partitions, so the
inter-partition stream crosses the bus.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.sdk.audio import b64_pcm16
from shared.sdk.chunking import CatchUpChunkPolicy, Item
from shared.sdk.model import CallInfo, EdgeItem, Emission, Model, Output, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology

SAMPLE_RATE = 16_000
FRAME = 1280  # 80 ms


def frame_rms(frame: np.ndarray) -> float:
    if not len(frame):
        return 0.0
    return float(np.sqrt(np.mean(frame.astype(np.float64) ** 2)))


def frames_rms(frames: list[np.ndarray]) -> list[float]:
    """frame_rms of each, in one numpy pass over the batch where the frames are of one length."""
    if not frames or len({len(f) for f in frames}) != 1 or not len(frames[0]):
        return [frame_rms(f) for f in frames]
    x = np.stack(frames).astype(np.float64)
    rms: list[float] = np.sqrt(np.mean(x * x, axis=1)).tolist()
    return rms


class Encoder(Partition):
    """Stateless: each frame's energy depends on that frame alone."""

    blocking = False

    def open_call(self, call: CallInfo) -> None:
        pass

    def step(self, batch: list[StepInput]) -> list[Emission]:
        """One pass over the batch: the energy of every call's frames at once."""
        frames: list[tuple[str, np.ndarray]] = []
        for s in batch:
            chunk = s.chunks.get("audio_in")
            if chunk is not None:
                for item in chunk.items:
                    assert item.data is not None
                    frames.append((s.cid, item.data))
        rms = frames_rms([f for _, f in frames])
        return [EdgeItem(cid, "frames", Item(f, {"rms": r})) for (cid, f), r in zip(frames, rms, strict=True)]

    def close_call(self, cid: str) -> dict[str, Any]:
        return {}


class Talker(Partition):
    blocking = False

    def __init__(self) -> None:
        self._frames: dict[str, int] = {}

    def open_call(self, call: CallInfo) -> None:
        self._frames[call.cid] = 0

    def step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        for s in batch:
            chunk = s.chunks.get("frames")
            if chunk is None:
                continue
            for item in chunk.items:
                assert item.data is not None
                i = self._frames[s.cid]
                self._frames[s.cid] = i + 1
                audio = b64_pcm16(item.data)
                out.append(Output(s.cid, {"frame": i, "audio": audio, "rms": item.meta.get("rms", 0.0)}))
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        return {"frames": self._frames.pop(cid, 0)}


class EchoModel(Model):
    name = "echo"

    def __init__(self) -> None:
        self.topology = PartitionTopology(
            partitions=["Encoder", "Talker"],
            connections=[
                Connection(
                    CLIENT,
                    "Encoder",
                    "audio_in",
                    lambda: CatchUpChunkPolicy(64),
                    ClientStreamLimits(max_items=None, item_size=FRAME, unit="samples", sample_rate=SAMPLE_RATE),
                ),
                Connection("Encoder", "Talker", "frames", lambda: CatchUpChunkPolicy(64)),
            ],
        )

    def create_partition(self, name: str) -> Partition:
        return {"Encoder": Encoder, "Talker": Talker}[name]()
