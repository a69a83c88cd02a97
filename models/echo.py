"""`echo`: the plumbing oracle. What goes in comes back, in order.

Client stream `audio_in` (16 kHz PCM16, 80 ms frames) -> partition `Encoder`
(frame energy) -> edge `frames` -> partition `Talker`, which emits one output per
frame and finishes with usage {"frames": N}. Two partitions, so the
inter-partition stream crosses the bus.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from duplexbus.sdk import (
    CLIENT,
    CallInfo,
    CatchUpChunkPolicy,
    ClientStreamLimits,
    Connection,
    EdgeItem,
    Emission,
    Item,
    Model,
    ModelEvent,
    Output,
    Partition,
    PartitionTopology,
    RealtimeMapping,
    ReplyAudio,
    ReplyEnded,
    ReplyStarted,
    SpeechStarted,
    SpeechStopped,
    StepInput,
    TurnSettings,
    TurnTaking,
    pcm16_bytes,
    pcm16_from_b64,
)

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
                audio = pcm16_bytes(item.data)  # base64 only for a JSON client, made by the worker
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

    def realtime_mapping(self) -> RealtimeMapping:
        return EchoRealtime()


class EchoRealtime(RealtimeMapping):
    """echo over `/v1/realtime`: what the caller committed comes back as one response.

    Manual commits: frame i of the output is samples [1280 i, 1280 (i + 1)) of the call's
    audio, so each committed range of samples comes back exactly, as one reply; the zeros
    the frontend pads a commit with belong to no range and are dropped.

    Server VAD: echo's own turn-taking is by energy (the `rms` its Encoder computes): a turn
    starts at a frame of at least `voiced_rms` and ends after `quiet_frames` quieter frames
    (or at `MAX_TURN_FRAMES`); its reply is the turn's frames, from `prefix_frames` before the
    first voiced one up to the last voiced one. The session's `threshold`,
    `silence_duration_ms` and `prefix_padding_ms` set those three (`set_turn_detection`), to
    whole 80 ms frames; `semantic_vad` is served by the same energy detector.
    """

    VOICED_RMS = 300.0  # about -40 dBFS: a turn's start where the session gives no threshold
    QUIET_FRAMES = 6  # 480 ms of quiet ends a turn
    MAX_TURN_FRAMES = 375  # 30 s: the most one turn holds
    FRAME_MS = FRAME * 1000 // SAMPLE_RATE  # 80

    def __init__(self) -> None:
        self.server_vad = False
        self.ranges: deque[tuple[int, int]] = deque()  # committed [start, end), not yet all back
        self.started = False  # the head range's reply has started
        self.turn: list[np.ndarray] = []  # server VAD: the open turn's frames
        self.voiced = 0  # frames of the open turn up to its last voiced one
        self.start_frame = 0
        self.voiced_rms = self.VOICED_RMS
        self.threshold: float | None = None  # as the session set it (None: VOICED_RMS)
        self.quiet_frames = self.QUIET_FRAMES
        self.prefix_frames = 0
        self.before: deque[np.ndarray] = deque(maxlen=1)  # quiet frames before a turn (its prefix)

    def set_server_vad(self, on: bool) -> None:
        self.server_vad = on

    def set_turn_detection(self, settings: TurnSettings) -> TurnTaking:
        """Each `session.update` sets the whole turn detection object: a setting it leaves out
        is echo's default again."""
        self.threshold = settings.threshold
        # 0.0 to 1.0 onto -70 to -10 dBFS (0.5: -40 dBFS, about the default's 300)
        t = settings.threshold
        self.voiced_rms = self.VOICED_RMS if t is None else 32768.0 * 10 ** ((-70.0 + 60.0 * t) / 20.0)
        silence = settings.silence_duration_ms
        self.quiet_frames = self.QUIET_FRAMES if silence is None else max(1, round(silence / self.FRAME_MS))
        self.prefix_frames = round((settings.prefix_padding_ms or 0) / self.FRAME_MS)
        kept = list(self.before)[-self.prefix_frames :] if self.prefix_frames else []
        self.before = deque(kept, maxlen=max(1, self.prefix_frames))
        unsupported = {}
        if settings.eagerness is not None:
            unsupported["eagerness"] = "semantic_vad is served by echo's energy detector, which has no eagerness"
        return TurnTaking(
            "echo's energy detector (80 ms frames)",
            threshold=0.5 if t is None else t,
            prefix_padding_ms=self.prefix_frames * self.FRAME_MS,
            silence_duration_ms=self.quiet_frames * self.FRAME_MS,
            unsupported=unsupported,
        )

    def committed(self, start: int, samples: int) -> None:
        self.ranges.append((start, start + samples))

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        i = int(output["frame"])
        pcm = pcm16_from_b64(output["audio"])
        if self.server_vad:
            return self._by_energy(i, pcm, float(output.get("rms", 0.0)))
        return self._by_commit(i * FRAME, pcm)

    def _by_commit(self, first: int, pcm: np.ndarray) -> list[ModelEvent]:
        out: list[ModelEvent] = []
        end_of_frame = first + len(pcm)
        while self.ranges and self.ranges[0][0] < end_of_frame:
            start, end = self.ranges[0]
            piece = pcm[max(start - first, 0) : min(end, end_of_frame) - first]
            if not self.started:
                self.started = True
                out.append(ReplyStarted())
            if len(piece):
                out.append(ReplyAudio(piece, SAMPLE_RATE))
            if end > end_of_frame:
                break
            out.append(ReplyEnded())
            self.ranges.popleft()
            self.started = False
        return out

    def _by_energy(self, i: int, pcm: np.ndarray, rms: float) -> list[ModelEvent]:
        voiced = rms >= self.voiced_rms
        if not self.turn:
            if not voiced:
                if self.prefix_frames:
                    self.before.append(pcm)
                return []
            # The turn (and its audio_start_ms) begins prefix_padding_ms before the voiced frame.
            self.turn = [*self.before, pcm]
            self.before.clear()
            self.start_frame, self.voiced = i + 1 - len(self.turn), len(self.turn)
            return [SpeechStarted(round(self.start_frame * FRAME / SAMPLE_RATE, 3))]
        self.turn.append(pcm)
        if voiced:
            self.voiced = len(self.turn)
        quiet = len(self.turn) - self.voiced
        if quiet < self.quiet_frames and len(self.turn) < self.MAX_TURN_FRAMES:
            return []
        frames, self.turn = self.turn[: self.voiced], []
        end_s = round((self.start_frame + len(frames)) * FRAME / SAMPLE_RATE, 3)
        return [SpeechStopped(end_s), ReplyStarted(), *(ReplyAudio(f, SAMPLE_RATE) for f in frames), ReplyEnded()]
