"""`duplexbus up --frontends 2 --workers 2`: calls spread over frontends and workers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import nats
import numpy as np
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bench.stack import free_ports
from models.echo import FRAME
from shared.bus import subjects, wire
from tests.helpers import WS, echo_bytes, pcm_file


def wait_ready(port: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "duplexbus up exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not ready")


async def dones_by_worker(url: str) -> Counter[tuple[str, str]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        cfg = ConsumerConfig(filter_subject=subjects.done("*", "*"), deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
        info = await js.add_consumer(subjects.STREAM, cfg)
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=subjects.STREAM)
        out: Counter[tuple[str, str]] = Counter()
        for m in await sub.fetch(info.num_pending or 1, timeout=5):
            d = wire.decode_as(m.data, wire.Done)
            out[(d.partition, d.worker_id)] += 1
        return out
    finally:
        await nc.close()


@pytest.mark.parametrize("colocate", [False, True], ids=["worker-per-partition", "colocated"])
async def test_two_frontends_two_workers_per_partition(tmp_path: Path, colocate: bool) -> None:
    """`up --frontends 2 --workers 2`: calls spread over both workers of each partition. With
    `--colocate` the two worker processes each run both partitions."""
    port = free_ports(2)  # the second frontend takes port + 1
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    cmd = [sys.executable, "-m", "duplexbus.cli", "up", "--model", "echo", "--frontends", "2", "--workers", "2"]
    cmd += ["--port", str(port), "--run-dir", str(tmp_path / "run")] + (["--colocate"] if colocate else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        first = await asyncio.to_thread(proc.stdout.readline)  # "nats-server (embedded) on URL, store ..."
        url = first.split(" on ")[1].split(",")[0]
        await asyncio.to_thread(wait_ready, port, proc)
        await asyncio.to_thread(wait_ready, port + 1, proc)
        await asyncio.sleep(1.5)  # every worker has heartbeated
        sockets = [await WS.connect(f"ws://127.0.0.1:{p}/generate/ws") for p in (port, port + 1)]
        samples = (np.arange(10 * FRAME) % 9000).astype("<i2")

        async def call(i: int) -> None:
            ws = sockets[i % 2]
            rid = f"spread{i}"
            await ws.send({"request_id": rid, "files": [pcm_file(samples)]})
            await ws.send({"request_id": rid, "end_input": True})

        await asyncio.gather(*(call(i) for i in range(16)))
        for i in range(16):
            ws = sockets[i % 2]
            final = await ws.final(f"spread{i}", timeout=60)
            assert "finish" in final, final
            assert echo_bytes(ws.outputs(f"spread{i}")) == samples.tobytes()
        dones = await dones_by_worker(url)
        for part in ("Encoder", "Talker"):
            per_worker = [n for (p, _), n in dones.items() if p == part]
            assert len(per_worker) == 2, dones  # both workers of the partition took calls
            assert sum(per_worker) == 16 and min(per_worker) >= 4, dones
        workers_of = {part: {w for (p, w) in dones if p == part} for part in ("Encoder", "Talker")}
        assert (workers_of["Encoder"] == workers_of["Talker"]) is colocate, dones
        for ws in sockets:
            await ws.close()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(40)
