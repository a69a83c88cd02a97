"""Small audio helpers: resampling and float/PCM16 conversion (base64 PCM16 is in shared.audio)."""

from __future__ import annotations

import numpy as np
import soxr


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling of a whole clip (soxr, float64 out), `round(len(x) * rate_out /
    rate_in)` samples long. soxr filters locally, so one end of a clip never leaks into the
    other, as a whole-clip FFT's circular spectrum does (a voice's final syllable heard as a
    faint ring before its first)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    if rate_in == rate_out or not len(x):
        return x.copy()
    out: np.ndarray = soxr.resample(x, rate_in, rate_out, quality="HQ")
    # soxr rounds a half sample up; the length callers were promised is Python's round().
    m = round(len(x) * rate_out / rate_in)
    return out[:m] if len(out) >= m else np.pad(out, (0, m - len(out)))


def to_pcm16(x: np.ndarray, gain: float = 1.0) -> np.ndarray:
    """Float audio in [-1, 1] to int16 samples."""
    return np.clip(np.asarray(x, dtype=np.float64) * gain * 32767.0, -32768, 32767).astype(np.int16)


def silence(seconds: float, rate: int) -> np.ndarray:
    return np.zeros(round(seconds * rate), dtype=np.int16)
