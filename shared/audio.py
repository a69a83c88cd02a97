"""Client audio: WAV (RIFF, PCM16) and raw PCM16 decoding, and the framer."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

from duplexbus.shared.errors import BadRequest


def decode_audio_file(name: str, data: bytes, sample_rate: int) -> np.ndarray:
    """PCM16 mono samples of a client file. `.pcm` files are raw PCM16 LE at `sample_rate`."""
    if name.lower().endswith(".pcm"):
        if len(data) % 2:
            raise BadRequest(f"file {name!r}: raw PCM16 needs an even byte count, got {len(data)}")
        return np.frombuffer(data, dtype="<i2").copy()
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise BadRequest(f"file {name!r} is not a WAV file (RIFF/WAVE) and does not end in .pcm")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, struct.error) as e:
        raise BadRequest(f"file {name!r}: unreadable WAV: {e}") from None
    wrong = []
    if channels != 1:
        wrong.append(f"1 channel (got {channels})")
    if rate != sample_rate:
        wrong.append(f"{sample_rate} Hz (got {rate})")
    if width != 2:
        wrong.append(f"16-bit samples (got {8 * width}-bit)")
    if wrong:
        raise BadRequest(f"file {name!r}: expected " + ", ".join(wrong))
    return np.frombuffer(frames, dtype="<i2").copy()


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.asarray(samples, dtype="<i2").tobytes())
    return buf.getvalue()


class Framer:
    """Cuts a stream of units into items of exactly `item_size`, carrying the remainder.

    An append of 10 ms or of 20 s is cut the same way; `flush` pads the remainder
    with zeros to one last full item at end of input.
    """

    def __init__(self, item_size: int, dtype: str = "<i2") -> None:
        self.item_size = item_size
        self.dtype = np.dtype(dtype)
        self._rest = np.zeros(0, dtype=self.dtype)

    @property
    def pending(self) -> int:
        return len(self._rest)

    def push(self, units: np.ndarray) -> list[np.ndarray]:
        buf = np.concatenate([self._rest, units.astype(self.dtype, copy=False)]) if len(self._rest) else units
        n = len(buf) // self.item_size
        frames = [buf[i * self.item_size : (i + 1) * self.item_size] for i in range(n)]
        self._rest = buf[n * self.item_size :].copy()
        return frames

    def count_after(self, n_units: int) -> int:
        """Items `push` would produce for `n_units` more units (for limit checks before publishing)."""
        return (len(self._rest) + n_units) // self.item_size

    def flush(self) -> np.ndarray | None:
        if not len(self._rest):
            return None
        last = np.zeros(self.item_size, dtype=self.dtype)
        last[: len(self._rest)] = self._rest
        self._rest = np.zeros(0, dtype=self.dtype)
        return last
