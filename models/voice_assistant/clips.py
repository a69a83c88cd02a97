"""Spoken clips: sentences said by the model's own piper voice, the same on every run. Used
by `duplexbus eval --synthesize`, the voice benchmarks and the voice tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models.voice_assistant.audio import resample, to_pcm16

CLIP_SEED = 20_240_601


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


def mid_sentence_cuts(clip: np.ndarray, frame: int = 160) -> list[int]:
    """Where a caller might pause mid-sentence: the sample positions of the quietest 10 ms (a gap
    between words) in each of three spans of the clip's speech (25-45 %, 45-60 %, 60-80 % of
    it), for measuring false endpoints (issue 22: a 400 ms pause there is not a turn's end)."""
    n = len(clip) // frame * frame
    energy = np.sqrt(np.mean(clip[:n].astype(np.float32).reshape(-1, frame) ** 2, axis=1))
    loud = np.flatnonzero(energy > 0.05 * energy.max())
    a, b = int(loud[0]), int(loud[-1])
    points = []
    for lo, hi in ((0.25, 0.45), (0.45, 0.6), (0.6, 0.8)):
        i0, i1 = a + int(lo * (b - a)), a + int(hi * (b - a))
        points.append((i0 + int(np.argmin(energy[i0:i1]))) * frame)
    return points
