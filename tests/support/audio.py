"""Audio for tests: client files, what echo sends back, WAV files. (Spoken clips, the same on
every run, are models/voice_assistant/clips.py: `duplexbus eval` uses them too.)"""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np

from models.echo import FRAME
from shared.sdk.audio import b64_pcm16


def pcm(samples: np.ndarray) -> str:
    """PCM16 samples as the base64 text of a `.pcm` file."""
    return b64_pcm16(samples)


def pcm_file(samples: np.ndarray, stream: str | None = None) -> dict[str, Any]:
    """A raw PCM16 client file (`a.pcm`) of `samples`, for `stream` if given."""
    f = {"name": "a.pcm", "data": pcm(samples)}
    if stream:
        f["stream"] = stream
    return f


def padded(samples: np.ndarray) -> bytes:
    """What echo sends back for `samples`: the input zero-padded to whole frames."""
    n = -(-len(samples) // FRAME) * FRAME
    out = np.zeros(n, dtype="<i2")
    out[: len(samples)] = samples
    return out.tobytes()


def echo_bytes(outputs: list[dict[str, Any]]) -> bytes:
    """The audio of echo's outputs: base64 text, or bytes (a call opened in msgpack)."""
    return b"".join(o["audio"] if isinstance(o["audio"], bytes) else base64.b64decode(o["audio"]) for o in outputs)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    """A WAV file of `samples` (each repeated on every channel); of any sample width, to test
    refusals (a width other than 2 holds silence of the right length)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        frames = np.repeat(np.asarray(samples, "<i2"), channels).tobytes()
        w.writeframes(frames if width == 2 else bytes(len(samples) * channels * width))
    return buf.getvalue()
