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
    .venv/bin/python -m bench.fast_call --models echo --at-once 20 --runs 1   # twenty uploads together
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import time
import urllib.request
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

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


async def one_run(stack: UpStack, audio: np.ndarray, at_once: int) -> tuple[float, list[dict[str, Any]], float]:
    """`at_once` calls of `audio` started together: (seconds to the last finish, their results,
    peak RSS in MiB of the worker processes, each at its peak)."""
    workers = [pid for pid, role in stack.processes().items() if role.startswith("worker")]
    t0 = time.monotonic()
    async with PeakRSS(workers) as rss:
        results = await asyncio.gather(*(stream_call(stack.ws_url(), audio, RATE, fast=True) for _ in range(at_once)))
    return time.monotonic() - t0, list(results), sum(rss.peak.values())


def finished(model: str, run: int, audio: np.ndarray, result: dict[str, Any]) -> bool:
    """Whether the call finished (said where not); echo's outputs are checked byte for byte."""
    final = result["final"] or {}
    if "finish" not in final:
        print(f"{model} run {run}: a call did not finish: {final}")
        return False
    if model == "echo":
        got = b"".join(base64.b64decode(o["audio"]) for o in result["outputs"])
        assert got == audio.tobytes()[: len(got)] and len(result["outputs"]) == len(audio) // 1280, "echo mismatch"
    return True


def loop_lag(metrics: str) -> tuple[int, int, int]:
    """(timer probes of the frontend's loop, those later than 0.25 s, than 1 s), from its /metrics."""
    buckets = {
        s.labels["le"]: int(s.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "duplexbus_frontend_loop_lag_seconds"
        for s in family.samples
        if s.name.endswith("_bucket")
    }
    total = buckets.get("+Inf", 0)
    return total, total - buckets.get("0.25", 0), total - buckets.get("1.0", 0)


async def run_model(model: str, seconds: float, runs: int, every_s: float, at_once: int) -> dict[str, Any]:
    audio = recording(model, seconds, every_s)
    times, rss, outputs, done, pauses = [], [], [], [], 0
    with await asyncio.to_thread(UpStack, model) as stack:
        idle = sum(PeakRSS([p for p, role in stack.processes().items() if role.startswith("worker")]).idle.values())
        before = loop_lag(await asyncio.to_thread(scrape, stack.http_url() + "/metrics"))
        for i in range(runs):
            elapsed, results, peak = await one_run(stack, audio, at_once)
            done.append(sum(finished(model, i + 1, audio, r) for r in results))
            times.append(elapsed)
            rss.append(peak)
            outputs.append(max(len(r["outputs"]) for r in results))
            rtf = elapsed / seconds
            print(f"{model} run {i + 1}: {done[-1]} of {at_once} finished, {elapsed:.1f}s to the last end (RTF {rtf:.3f})")
        after = loop_lag(await asyncio.to_thread(scrape, stack.http_url() + "/metrics"))
        pauses = sum(w.get("pauses", 0) for w in await worker_stats(stack.nats_url))
    return {
        "model": model,
        "median_s": statistics.median(times),
        "runs": times,
        "outputs": outputs[0],
        "rss_idle": idle,
        "rss_peak": max(rss),
        "pauses": pauses,
        "late": tuple(a - b for a, b in zip(after, before, strict=True)),
        "done": done,
    }


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["echo", "voice_assistant"])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--every-s", type=float, default=6.0, help="voice_assistant: one sentence every so many seconds")
    ap.add_argument("--at-once", type=int, default=1, help="calls sent together in each run (each timed to the last finish)")
    args = ap.parse_args()
    seconds = args.minutes * 60
    rows = [asyncio.run(run_model(m, seconds, args.runs, args.every_s, args.at_once)) for m in args.models]
    print(f"machine: {machine()}")
    print(
        "| model | recording | at once | finished | runs | to the last end, median | real-time factor | outputs each "
        "| workers' RSS idle -> peak | pauses | frontend loop later than 0.25 s, 1 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{t:.1f}" for t in r["runs"])
        probes, late, later = r["late"]
        print(
            f"| {r['model']} | {args.minutes:g} min | {args.at_once} | {', '.join(map(str, r['done']))} | {runs} s "
            f"| {r['median_s']:.1f} s "
            f"| {r['median_s'] / seconds:.3f} | {r['outputs']} | {r['rss_idle']:.0f} -> {r['rss_peak']:.0f} MB "
            f"| {r['pauses']} | {late}, {later} of {probes} probes |"
        )


if __name__ == "__main__":
    main()
