"""`duplexbus up --frontends 2 --workers 2`: calls spread over frontends and workers."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import nats
import numpy as np
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from models.echo import FRAME
from shared.bus import subjects, wire
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS
from tests.support.stack import UpStack


async def stored(url: str, subject: str) -> list[bytes]:
    """Every message the stream holds on `subject` (a wildcard), oldest first."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        cfg = ConsumerConfig(filter_subject=subject, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
        info = await js.add_consumer(subjects.STREAM, cfg)
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=subjects.STREAM)
        return [bytes(m.data) for m in await sub.fetch(info.num_pending or 1, timeout=5)]
    finally:
        await nc.close()


async def dones_by_worker(url: str) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for body in await stored(url, subjects.done("*", "*")):
        d = wire.decode_as(body, wire.Done)
        out[(d.partition, d.worker_id)] += 1
    return out


async def opens_by_frontend(url: str) -> Counter[str]:
    return Counter(wire.decode_as(body, wire.Open).frontend_id for body in await stored(url, subjects.open_("*")))


@pytest.mark.parametrize("colocate", [False, True], ids=["worker-per-partition", "colocated"])
async def test_two_frontends_two_workers_per_partition(tmp_path: Path, colocate: bool) -> None:
    """`up --frontends 2 --workers 2`: both frontends serve on the one port and take calls, and
    calls spread over both workers of each partition. With `--colocate` the two worker
    processes each run both partitions."""
    stack = await asyncio.to_thread(UpStack, "echo", frontends=2, workers=2, colocate=colocate, folder=tmp_path)
    try:
        url = stack.nats_url
        # One socket per call: the kernel hands each new connection to one of the frontends.
        sockets = [await WS.connect(stack.ws_url()) for _ in range(16)]
        samples = (np.arange(10 * FRAME) % 9000).astype("<i2")

        async def call(i: int) -> None:
            rid = f"spread{i}"
            await sockets[i].send({"request_id": rid, "files": [pcm_file(samples)]})
            await sockets[i].send({"request_id": rid, "end_input": True})

        await asyncio.gather(*(call(i) for i in range(16)))
        for i in range(16):
            final = await sockets[i].final(f"spread{i}", timeout=60)
            assert "finish" in final, final
            assert echo_bytes(sockets[i].outputs(f"spread{i}")) == samples.tobytes()
        frontends = await opens_by_frontend(url)
        assert len(frontends) == 2 and sum(frontends.values()) == 16, frontends  # both frontends took calls
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
        stack.close()
