"""The voice assistant's recognizers side by side, on the same clips, in one run: word error
rate, and how long the final transcript takes once a turn has ended.

Clips: the 8 sentences of `SAMPLE_SENTENCES`, said by the bundled piper voice (the corpus of
`duplexbus eval --synthesize`, 0.3 s of silence before each), and, where `espeak-ng` is
installed (`apt-get install espeak-ng`), the same sentences said by espeak-ng's voices
(`--espeak-voices`), another synthetic voice than the one the project ships.

Each engine hears a clip as its Recognizer does in a call: the audio in 80 ms items, then the
turn's end. pocketsphinx decodes as the audio comes (`process_raw`); what is left at the end
is `end_utt` and `hyp()`. Whisper hears the turn whole at its end (or, in a call fed in real
time, its last partial: `models/voice_assistant/whisper.py`): the final's cost is one decode.
"final ms" is that last part alone, the time between the turn's end and its transcript.

    .venv/bin/python -m bench.recognizers
    .venv/bin/python -m bench.recognizers --espeak-voices en-us en-gb+m3 en-us+f2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.machine import machine
from clients.call import read_wav
from clients.eval.metrics import word_error_rate
from models.voice_assistant.clips import piper_clips
from models.voice_assistant.text import SAMPLE_SENTENCES

RATE = 16_000
ITEM = 1280
LEAD = np.zeros(int(0.3 * RATE), dtype=np.int16)


def espeak_clips(voice: str) -> list[np.ndarray]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(SAMPLE_SENTENCES):
            wav = Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-v", voice, "-w", str(wav), text], check=True, capture_output=True)
            pcm, _ = read_wav(str(wav), RATE)
            out.append(pcm)
    return out


def pocketsphinx() -> Callable[[np.ndarray], tuple[str, float]]:
    from models.voice_assistant.recognizer import new_decoder

    decoder = new_decoder()

    def hear(pcm: np.ndarray) -> tuple[str, float]:
        decoder.start_utt()
        for i in range(0, len(pcm), ITEM):
            decoder.process_raw(pcm[i : i + ITEM].tobytes(), False, False)
        start = time.perf_counter()
        decoder.end_utt()
        hyp = decoder.hyp()
        return (hyp.hypstr.strip() if hyp is not None else ""), time.perf_counter() - start

    return hear


def whisper() -> Callable[[np.ndarray], tuple[str, float]]:
    from models.voice_assistant.whisper import WhisperEngine

    engine = WhisperEngine()
    engine.transcribe(LEAD)  # CTranslate2 sets up its buffers on the first decode

    def hear(pcm: np.ndarray) -> tuple[str, float]:
        start = time.perf_counter()
        text = engine.transcribe(pcm)
        return text, time.perf_counter() - start

    return hear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--espeak-voices", nargs="*", default=["en-us", "en-gb+m3", "en-us+f2"])
    args = ap.parse_args()
    corpora = {"piper (the project's corpus)": [np.concatenate([LEAD, c]) for c in piper_clips(SAMPLE_SENTENCES, RATE)]}
    if shutil.which("espeak-ng"):
        for voice in args.espeak_voices:
            corpora[f"espeak-ng {voice}"] = [np.concatenate([LEAD, c]) for c in espeak_clips(voice)]
    else:
        print("espeak-ng is not installed: its voices are left out (apt-get install espeak-ng)")
    print(machine())
    print("| engine | voice | WER | errors / words | final ms, median (max) |")
    print("|---|---|---|---|---|")
    for name, make in (("pocketsphinx", pocketsphinx), ("whisper tiny.en", whisper)):
        hear = make()
        for corpus, clips in corpora.items():
            heard = [hear(c) for c in clips]
            wer, errors, words = word_error_rate(SAMPLE_SENTENCES, [t for t, _ in heard])
            ms = [1000 * s for _, s in heard]
            print(f"| {name} | {corpus} | {wer:.3f} | {errors} / {words} | {statistics.median(ms):.0f} ({max(ms):.0f}) |")
            for ref, (text, _) in zip(SAMPLE_SENTENCES, heard, strict=True):
                if text.lower().strip(".?! ") != ref:
                    print(f"|  |  | {ref!r} heard as {text!r} | | |")


if __name__ == "__main__":
    main()
