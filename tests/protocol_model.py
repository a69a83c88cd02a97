"""`duo`: a test-only model with three client streams, for the protocol rules that need
more than one (end_input naming some streams, late appends, model-declared bounds).

- `audio_in`: 16 kHz PCM16 in items of 1280 samples, the model's bound 100 items
- `aux_in`: 8 kHz PCM16 in items of 160 samples, the model's bound 40 items
- `text_in`: the model's text stream, one item per text, the model's bound 4 items

One partition, `Mixer`, emits `{"stream", "i", "samples", "sum"}` per audio item and
`{"stream", "i", "text"}` per text item, and finishes with usage `{edge: items}`.

It is not in models/registry.py: `python -m tests.protocol_model ARGS` is the `duplexbus`
command with `duo` registered, and `DuoStack` starts every service that way.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

from shared.sdk.chunking import CatchUpChunkPolicy
from shared.sdk.model import CallInfo, Emission, Model, Output, Partition, StepInput
from shared.sdk.topology import CLIENT, ClientStreamLimits, Connection, PartitionTopology
from tests.support import REPO
from tests.support.stack import Stack

AUDIO_RATE, AUDIO_FRAME, AUDIO_MAX = 16_000, 1280, 100
AUX_RATE, AUX_FRAME, AUX_MAX = 8_000, 160, 40
TEXT_MAX = 4


class Mixer(Partition):
    blocking = False

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, int]] = {}

    def open_call(self, call: CallInfo) -> None:
        self._counts[call.cid] = {}

    def step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        for s in batch:
            counts = self._counts[s.cid]
            for edge, chunk in sorted(s.chunks.items()):
                for item in chunk.items:
                    i = counts.get(edge, 0)
                    counts[edge] = i + 1
                    ev: dict[str, Any] = {"stream": edge, "i": i}
                    if item.data is not None:
                        ev["samples"] = len(item.data)
                        ev["sum"] = int(np.asarray(item.data, dtype=np.int64).sum())
                    else:
                        ev["text"] = item.meta.get("text")
                    out.append(Output(s.cid, ev))
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        return dict(self._counts.pop(cid, {}))


class DuoModel(Model):
    name = "duo"

    def __init__(self) -> None:
        self.topology = PartitionTopology(
            partitions=["Mixer"],
            connections=[
                Connection(
                    CLIENT,
                    "Mixer",
                    "audio_in",
                    lambda: CatchUpChunkPolicy(64),
                    ClientStreamLimits(AUDIO_MAX, AUDIO_FRAME, "samples", AUDIO_RATE),
                ),
                Connection(
                    CLIENT,
                    "Mixer",
                    "aux_in",
                    lambda: CatchUpChunkPolicy(64),
                    ClientStreamLimits(AUX_MAX, AUX_FRAME, "samples", AUX_RATE),
                ),
                Connection(CLIENT, "Mixer", "text_in", lambda: CatchUpChunkPolicy(64), ClientStreamLimits(TEXT_MAX)),
            ],
        )

    def text_stream(self) -> str | None:
        return "text_in"

    def create_partition(self, name: str) -> Partition:
        assert name == "Mixer"
        return Mixer()


def register() -> None:
    from models import registry

    registry.MODELS.setdefault("duo", "tests.protocol_model:DuoModel")


def argv(*args: str) -> list[str]:
    """The `duplexbus` command line with `duo` registered."""
    return [sys.executable, "-m", "tests.protocol_model", *args]


class DuoStack(Stack):
    """A Stack whose services know the `duo` model."""

    def __init__(self, nats_url: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(nats_url, {"model": "duo", **(config or {})})
        self.env["PYTHONPATH"] = str(REPO)

    def _argv(self, *args: str) -> list[str]:
        return argv(*args, "--config", str(self.config_path))


if __name__ == "__main__":
    register()
    from duplexbus.cli import main

    logging.captureWarnings(True)
    sys.exit(main())
