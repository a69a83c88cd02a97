"""Audio for tests and benchmarks: client files, what echo sends back, WAV files, and spoken
clips that are the same on every run."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

from models.echo import FRAME
from models.voice_assistant.audio import resample, to_pcm16
from shared.sdk.audio import b64_pcm16

CLIP_SEED = 20_240_601


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
    return b"".join(base64.b64decode(o["audio"]) for o in outputs)


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


def piper_clips(texts: Sequence[str], rate: int, seed: int = CLIP_SEED, gain: float = 0.7) -> list[np.ndarray]:
    """PCM16 mono at `rate` of each text, in order, said by the bundled voice with its
    own noise on, from an onnxruntime session seeded before it is built. The voice's
    random ops draw from generators seeded then, so a clip depends on the seed and on
    the texts said before it in this call: the same arguments give the same clips."""
    import onnxruntime

    from models.voice_assistant.talker import load_voice

    onnxruntime.set_seed(seed)
    voice = load_voice()
    out = []
    for text in texts:
        audio = np.concatenate([c.audio_float_array for c in voice.synthesize(text)])
        out.append(to_pcm16(resample(audio, voice.config.sample_rate, rate), gain=gain))
    return out
