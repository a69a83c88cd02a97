"""Run every benchmark in turn (the figures in docs/performance.md come from these).

.venv/bin/python bench/run_all.py            # or: make bench
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCHES = [
    ["-m", "bench.live_load", "--calls", "1,50,200", "--seconds", "10"],
    ["-m", "bench.live_load", "--calls", "100,200,300,400", "--seconds", "10"],
    ["-m", "bench.ordinary_load", "--calls", "200,300", "--seconds", "10"],
    ["-m", "bench.conductor_load", "--appends", "10,100,1000"],
    ["-m", "bench.jetstream_cost", "--calls", "10000"],
    ["bench/batching.py"],
    ["bench/voice_assistant_rtf.py"],
    ["-m", "bench.voice_latency"],
    ["-m", "bench.fast_call"],
    ["-m", "bench.realtime_load", "--sessions", "20", "--seconds", "10"],
    ["-m", "bench.replay_speed"],
    ["-m", "bench.frame_codec"],
    ["-m", "bench.nats_py_paths"],
    ["-m", "bench.worker_path"],
    ["-m", "bench.cluster_cost", "--calls", "100,150,200,250,300,350", "--seconds", "8"],
    ["-m", "bench.confirm_cost", "--messages", "100000"],
    ["-m", "bench.janitor", "--calls", "9000", "--items", "25"],
    ["-m", "bench.kv_markers", "--ended", "100000"],
    ["-m", "bench.gateway_cost", "--calls", "1,20,50", "--appends", "200"],  # needs Docker: scripts/docker.sh prepare
]


def main() -> int:
    failed = 0
    for args in BENCHES:
        print(f"\n$ python {' '.join(args)}", flush=True)
        failed += subprocess.call([sys.executable, *args], cwd=ROOT) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
