"""`reverse`: text comes back reversed, and audio item by item (each 20 ms reversed in time).

One partition, two client streams: `audio_in` (16 kHz PCM16, cut into items of 320 samples
by the frontend) and `text_in` (the opening's or an append's `text`). Over `/v1/realtime`
each text reply is one response; reversed audio has no realtime meaning here.
"""

from __future__ import annotations

from typing import Any

from duplexbus.sdk import (
    CLIENT,
    CallInfo,
    CatchUpChunkPolicy,
    ClientStreamLimits,
    Connection,
    Emission,
    Model,
    ModelEvent,
    Output,
    Partition,
    PartitionTopology,
    RealtimeMapping,
    ReplyEnded,
    ReplyStarted,
    ReplyText,
    StepInput,
    b64_pcm16,
)

RATE, ITEM = 16_000, 320  # 20 ms of audio per item


class Reverser(Partition):
    blocking = False  # cheap: it steps on the worker's event loop, no thread

    def __init__(self) -> None:
        self.items: dict[str, int] = {}  # per call: items reversed so far (its usage)

    def open_call(self, call: CallInfo) -> None:
        self.items[call.cid] = 0

    def step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        for s in batch:
            for chunk in s.chunks.values():
                for item in chunk.items:
                    self.items[s.cid] += 1
                    if item.data is not None:  # audio: its samples, last first
                        out.append(Output(s.cid, {"audio": b64_pcm16(item.data[::-1])}))
                    else:
                        out.append(Output(s.cid, {"text": item.meta["text"][::-1]}))
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        return {"items": self.items.pop(cid, 0)}


class ReverseModel(Model):
    name = "reverse"

    def __init__(self) -> None:
        audio = ClientStreamLimits(item_size=ITEM, unit="samples", sample_rate=RATE)
        self.topology = PartitionTopology(
            partitions=["Reverser"],
            connections=[
                Connection(CLIENT, "Reverser", "audio_in", lambda: CatchUpChunkPolicy(64), audio),
                Connection(CLIENT, "Reverser", "text_in", lambda: CatchUpChunkPolicy(64), ClientStreamLimits(max_items=1000)),
            ],
        )

    def text_stream(self) -> str | None:
        return "text_in"

    def create_partition(self, name: str) -> Partition:
        return Reverser()

    def realtime_mapping(self) -> RealtimeMapping:
        return TextReplies()


class TextReplies(RealtimeMapping):
    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        if "text" not in output:
            return []
        return [ReplyStarted(), ReplyText(output["text"]), ReplyEnded()]
