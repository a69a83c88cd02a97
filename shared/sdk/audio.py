"""Client audio: WAV (RIFF, PCM16) and raw PCM16 decoding, base64 PCM16, and the framer."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pybase64

from shared.runtime.errors import BadRequest


def decode_audio_file(name: str, data: bytes, sample_rate: int) -> np.ndarray:
    """PCM16 mono samples of a client file. `.pcm` files are raw PCM16 LE at `sample_rate`."""
    if name.lower().endswith(".pcm"):
        if len(data) % 2:
            raise BadRequest(f"file {name!r}: raw PCM16 needs an even byte count, got {len(data)}")
        return np.frombuffer(data, dtype="<i2").copy()
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise BadRequest(f"file {name!r} is not a WAV file (RIFF/WAVE) and does not end in .pcm")
    try:
        channels, width, rate, frames = read_wav(data)
    except WAV_ERRORS as e:
        raise BadRequest(f"file {name!r}: unreadable WAV: {e}") from None
    wrong = pcm16_mono_mismatch(channels, width, rate, sample_rate)
    if wrong:
        raise BadRequest(f"file {name!r}: expected {wrong}")
    return np.frombuffer(frames, dtype="<i2").copy()


WAV_ERRORS = (wave.Error, EOFError, struct.error)  # what reading a malformed WAV raises


# The canonical PCM WAV a client wraps each chunk of audio in: RIFF, WAVE, a 16-byte fmt chunk,
# the data chunk, nothing else, every size exact. Read field by field: the wave module's reader
# took a third of the frontend's time per append of a live call sending WAVs.
_CANONICAL = struct.Struct("<4sI4s4sIHHIIHH4sI")
_HEADER = _CANONICAL.size  # 44
_PCM = 1


def read_wav(data: bytes) -> tuple[int, int, int, bytes]:
    """(channels, sample width in bytes, rate, frame bytes) of a WAV file; raises WAV_ERRORS.
    Frame bytes are whole frames, as the wave module reads them; a file of any other layout
    (and every malformed one) is read by that module, so its reading is the rule for all."""
    if len(data) >= _HEADER:
        riff, size, form, fmt, fmt_size, tag, channels, rate, _, _, bits, name, n = _CANONICAL.unpack_from(data)
        exact = size + 8 == len(data) == _HEADER + n and fmt_size == 16
        if exact and (riff, form, fmt, name, tag) == (b"RIFF", b"WAVE", b"fmt ", b"data", _PCM) and channels and bits:
            width = (bits + 7) // 8
            frame = channels * width
            return channels, width, rate, data[_HEADER : _HEADER + n // frame * frame]
    return _read_wav_module(data)


def _read_wav_module(data: bytes) -> tuple[int, int, int, bytes]:
    with wave.open(io.BytesIO(data), "rb") as w:
        return w.getnchannels(), w.getsampwidth(), w.getframerate(), w.readframes(w.getnframes())


def pcm16_mono_mismatch(channels: int, width: int, rate: int, sample_rate: int) -> str:
    """What a WAV's format lacks to be mono PCM16 at `sample_rate` ("" when nothing)."""
    if channels == 1 and rate == sample_rate and width == 2:
        return ""  # (asked of every WAV a live call sends: no list to build for the usual answer)
    wrong = []
    if channels != 1:
        wrong.append(f"1 channel (got {channels})")
    if rate != sample_rate:
        wrong.append(f"{sample_rate} Hz (got {rate})")
    if width != 2:
        wrong.append(f"16-bit samples (got {8 * width}-bit)")
    return ", ".join(wrong)


def b64_pcm16(pcm: np.ndarray) -> str:
    """PCM16 LE samples as base64 text (SIMD base64: this is on every output of audio)."""
    return pybase64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")


def pcm16_bytes(pcm: np.ndarray) -> bytes:
    """PCM16 LE samples as bytes, for a field of a model's `binary_fields`: a client that reads
    msgpack gets them as they are, a JSON client as the base64 text `b64_pcm16` makes (the
    worker encodes it), so neither pays for base64 it does not read."""
    return np.asarray(pcm, dtype="<i2").tobytes()


def pcm16_from_b64(data: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(data), dtype="<i2").copy()


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
        self._none = np.zeros(0, dtype=self.dtype)  # no remainder (never written to: shared)
        self._rest = self._none

    @property
    def pending(self) -> int:
        return len(self._rest)

    def push(self, units: np.ndarray) -> list[np.ndarray]:
        units = units.astype(self.dtype, copy=False)  # items are of the stream's dtype, remainder or not
        buf = np.concatenate([self._rest, units]) if len(self._rest) else units
        size = self.item_size
        n = len(buf) // size
        frames = [buf[i * size : (i + 1) * size] for i in range(n)]
        # A copy: a view would keep the whole append alive. (Most appends leave none: an 80 ms
        # append of an 80 ms item.)
        self._rest = buf[n * size :].copy() if len(buf) > n * size else self._none
        return frames

    def count_after(self, n_units: int, flush: bool = False) -> int:
        """Items `push` (then `flush`, with flush=True) would produce for `n_units` more units:
        for limit checks before anything is published."""
        n, rest = divmod(len(self._rest) + n_units, self.item_size)
        return n + 1 if flush and rest else n

    def flush(self) -> np.ndarray | None:
        if not len(self._rest):
            return None
        last = np.zeros(self.item_size, dtype=self.dtype)
        last[: len(self._rest)] = self._rest
        self._rest = self._none
        return last


class Resampler:
    """PCM16 mono from `rate_in` to `rate_out`, chunk by chunk, with the filter's state carried
    across chunks (soxr, high quality: band-limited, no aliasing, unlike linear interpolation).
    At equal rates nothing is touched: the samples go through as they are."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        import soxr  # only where audio is converted: most processes never resample

        self.rate_in, self.rate_out = rate_in, rate_out
        self._stream = None if rate_in == rate_out else soxr.ResampleStream(rate_in, rate_out, 1, dtype="int16", quality="HQ")

    def push(self, pcm: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return pcm
        out: np.ndarray = self._stream.resample_chunk(np.ascontiguousarray(pcm, dtype=np.int16))
        return out

    def flush(self) -> np.ndarray:
        """What the filter still holds (its delay), and a clean state for what comes next."""
        if self._stream is None:
            return np.zeros(0, dtype=np.int16)
        tail: np.ndarray = self._stream.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
        self._stream.clear()
        return tail


def resample_pcm16(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """A whole clip of PCM16 samples at another rate (the same array where the rates are equal)."""
    r = Resampler(from_rate, to_rate)
    out = r.push(np.asarray(samples, dtype=np.int16))
    tail = r.flush()
    return np.concatenate([out, tail]) if len(tail) else out
