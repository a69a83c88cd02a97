"""Streaming PCM16 resampling (soxr, high quality) between a session's rate and the model's."""

from __future__ import annotations

import numpy as np
import soxr

EMPTY = np.zeros(0, dtype=np.int16)


class Resampler:
    """PCM16 mono from `rate_in` to `rate_out`, chunk by chunk, with the filter's state carried
    across chunks. At equal rates nothing is touched: the samples go through as they are."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self._stream = None if rate_in == rate_out else soxr.ResampleStream(rate_in, rate_out, 1, dtype="int16", quality="HQ")

    def push(self, pcm: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(np.ascontiguousarray(pcm, dtype=np.int16))

    def flush(self) -> np.ndarray:
        """What the filter still holds (its delay), and a clean state for what comes next."""
        if self._stream is None:
            return EMPTY
        tail: np.ndarray = self._stream.resample_chunk(EMPTY, last=True)
        self._stream.clear()
        return tail


def resample(pcm: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """A whole clip at once (a conversation item's audio)."""
    r = Resampler(rate_in, rate_out)
    out = r.push(pcm)
    tail = r.flush()
    return np.concatenate([out, tail]) if len(tail) else out
