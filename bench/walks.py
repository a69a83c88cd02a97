"""Walks benchmark of `tiny_duplex`: uploads among live calls, with and without the prefill walk.

Each run streams `--live` live calls one 80 ms frame per tick for `--ticks` ticks, and
`--uploads` one-shot calls of `--upload-frames` frames arrive at even intervals among them
(all their frames at once, as a one-shot upload's are). After each tick's input the model's
engines step until they have no work left (`LocalPipeline`, in one process, no bus): the
tick's time is what the live calls wait for that tick's answers. Three layouts of the same
weights, each over the same frames:

- `one partition`: the served default, `Duplex` alone, one frame per call per step
  (an upload's T frames are T steps);
- `prefill, no walk`: `prefill=True` with the `frames` edge's consumer_walk taken away:
  Duplex finds the backlogs by their mark, so one step may run a prefill and a decode pass;
- `prefill, walks`: `prefill=True` as it is: every Duplex step runs one kind of pass.

Reports, per layout, the medians over `--runs` runs (after one warm-up run): wall time,
frames per second, Duplex steps, the steps that ran two kinds of pass, and the tick times.

    .venv/bin/python bench/walks.py                 # cuda if available, else cpu
    .venv/bin/python bench/walks.py --device cpu --runs 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/walks.py` finds `bench`

from bench.machine import machine
from models.tiny_duplex import EDGE, FRAME, PARTITION, TinyDuplexModel, TinyDuplexPartition
from services.worker.engine import LocalPipeline
from shared.sdk.chunking import Item
from shared.sdk.model import Emission, StepInput
from shared.sdk.topology import PartitionTopology

LAYOUTS = ("one partition", "prefill, no walk", "prefill, walks")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--live", type=int, default=16, help="live calls, one frame per tick each")
    ap.add_argument("--ticks", type=int, default=40, help="ticks (frames per live call)")
    ap.add_argument("--uploads", type=int, default=4, help="one-shot calls arriving among them")
    ap.add_argument("--upload-frames", type=int, default=64, help="frames per upload (80 ms each)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per layout; medians are reported")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return ap.parse_args(argv)


def model_for(layout: str, args: argparse.Namespace) -> TinyDuplexModel:
    model = TinyDuplexModel(device=args.device, max_calls=args.live + args.uploads, prefill=layout != "one partition")
    if layout == "prefill, no walk":
        topo = model.topology
        unwalked = [dataclasses.replace(c, consumer_walk=None) for c in topo.connections]
        model.topology = PartitionTopology(topo.partitions, unwalked)
    return model


@dataclasses.dataclass
class Steps:
    """What Duplex's steps ran: per step, calls prefilled and calls decoded."""

    kinds: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def watch(self, part: TinyDuplexPartition) -> None:
        step = part.step

        def counted(batch: list[StepInput]) -> list[Emission]:
            prefill, decode = part.plan(batch)
            self.kinds.append((len(prefill), len(decode)))
            return step(batch)

        part.step = counted  # type: ignore[method-assign]


def one_run(model: TinyDuplexModel, args: argparse.Namespace, frames: np.ndarray) -> dict[str, Any]:
    pipe = LocalPipeline(model)
    part = pipe.engines[PARTITION].partition
    assert isinstance(part, TinyDuplexPartition)
    steps = Steps()
    steps.watch(part)
    live = [f"live{i}" for i in range(args.live)]
    arrivals = {(k * args.ticks) // args.uploads: f"upload{k}" for k in range(args.uploads)}
    for cid in live:
        pipe.open(cid)
    ticks: list[float] = []
    start = time.perf_counter()
    for t in range(args.ticks):
        t0 = time.perf_counter()
        for i, cid in enumerate(live):
            pipe.push(cid, EDGE, t, Item(frames[(i + t) % len(frames)]))
        if (up := arrivals.get(t)) is not None:
            pipe.open(up)
            for seq in range(args.upload_frames):
                pipe.push(up, EDGE, seq, Item(frames[seq % len(frames)]))
            pipe.end(up, EDGE, args.upload_frames)
        while pipe.run_once():
            pass
        ticks.append(time.perf_counter() - t0)
    for cid in live:
        pipe.end(cid, EDGE, args.ticks)
    while pipe.run_once():
        pass
    wall = time.perf_counter() - start
    calls = [*live, *arrivals.values()]
    assert all(pipe.finished(c) and not pipe.errors[c] for c in calls)
    tokens = {c: [d["token"] for _, d in pipe.result(c).outputs] for c in calls}
    n_frames = args.live * args.ticks + args.uploads * args.upload_frames
    assert sum(len(v) for v in tokens.values()) == n_frames
    return {
        "wall_s": wall,
        "frames_per_s": n_frames / wall,
        "steps": len(steps.kinds),
        "mixed_steps": sum(1 for p, d in steps.kinds if p and d),
        "prefilled": part.prefilled,
        "tick_p50_ms": statistics.median(ticks) * 1000,
        "tick_max_ms": max(ticks) * 1000,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    frames = np.round(rng.uniform(-0.5, 0.5, (97, FRAME)) * 32767).astype("<i2")
    print(
        f"tiny_duplex on {args.device}: {args.live} live calls x {args.ticks} ticks, {args.uploads} uploads of "
        f"{args.upload_frames} frames; medians of {args.runs} runs after 1 warm-up\nmachine: {machine()}",
        flush=True,
    )
    models = {layout: model_for(layout, args) for layout in LAYOUTS}
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    for r in range(args.runs + 1):  # layouts alternate, so a load spike hits each
        for layout in LAYOUTS:
            result = one_run(models[layout], args, frames)
            if r:
                runs[layout].append(result)
    reference = runs[LAYOUTS[0]][0]["tokens"]
    same = all(run["tokens"] == reference for rs in runs.values() for run in rs)
    print("\n| layout | wall s | frames/s | Duplex steps | steps with both | frames prefilled | tick p50 ms | tick max ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for layout, rs in runs.items():

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(r[key] for r in rs))

        print(
            f"| {layout} | {med('wall_s'):.2f} | {med('frames_per_s'):,.0f} | {med('steps'):.0f} | {med('mixed_steps'):.0f} | "
            f"{med('prefilled'):.0f} | {med('tick_p50_ms'):.1f} | {med('tick_max_ms'):.1f} |"
        )
    print(f"\nthe same tokens in every layout and run: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
