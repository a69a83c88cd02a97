"""Batching benchmark of `tiny_duplex`: frames per second, batched against unbatched.

For each number of concurrent calls N and each mode, opens N calls on one `Duplex`
partition and gives them caches of different lengths (call i is prefilled with about
(i + 1) * context / N frames, as if the calls had joined at different times), then
times steps of one 80 ms PCM16 frame per call: `partition.step(batch)` (one forward
pass for all N calls) against `partition.step_unbatched(batch)` (one forward pass per
call). Both modes start from the same caches (each on its own calls and slots) and
their timed runs alternate, so a load spike hits both. Reports the median of `--runs`
timed runs after `--warmup` untimed ones.

    .venv/bin/python bench/batching.py                      # cuda if available, else cpu
    .venv/bin/python bench/batching.py --device cpu --json results.json

"x real time" is frames/s over N * 12.5 (each call sends 12.5 frames/s): at 1 or more,
the partition keeps up with N live calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/batching.py` finds `bench`

from bench.machine import machine
from models.tiny_duplex import FRAME, TinyDuplexModel, TinyDuplexPartition
from shared.sdk.chunking import Chunk, Item
from shared.sdk.model import CallInfo, StepInput

FRAMES_PER_SECOND_PER_CALL = 16_000 / FRAME  # 12.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--calls", default="1,8,32,64", help="comma-separated concurrent call counts")
    ap.add_argument("--steps", type=int, default=10, help="steps (frames per call) in one timed run")
    ap.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--window", type=int, default=1024, help="KV positions kept per call")
    ap.add_argument("--context", type=int, default=None, help="longest prefilled cache (default: the window)")
    ap.add_argument("--modes", default="batched,unbatched")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    return ap.parse_args(argv)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill_lengths(n: int, context: int) -> list[int]:
    return [max(1, round((i + 1) * context / n)) for i in range(n)]


def open_calls(p: TinyDuplexPartition, prefix: str, n: int, context: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)  # the same caches for every mode
    cids = [f"{prefix}-{i:03d}" for i in range(n)]
    for cid, length in zip(cids, prefill_lengths(n, context), strict=True):
        p.open_call(CallInfo(cid))
        p.prefill(cid, rng.uniform(-0.5, 0.5, (length, FRAME)).astype(np.float32))
    return cids


def make_batches(cids: list[str], steps: int, rng: np.random.Generator) -> list[list[StepInput]]:
    """`steps` batches of one PCM16 frame per call, as the worker hands them to the partition."""
    batches = []
    for _ in range(steps):
        pcm = rng.integers(-8000, 8000, (len(cids), FRAME), dtype=np.int16)
        batches.append([StepInput(cid, {"audio_in": Chunk([Item(pcm[i])], first_seq=0)}) for i, cid in enumerate(cids)])
    return batches


def bench_calls(p: TinyDuplexPartition, n: int, modes: list[str], args: argparse.Namespace, context: int) -> list[dict[str, Any]]:
    """Time `modes` at n calls. Each mode has its own n calls (own slots, same prefilled
    caches) and the modes' timed runs alternate, so a load spike on the machine hits
    them alike."""
    rng = np.random.default_rng(args.seed + 1)
    calls = {mode: open_calls(p, mode, n, context, args.seed) for mode in modes}
    steps = {"batched": p.step, "unbatched": p.step_unbatched}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for run in range(args.warmup + args.runs):
        for mode in modes:
            batches = make_batches(calls[mode], args.steps, rng)
            sync(args.device)
            t0 = time.perf_counter()
            for batch in batches:
                out = steps[mode](batch)
                assert len(out) == n
            sync(args.device)
            if run >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    for cids in calls.values():
        for cid in cids:
            p.close_call(cid)
    results = []
    for mode in modes:
        fps = [n * args.steps / t for t in times[mode]]
        med = statistics.median(fps)
        results.append(
            {
                "calls": n,
                "mode": mode,
                "frames_per_s": med,
                "frames_per_s_runs": fps,
                "ms_per_step": 1000 * n / med,
                "x_real_time": med / (n * FRAMES_PER_SECOND_PER_CALL),
                "prefill_lengths": [min(prefill_lengths(n, context)), max(prefill_lengths(n, context))],
            }
        )
    return results


def machine_info(device: str) -> dict[str, Any]:
    """bench.machine.machine(), with torch's version and threads, the load average and the GPU if one is used."""
    info: dict[str, Any] = {
        "host": machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_before": os.getloadavg(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def table(results: list[dict[str, Any]]) -> str:
    by = {(r["calls"], r["mode"]): r for r in results}
    calls = sorted({r["calls"] for r in results})
    lines = [
        "| calls | batched frames/s | unbatched frames/s | speedup | batched ms/step | unbatched ms/step "
        "| batched x real time | unbatched x real time |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(n: int, mode: str, key: str, fmt: str) -> str:
        r = by.get((n, mode))
        return format(r[key], fmt) if r else "-"

    for n in calls:
        b, u = by.get((n, "batched")), by.get((n, "unbatched"))
        speedup = f"{b['frames_per_s'] / u['frames_per_s']:.2f}x" if b and u else "-"
        lines.append(
            f"| {n} | {cell(n, 'batched', 'frames_per_s', ',.0f')} | {cell(n, 'unbatched', 'frames_per_s', ',.0f')} "
            f"| {speedup} | {cell(n, 'batched', 'ms_per_step', '.1f')} | {cell(n, 'unbatched', 'ms_per_step', '.1f')} "
            f"| {cell(n, 'batched', 'x_real_time', '.2f')} | {cell(n, 'unbatched', 'x_real_time', '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    calls = [int(c) for c in args.calls.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if not set(modes) <= {"batched", "unbatched"}:
        raise SystemExit(f"--modes: batched and/or unbatched, got {args.modes!r}")
    context = args.context or args.window
    if not 1 <= context <= 100_000:
        raise SystemExit("--context must be >= 1")
    model = TinyDuplexModel(device=args.device, dtype=args.dtype, window=args.window, max_calls=len(modes) * max(calls), seed=0)
    p = model.create_partition("Duplex")
    assert isinstance(p, TinyDuplexPartition)
    cfg = model.config
    print(
        f"tiny_duplex on {p.device} ({args.dtype}): d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"window {cfg.window}, KV pool {p.kv_pool_bytes / 2**20:.0f} MiB for {cfg.max_calls} calls; "
        f"caches prefilled up to {context}; {args.steps} steps x {args.runs} runs after {args.warmup} warm-up",
        flush=True,
    )
    info = machine_info(p.device)
    print(f"machine: {info['host']}", flush=True)
    results = []
    for n in calls:
        for r in bench_calls(p, n, modes, args, context):
            results.append(r)
            mode = r["mode"]
            print(
                f"  {n:>3} calls {mode:>9}: {r['frames_per_s']:>9,.0f} frames/s  {r['ms_per_step']:7.1f} ms/step",
                flush=True,
            )
    print()
    print(table(results))
    if args.json_path:
        doc = {
            "benchmark": "tiny_duplex batching",
            "command": " ".join([".venv/bin/python", "bench/batching.py", *(sys.argv[1:] if argv is None else argv)]),
            "device": p.device,
            "dtype": args.dtype,
            "machine": info,
            "config": {k: getattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "vocab", "window", "max_calls")},
            "context": context,
            "steps": args.steps,
            "runs": args.runs,
            "warmup": args.warmup,
            "results": results,
            "load_avg_after": os.getloadavg(),
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
