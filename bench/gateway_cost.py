"""What the compose gateway (HAProxy) costs: echo latency per append through it, against the
same calls straight to the frontend container, and the gateway's CPU time.

    python -m bench.gateway_cost --calls 1,20 --appends 200

Brings up its own compose project (model echo, one frontend, one worker; the frontend's
port also published on loopback for the direct path), runs the calls one path after the
other, and takes it down again with its volumes. Needs `scripts/docker.sh prepare` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import websockets

from models.echo import FRAME
from shared.bus.embedded import free_port
from shared.runtime.stats import percentile
from shared.sdk.audio import b64_pcm16

ROOT = Path(__file__).resolve().parent.parent
OVERRIDE = 'services:\n  frontend:\n    ports: ["127.0.0.1::8000"]\n'
APPEND_S = FRAME / 16000


async def one_call(url: str, rid: str, appends: int) -> list[float]:
    """Send `appends` frames in real time; the time from each send to its echo, in ms."""
    frame = b64_pcm16(np.full(FRAME, 1000, dtype="<i2"))
    sent: dict[int, float] = {}
    lat: list[float] = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"request_id": rid, "model": "echo"}))

        async def reader() -> None:
            async for raw in ws:
                m = json.loads(raw)
                if "output" in m:
                    lat.append((time.perf_counter() - sent[m["output"]["frame"]]) * 1000)
                elif "finish" in m or "error" in m:
                    return

        task = asyncio.create_task(reader())
        t0 = time.perf_counter()
        for k in range(appends):
            sent[k] = time.perf_counter()
            await ws.send(json.dumps({"request_id": rid, "append": [{"name": "a.pcm", "data": frame}]}))
            await asyncio.sleep(max(0.0, t0 + (k + 1) * APPEND_S - time.perf_counter()))
        await ws.send(json.dumps({"request_id": rid, "end_input": True}))
        await asyncio.wait_for(task, 60)
    return lat


async def run_path(url: str, calls: int, appends: int, tag: str) -> list[float]:
    results = await asyncio.gather(*(one_call(url, f"{tag}-{i}", appends) for i in range(calls)))
    return [x for r in results for x in r]


def cpu_ns(container: str) -> int | None:
    """The container's CPU time so far (cgroup v1 or v2), or None where neither is readable."""
    full = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", container], capture_output=True, text=True).stdout.strip()
    v1, v2 = f"/sys/fs/cgroup/cpuacct/docker/{full}/cpuacct.usage", f"/sys/fs/cgroup/system.slice/docker-{full}.scope/cpu.stat"
    for path in (v1, v2):
        p = Path(path)
        if p.exists():
            text = p.read_text()
            if path.endswith("cpu.stat"):
                return int(text.split("usage_usec ", 1)[1].split()[0]) * 1000
            return int(text)
    return None


def busy(before: int | None, after: int | None, t0: float) -> str:
    if before is None or after is None:
        return "?"
    return f"{(after - before) / 1e9 / (time.perf_counter() - t0) * 100:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="1,20", help="concurrent calls, comma-separated runs")
    ap.add_argument("--appends", type=int, default=200, help="80 ms appends per call")
    args = ap.parse_args()
    compose = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or "docker-compose"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXBUS_", "NATS_", "COMPOSE_"))}
    env.update(DUPLEXBUS_PORT=str(port), DUPLEXBUS_MODEL="echo")
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as override:
        override.write(OVERRIDE)
        override.flush()
        base = [compose, "-p", f"dbxbench{os.getpid()}", "-f", str(ROOT / "docker-compose.yml"), "-f", override.name]
        try:
            subprocess.run([*base, "up", "-d", "--wait", "--wait-timeout", "300"], env=env, check=True, capture_output=True)
            direct = subprocess.run([*base, "port", "frontend", "8000"], env=env, check=True, capture_output=True, text=True)
            paths = {"gateway": port, "direct": int(direct.stdout.strip().rsplit(":", 1)[1])}
            gw = subprocess.run([*base, "ps", "-q", "gateway"], env=env, capture_output=True, text=True).stdout.strip()
            print("| calls | path | echoes | echo latency p50 ms | p99 ms | gateway CPU, % of a core |")
            print("|---|---|---|---|---|---|")
            asyncio.run(run_path(f"ws://127.0.0.1:{paths['gateway']}/generate/ws", 2, 20, "warm"))  # connections, caches
            before, t0 = cpu_ns(gw), time.perf_counter()
            time.sleep(10)
            print(f"| 0 | gateway | 0 | - | - | {busy(before, cpu_ns(gw), t0)} |")  # health checks, DNS
            for calls in (int(c) for c in args.calls.split(",")):
                for name, p in paths.items():
                    before, t0 = cpu_ns(gw), time.perf_counter()
                    lat = asyncio.run(run_path(f"ws://127.0.0.1:{p}/generate/ws", calls, args.appends, f"{name}{calls}"))
                    cost = busy(before, cpu_ns(gw), t0)
                    p50, p99 = percentile(lat, 50) or 0.0, percentile(lat, 99) or 0.0
                    print(f"| {calls} | {name} | {len(lat)} | {p50:.2f} | {p99:.2f} | {cost} |")
        finally:
            subprocess.run([*base, "down", "-v", "--timeout", "20"], env=env, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
