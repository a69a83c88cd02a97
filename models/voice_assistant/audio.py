"""Small audio helpers: resampling and float/PCM16 conversion (base64 PCM16 is in shared.audio)."""

from __future__ import annotations

import numpy as np


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling of a whole clip (FFT method, float64 out)."""
    x = np.asarray(x, dtype=np.float64)
    if rate_in == rate_out or not len(x):
        return x.copy()
    n = len(x)
    m = round(n * rate_out / rate_in)
    spec = np.fft.rfft(x)
    keep = min(len(spec), m // 2 + 1)
    out = np.zeros(m // 2 + 1, dtype=complex)
    out[:keep] = spec[:keep]
    return np.fft.irfft(out, m) * (m / n)


def to_pcm16(x: np.ndarray, gain: float = 1.0) -> np.ndarray:
    """Float audio in [-1, 1] to int16 samples."""
    return np.clip(np.asarray(x, dtype=np.float64) * gain * 32767.0, -32768, 32767).astype(np.int16)


def silence(seconds: float, rate: int) -> np.ndarray:
    return np.zeros(round(seconds * rate), dtype=np.int16)
