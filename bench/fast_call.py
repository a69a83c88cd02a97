"""Faster than real time: a 10-minute recording sent as fast as possible, time to the finish.

Starts `duplexbus up --model MODEL` (embedded NATS, the conductor, one frontend, one
worker process per partition) and runs one call at a time as `duplexbus call --fast`
does (`clients.call.stream_call`: 80 ms appends, no pacing, then end of input), timing it
from the opening to the finish. The real-time factor is that time over the recording's
length: below 1, the call is served faster than it was spoken. Worker flow control keeps
each worker's share of the input bounded meanwhile (docs/architecture.md, "Flow control
from the stream"): the peak RSS of the worker processes is sampled every 50 ms.

- echo: seeded white noise (every frame comes back; checked byte for byte).
- voice_assistant: piper-spoken sentences, one every `--every-s` seconds (silence between).

    .venv/bin/python -m bench.fast_call                              # echo and voice_assistant, 3 runs each
    .venv/bin/python -m bench.fast_call --models echo --minutes 1 --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from bench.machine import machine
from clients.call import stream_call
from tests.support.bus import worker_stats
from tests.support.stack import PeakRSS, UpStack

RATE = 16_000


def recording(model: str, seconds: float, every_s: float) -> np.ndarray:
    if model == "echo":
        return np.random.default_rng(7).integers(-32768, 32767, int(seconds * RATE), dtype=np.int64).astype("<i2")
    from models.voice_assistant.audio import silence
    from models.voice_assistant.clips import piper_clips
    from models.voice_assistant.text import SAMPLE_SENTENCES

    clips = piper_clips(SAMPLE_SENTENCES, RATE)
    parts: list[np.ndarray] = []
    k = 0
    while (k + 1) * every_s <= seconds:
        clip = clips[k % len(clips)]
        parts += [silence(0.5, RATE), clip, silence(max(0.0, every_s - 0.5 - len(clip) / RATE), RATE)]
        k += 1
    audio = np.concatenate(parts)
    return np.concatenate([audio, silence(seconds - len(audio) / RATE, RATE)]) if len(audio) < seconds * RATE else audio


async def one_call(stack: UpStack, audio: np.ndarray) -> tuple[float, dict[str, Any], float]:
    """(seconds to the finish, the result, peak RSS in MiB of the worker processes, each at its peak)."""
    workers = [pid for pid, role in stack.processes().items() if role.startswith("worker")]
    t0 = time.monotonic()
    async with PeakRSS(workers) as rss:
        result = await stream_call(stack.ws_url(), audio, RATE, fast=True)
    return time.monotonic() - t0, result, sum(rss.peak.values())


async def run_model(model: str, seconds: float, runs: int, every_s: float) -> dict[str, Any]:
    audio = recording(model, seconds, every_s)
    times, rss, outputs, pauses = [], [], [], 0
    with await asyncio.to_thread(UpStack, model) as stack:
        idle = sum(PeakRSS([p for p, role in stack.processes().items() if role.startswith("worker")]).idle.values())
        for i in range(runs):
            elapsed, result, peak = await one_call(stack, audio)
            final = result["final"] or {}
            if "finish" not in final:
                raise SystemExit(f"{model} run {i + 1}: the call did not finish: {final}")
            if model == "echo":
                import base64

                got = b"".join(base64.b64decode(o["audio"]) for o in result["outputs"])
                assert got == audio.tobytes()[: len(got)] and len(result["outputs"]) == len(audio) // 1280, "echo mismatch"
            times.append(elapsed)
            rss.append(peak)
            outputs.append(len(result["outputs"]))
            print(f"{model} run {i + 1}: {elapsed:.1f}s to the finish (RTF {elapsed / seconds:.3f}), {outputs[-1]} outputs")
        pauses = sum(w.get("pauses", 0) for w in await worker_stats(stack.nats_url))
    return {
        "model": model,
        "median_s": statistics.median(times),
        "runs": times,
        "outputs": outputs[0],
        "rss_idle": idle,
        "rss_peak": max(rss),
        "pauses": pauses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["echo", "voice_assistant"])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--every-s", type=float, default=6.0, help="voice_assistant: one sentence every so many seconds")
    args = ap.parse_args()
    seconds = args.minutes * 60
    rows = [asyncio.run(run_model(m, seconds, args.runs, args.every_s)) for m in args.models]
    print(f"machine: {machine()}")
    print(
        "| model | recording | runs | to the finish, median | real-time factor | outputs | workers' RSS idle -> peak | pauses |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{t:.1f}" for t in r["runs"])
        print(
            f"| {r['model']} | {args.minutes:g} min | {runs} s | {r['median_s']:.1f} s | {r['median_s'] / seconds:.3f} "
            f"| {r['outputs']} | {r['rss_idle']:.0f} -> {r['rss_peak']:.0f} MB | {r['pauses']} |"
        )


if __name__ == "__main__":
    main()
