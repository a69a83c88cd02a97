"""Real-time factor of each `voice_assistant` partition at 1, 4 and 8 concurrent calls.

Each call is the same spoken dialogue: `--turns` piper-synthesized sentences (16 kHz,
0.5 s of silence before, `--gap` seconds between, 1 s after), so that each reply has
been spoken before the next turn starts. The calls run through `LocalPipeline` (the
worker's engine cores, wired in memory) on a simulated clock: client audio arrives
one 80 ms frame per call every 80 ms of simulated time, every partition is stepped
each 20 ms, and the Talker paces against the same clock. All calls start together,
so the Listener steps them as one batch. Each partition's `step` is timed with a
wall clock; the Talker synthesizes inline (`synth_threads=0`) so its synthesis is
counted in its steps; the Recognizer's decoders are built before the runs
(`warm_decoders`), so building them (~0.5 s each) is not counted.

    .venv/bin/python bench/voice_assistant_rtf.py                 # 1, 4 and 8 calls
    .venv/bin/python bench/voice_assistant_rtf.py --calls 1 2 --turns 2 --json rtf.json

Columns: `proc s`, the partition's step time for all the calls; `RTF/call`, that over
the calls' total audio (calls x call seconds): below 1, one core processes a call
faster than it is spoken; `load`, that over one call's seconds: the share of one
core the partition needs to keep up with that many live calls. The Talker's
`RTF/out` is its step time over the reply audio it produced.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/voice_assistant_rtf.py` finds `bench`

from bench.machine import machine
from clients.eval.metrics import word_error_rate
from models.voice_assistant import FRAME, SAMPLE_RATE, VoiceAssistantModel
from models.voice_assistant.audio import silence
from models.voice_assistant.clips import piper_clips
from models.voice_assistant.text import SAMPLE_SENTENCES
from shared.sdk.chunking import Item
from shared.sdk.model import CallInfo, Emission, Partition, StepInput

SENTENCES = [SAMPLE_SENTENCES[i] for i in (1, 2, 4, 3, 6, 7)]
TICK = 0.02


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Timed(Partition):
    """A partition whose step time is summed."""

    def __init__(self, inner: Partition) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.steps = 0
        self.batch_sizes: list[int] = []

    def open_call(self, call: CallInfo) -> None:
        self.inner.open_call(call)

    def step(self, batch: list[StepInput]) -> list[Emission]:
        t = time.perf_counter()
        out = self.inner.step(batch)
        self.seconds += time.perf_counter() - t
        self.steps += 1
        self.batch_sizes.append(len(batch))
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        return self.inner.close_call(cid)

    def wants_step(self, cid: str) -> bool:
        return self.inner.wants_step(cid)

    def drop_call(self, cid: str) -> None:
        self.inner.drop_call(cid)


def dialogue(turns: int, gap: float, seed: int) -> tuple[np.ndarray, list[str]]:
    said = [SENTENCES[i % len(SENTENCES)] for i in range(turns)]
    parts: list[np.ndarray] = [silence(0.5, SAMPLE_RATE)]
    for i, clip in enumerate(piper_clips(said, SAMPLE_RATE, seed)):
        parts += [clip, silence(gap if i < turns - 1 else 1.0, SAMPLE_RATE)]
    return np.concatenate(parts), said


def run(n_calls: int, audio: np.ndarray, said: list[str], parts: dict[str, Partition]) -> dict[str, Any]:
    from services.worker.engine import LocalPipeline

    clock = FakeClock()
    timed = {name: Timed(p) for name, p in parts.items()}
    for p in parts.values():
        if hasattr(p, "clock"):
            p.clock = clock  # the Talker paces against the simulated clock

    class Loaded(VoiceAssistantModel):
        def create_partition(self, name: str) -> Partition:
            return timed[name]

    pl = LocalPipeline(Loaded(clock=clock))
    frames = [audio[i : i + FRAME] for i in range(0, len(audio), FRAME)]
    frames[-1] = np.pad(frames[-1], (0, FRAME - len(frames[-1])))
    cids = [f"bench-{n_calls}-{i}" for i in range(n_calls)]
    for cid in cids:
        pl.open(cid)
    start, fed = clock(), 0
    wall = time.perf_counter()
    while not all(pl.finished(c) for c in cids):
        while fed < len(frames) and start + (fed + 1) * 0.08 <= clock() + 1e-9:
            for cid in cids:
                pl.push(cid, "audio_in", fed, Item(frames[fed]))
            fed += 1
            if fed == len(frames):
                for cid in cids:
                    pl.end(cid, "audio_in", fed)
        pl.run_once()
        clock.t += TICK
        if clock.t - start > 10 * len(audio) / SAMPLE_RATE + 60:
            raise RuntimeError("the calls did not finish")
    wall = time.perf_counter() - wall
    call_s = len(audio) / SAMPLE_RATE
    errors = [e for c in cids for e in pl.result(c).errors]
    if errors:
        raise RuntimeError(f"calls failed: {errors}")
    usage = [pl.result(c).usage for c in cids]
    finals = [[d["text"] for _, d in pl.result(c).outputs if d["type"] == "transcript" and d["final"]] for c in cids]
    refs = [s for _ in cids for s in said]
    hyps = [h for f in finals for h in f]
    wer = word_error_rate(refs, hyps)[0] if len(hyps) == len(refs) else None
    out_s = sum(u["Talker"]["audio_out_s"] for u in usage)
    rows: dict[str, dict[str, Any]] = {}
    for name, t in timed.items():
        rows[name] = {
            "proc_s": round(t.seconds, 3),
            "rtf_per_call": round(t.seconds / (n_calls * call_s), 4),
            "load": round(t.seconds / call_s, 4),
            "steps": t.steps,
            "mean_batch": round(float(np.mean(t.batch_sizes)) if t.batch_sizes else 0.0, 2),
        }
    rows["Talker"]["rtf_out"] = round(timed["Talker"].seconds / out_s, 4) if out_s else None
    return {
        "calls": n_calls,
        "call_audio_s": round(call_s, 2),
        "reply_audio_s": round(out_s, 2),
        "wall_s": round(wall, 2),
        "wer": None if wer is None else round(wer, 3),
        "transcripts": finals[0],
        "partitions": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--gap", type=float, default=4.0, help="silence between sentences (s)")
    ap.add_argument("--seed", type=int, default=20_240_601)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    audio, said = dialogue(args.turns, args.gap, args.seed)
    t = time.perf_counter()
    model = VoiceAssistantModel(
        recognizer_options={"warm_decoders": max(args.calls)},
        talker_options={"synth_threads": 0, "inline_per_step": 1},
    )
    parts = {p: model.create_partition(p) for p in model.topology.partitions}
    load_s = time.perf_counter() - t
    host = machine()
    print(f"machine: {host}")
    print(
        f"voice_assistant RTF: call = {len(audio) / SAMPLE_RATE:.1f} s, {args.turns} turns; partitions loaded in {load_s:.1f} s"
    )
    results = []
    header = f"{'calls':>5} {'partition':<11} {'proc s':>8} {'RTF/call':>9} {'load':>7} {'batch':>6} {'RTF/out':>8}"
    print(header)
    print("-" * len(header))
    for n in args.calls:
        r = run(n, audio, said, parts)
        results.append(r)
        for name, row in r["partitions"].items():
            rtf_out = f"{row['rtf_out']:.3f}" if row.get("rtf_out") is not None else ""
            print(
                f"{n:>5} {name:<11} {row['proc_s']:>8.2f} {row['rtf_per_call']:>9.3f} {row['load']:>7.3f} "
                f"{row['mean_batch']:>6.1f} {rtf_out:>8}"
            )
        total = sum(row["proc_s"] for row in r["partitions"].values())
        print(
            f"{n:>5} {'all':<11} {total:>8.2f} {total / (n * r['call_audio_s']):>9.3f} "
            f"{total / r['call_audio_s']:>7.3f}   (wall {r['wall_s']:.1f} s, WER {r['wer']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": host, "call_audio_s": len(audio) / SAMPLE_RATE, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
