"""An eval's samples: a folder of WAV files with optional `.txt` references beside them, or
sentences said by the piper voice the project ships (their text is the reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clients.call import read_wav
from clients.eval.runner import Sample
from shared.sdk.audio import encode_wav

LEAD_S = 0.3  # silence before each synthesized sentence


def load_folder(folder: Path, rate: int | None) -> list[Sample]:
    """Every `*.wav` under `folder` (sorted by path), mono 16-bit, at `rate` where given.
    `NAME.txt` beside `NAME.wav` is its reference transcript."""
    if not folder.is_dir():
        raise SystemExit(f"{folder}: not a folder of WAV files")
    paths = sorted(folder.rglob("*.wav"))
    if not paths:
        raise SystemExit(f"{folder}: no .wav files")
    samples = []
    for p in paths:
        pcm, got = read_wav(str(p), rate)
        ref = p.with_suffix(".txt")
        text = ref.read_text(encoding="utf-8").strip() if ref.exists() else None
        samples.append(Sample(str(p.relative_to(folder).with_suffix("")), pcm, got, text))
    return samples


def synthesize(n: int, rate: int, keep_in: Path | None = None) -> list[Sample]:
    """`n` of the model's sample sentences (in turn, repeated past their number, each time
    said anew) by the bundled piper voice, after LEAD_S of silence; written to `keep_in` as WAV + TXT when given, so
    the corpus can be run again as a folder."""
    from models.voice_assistant.clips import piper_clips
    from models.voice_assistant.text import SAMPLE_SENTENCES

    texts = [SAMPLE_SENTENCES[i % len(SAMPLE_SENTENCES)] for i in range(n)]
    lead = np.zeros(round(LEAD_S * rate), dtype="<i2")  # a microphone is on before the caller speaks
    clips = [np.concatenate([lead, c]) for c in piper_clips(texts, rate)]
    samples = [Sample(f"synth-{i:03d}", pcm, rate, text) for i, (pcm, text) in enumerate(zip(clips, texts, strict=True))]
    if keep_in is not None:
        keep_in.mkdir(parents=True, exist_ok=True)
        for s in samples:
            (keep_in / f"{s.name}.wav").write_bytes(encode_wav(s.pcm, rate))
            (keep_in / f"{s.name}.txt").write_text(f"{s.reference}\n", encoding="utf-8")
    return samples
