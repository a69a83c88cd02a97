"""Small audio helpers: resampling, float/PCM16 conversion, framing, base64."""

from __future__ import annotations

import numpy as np
import pybase64


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


def frames(pcm: np.ndarray, size: int) -> list[np.ndarray]:
    """Cut PCM16 into items of `size` samples; the last one is zero-padded (like the frontend's Framer)."""
    pcm = np.asarray(pcm, dtype=np.int16)
    out = [pcm[i : i + size] for i in range(0, len(pcm), size)]
    if out and len(out[-1]) < size:
        last = np.zeros(size, dtype=np.int16)
        last[: len(out[-1])] = out[-1]
        out[-1] = last
    return out


def b64_pcm16(pcm: np.ndarray) -> str:
    return pybase64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")


def pcm16_from_b64(data: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(data), dtype="<i2").copy()
