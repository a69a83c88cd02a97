"""A semantic end of turn, tried: Smart Turn v3.2 on the project's synthesized corpus. Would it
end complete turns after 0.2 s of silence (instead of the Listener's 0.5 s rule) without
answering a caller who pauses 400 ms mid-sentence (issue 22: at most 1 in 10)?

The model is Smart Turn v3.2 (BSD-2, 8.7 MB ONNX), which the `pipecat-ai` wheel ships in its
package folder. Only the ONNX file and pipecat's numpy Whisper-feature module are used, found
through the installed distribution's record with nothing of pipecat imported: pipecat's
package imports its framework (loguru, aiohttp, numba, ...). Not a dependency of duplexbus:

    .venv/bin/pip install --no-deps pipecat-ai==1.14.0
    .venv/bin/python -m bench.turn_detector

Clips: the 8 sentences of `SAMPLE_SENTENCES`, said by the bundled piper voice. Complete: each
whole sentence and 0.2 s of silence (where the detector would be asked). Mid-sentence: each
sentence cut at the quietest 10 ms (a gap between words) in each of three spans of its speech
(25-45 %, 45-60 %, 60-80 %), then 0.2 s of silence: a caller who pauses there 400 ms is asked
about 0.2 s into the pause. A mid-sentence clip at or above the threshold is a false endpoint.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000
WINDOW_S = 8  # the model hears the turn's last 8 s
DIST = "pipecat-ai"
MODEL = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
FEATURES = "pipecat/audio/turn/smart_turn/_whisper_features.py"
INSTALL = "pip install --no-deps pipecat-ai==1.14.0"


def model_files() -> tuple[Path, Path]:
    """(the ONNX model, pipecat's feature module) in the installed pipecat-ai; where it is
    missing, the benchmark exits saying how to install it."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"this benchmark needs the {DIST} wheel's model: .venv/bin/{INSTALL}") from None
    files = Path(str(dist.locate_file(MODEL))), Path(str(dist.locate_file(FEATURES)))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"{DIST} {dist.version} lacks {', '.join(missing)}: .venv/bin/{INSTALL}")
    return files


def _features_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("duplexbus_smart_turn_features", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_window(pcm16: np.ndarray) -> np.ndarray:
    """The last WINDOW_S seconds as float32 in [-1, 1], zeros before a shorter clip."""
    n = WINDOW_S * SAMPLE_RATE
    x = pcm16[-n:].astype(np.float32) / 32768.0
    return np.pad(x, (n - len(x), 0)) if len(x) < n else x


class SmartTurn:
    """One loaded model; `finished(clips)` -> the probability that each turn has ended."""

    def __init__(self, threads: int = 1) -> None:
        import onnxruntime as ort

        model, features = model_files()
        self._log_mel = _features_module(features).compute_whisper_log_mel_features
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(model), sess_options=so, providers=["CPUExecutionProvider"])

    def finished(self, clips: Sequence[np.ndarray]) -> list[float]:
        """Each PCM16 clip (a turn so far, 16 kHz) heard once, in one batch."""
        if not clips:
            return []
        batch = np.stack([self._log_mel(last_window(c), do_normalize=True) for c in clips]).astype(np.float32)
        out: Any = self.session.run(None, {"input_features": batch})[0]
        return [float(p) for p in np.asarray(out).reshape(-1)]


def main() -> None:
    import time

    from bench.machine import machine
    from models.voice_assistant.clips import mid_sentence_cuts, piper_clips
    from models.voice_assistant.text import SAMPLE_SENTENCES

    print(f"machine: {machine()}")
    detector = SmartTurn()
    clips = piper_clips(SAMPLE_SENTENCES, SAMPLE_RATE)
    asked = np.zeros(int(0.2 * SAMPLE_RATE), dtype=np.int16)
    complete = [np.concatenate([c, asked]) for c in clips]
    cuts = [np.concatenate([c[:p], asked]) for c in clips for p in mid_sentence_cuts(c)]
    detector.finished(complete[:1])  # the session's first run is slower
    start = time.perf_counter()
    p_complete = [detector.finished([c])[0] for c in complete]
    per_turn_ms = (time.perf_counter() - start) / len(complete) * 1000
    p_cut = [detector.finished([c])[0] for c in cuts]
    print(f"one turn heard in {per_turn_ms:.0f} ms (one thread)")
    print("| threshold | complete turns ended at 0.2 s | mid-sentence pauses answered (false endpoints) |")
    print("|---|---|---|")
    for threshold in (0.5, 0.7, 0.9, 0.95):
        ended = sum(p >= threshold for p in p_complete)
        false = sum(p >= threshold for p in p_cut)
        print(f"| {threshold} | {ended} of {len(complete)} | {false} of {len(cuts)} ({100 * false / len(cuts):.0f} %) |")
    for i, s in enumerate(SAMPLE_SENTENCES):
        print(f"  {p_complete[i]:.2f} whole, {', '.join(f'{p:.2f}' for p in p_cut[3 * i : 3 * i + 3])} cut: {s}")


if __name__ == "__main__":
    main()
