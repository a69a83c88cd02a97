"""A bounded sample of durations with percentiles (for live stats and benchmarks)."""

from __future__ import annotations

import random


class Reservoir:
    """Keeps at most `size` samples (reservoir sampling), so memory is bounded however long it runs."""

    def __init__(self, size: int = 20_000, seed: int = 0) -> None:
        self.size = size
        self.samples: list[float] = []
        self.count = 0
        self._rng = random.Random(seed)

    def add(self, x: float) -> None:
        self.count += 1
        if len(self.samples) < self.size:
            self.samples.append(x)
        else:
            j = self._rng.randrange(self.count)
            if j < self.size:
                self.samples[j] = x

    def clear(self) -> None:
        self.samples.clear()
        self.count = 0

    def percentile(self, p: float) -> float | None:
        return percentile(self.samples, p)


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def turn_latency(
    decided: float, waited_s: float | None, transcript_at: float | None, first_audio_at: float | None
) -> tuple[float | None, float | None, float | None]:
    """A spoken turn's latency (seconds): end of speech to the decision (`waited_s`, the model's
    own figure), the decision to the final transcript, and end of speech to the reply's first
    audio (from the decision where the model gives no figure). `decided`, `transcript_at` and
    `first_audio_at` are one clock's times (the frontend's realtime session, the eval client);
    a transcript before the decision counts as none. None where a moment is missing."""
    transcript = transcript_at - decided if transcript_at is not None and transcript_at >= decided else None
    first = first_audio_at - decided + (waited_s or 0.0) if first_audio_at is not None else None
    return waited_s, transcript, first
