"""The backbone end to end: services as separate processes on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
from nats.aio.msg import Msg

from models.echo import FRAME
from shared.bus import subjects
from shared.sdk.audio import encode_wav
from tests.support.audio import echo_bytes, padded, pcm_file
from tests.support.bus import connected, delivered
from tests.support.client import WS
from tests.support.poll import until
from tests.support.stack import Stack, running_stack


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    # Each partition in its own worker process, so the inter-partition edge crosses the bus.
    async with running_stack(nats_url, {"model": "echo"}, workers=[["Encoder"], ["Talker"]]) as s:
        yield s


async def run_call(ws: WS, rid: str, samples: np.ndarray, sizes: list[int]) -> list[dict[str, Any]]:
    await ws.send({"request_id": rid})
    pos = 0
    for n in sizes:
        await ws.send({"request_id": rid, "append": [pcm_file(samples[pos : pos + n])]})
        pos += n
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid, timeout=60)
    assert "finish" in final, final
    return ws.outputs(rid)


async def test_twenty_concurrent_live_calls_every_byte_in_order(stack: Stack) -> None:
    rng = random.Random(7)
    sockets = [await WS.connect(stack.ws_url()) for _ in range(4)]
    calls = []
    for i in range(20):
        sizes = [rng.randint(1, 24_000) for _ in range(rng.randint(3, 25))]
        samples = np.array([rng.randint(-32768, 32767) for _ in range(sum(sizes))], dtype="<i2")
        calls.append((f"c{i}", samples, sizes))

    async def one(i: int) -> None:
        rid, samples, sizes = calls[i]
        ws = sockets[i % 4]
        await ws.send({"request_id": rid})
        pos = 0
        for n in sizes:
            await ws.send({"request_id": rid, "append": [pcm_file(samples[pos : pos + n])]})
            pos += n
            await asyncio.sleep(rng.random() * 0.02)
        await ws.send({"request_id": rid, "end_input": True})

    await asyncio.gather(*(one(i) for i in range(20)))
    for i, (rid, samples, _) in enumerate(calls):
        ws = sockets[i % 4]
        final = await ws.final(rid, timeout=60)
        assert "finish" in final, final
        outs = ws.outputs(rid)
        assert [o["frame"] for o in outs] == list(range(len(outs)))
        assert echo_bytes(outs) == padded(samples), f"{rid}: bytes differ"
        assert final["finish"]["usage"]["frames"] == len(outs)
    for ws in sockets:
        await ws.close()


async def conductor_caught_up(nats_url: str) -> bool:
    """The conductor's durable consumer has nothing left to deliver and nothing unacked."""
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info(subjects.STREAM, subjects.CONDUCTOR_DURABLE)
    finally:
        await nc.close()
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def test_conductor_messages_do_not_grow_with_appends(stack: Stack) -> None:
    """I-1: the conductor receives as many messages for 1,000 appends as for 10."""
    nc = await nats.connect(stack.nats_url)
    info = await nc.jetstream().consumer_info(subjects.STREAM, subjects.CONDUCTOR_DURABLE)
    await nc.close()
    filters = info.config.filter_subjects or []
    assert filters and not any(f".{k}" in f for f in filters for k in ("in", "edge", "out"))

    ws = await WS.connect(stack.ws_url())
    counts = []
    for n in (10, 1000):
        before = await delivered(stack.nats_url)
        samples = np.arange(n * 160, dtype=np.int64).astype("<i2")
        await run_call(ws, f"count{n}", samples, [160] * n)
        # The finish came after the conductor had every message of the call (it publishes the
        # fin once both dones are in); a message it has not acked yet could be delivered again.
        await until(lambda: conductor_caught_up(stack.nats_url), 10, "the conductor's acks")
        counts.append(await delivered(stack.nats_url) - before)
    await ws.close()
    assert counts[0] == counts[1], counts
    assert counts[0] <= 6, counts  # open, eoi, two dones


async def test_call_cli_round_trip(stack: Stack, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    samples = rng.integers(-20000, 20000, 16000 * 2 + 333).astype("<i2")
    wav = tmp_path / "in.wav"
    wav.write_bytes(encode_wav(samples, 16000))
    out = tmp_path / "reply.wav"
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "duplexbus.cli",
            "call",
            str(wav),
            "--url",
            stack.ws_url(),
            "--fast",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    import wave

    with wave.open(str(out)) as w:
        got = w.readframes(w.getnframes())
    assert got == padded(samples)
    assert "finish" in proc.stderr


async def test_finish_names_the_call_and_replay_prints_it(stack: Stack) -> None:
    samples = (np.arange(3 * FRAME) % 500).astype("<i2")
    ws = await WS.connect(stack.ws_url())
    await ws.send({"request_id": "replayme", "files": [pcm_file(samples)], "end_input": True})
    final = await ws.final("replayme")
    await ws.close()
    call_id = final["finish"]["call_id"]
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "duplexbus.cli", "replay", call_id, "--json", "--nats-url", stack.nats_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    kinds = [json.loads(line)["subject"].split(".")[2] for line in proc.stdout.splitlines()]
    # the opening's items are published before the open, which counts them
    assert kinds.count("open") == 1 and kinds.count("in") == 3 and kinds.count("out") == 3
    assert kinds.count("edge") == 3 and kinds.count("done") == 2 and kinds[-1] == "fin"
    # each worker stored where it took the call before reading it (wire.Placed), and before its done
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    placed = [m for m in lines if ".placed." in m["subject"]]
    assert sorted(p for m in placed for p in m["partitions"]) == ["Encoder", "Talker"]
    # per partition: one partition may end before the other is placed (a one-shot the Encoder
    # finishes while the Talker's assignment is on its way)
    subject_at = [m["subject"] for m in lines]
    for m in placed:
        for part in m["partitions"]:
            assert subject_at.index(m["subject"]) < subject_at.index(f"call.{call_id}.done.{part}"), subject_at


async def test_a_workers_first_read_of_a_call_starts_where_the_call_does_not_at_the_streams_start(stack: Stack) -> None:
    """The frontend says where a call's messages start in the stream (wire.Open.read_after: the
    last sequence it saw stored before the call's first message), the conductor passes it on,
    and each worker's read at placement asks for the call's subjects from there: a direct get
    from sequence 1 cost the server 5.5 ms a page on a stream of 640,000 messages, from near
    the call 0.8 ms, and an open storm makes hundreds (docs/performance.md). The read still
    finds everything: the call is byte-exact, its opening's items included."""
    samples = (np.arange(6 * FRAME) % 700).astype("<i2")
    ws = await WS.connect(stack.ws_url())
    await run_call(ws, "before", samples, [FRAME])  # the frontend has seen stores by now
    asked: list[dict[str, Any]] = []
    async with connected(stack.nats_url) as nc:

        async def record(m: Msg) -> None:
            asked.append(json.loads(m.data))

        await nc.subscribe(subjects.js_api_direct_get(subjects.STREAM), cb=record)
        await nc.flush()
        await ws.send({"request_id": "after", "files": [pcm_file(samples[: 2 * FRAME])]})  # items before its open
        for part in (samples[2 * FRAME : 4 * FRAME], samples[4 * FRAME :]):
            await ws.send({"request_id": "after", "append": [pcm_file(part)]})
        await ws.send({"request_id": "after", "end_input": True})
        final = await ws.final("after", timeout=60)
        assert echo_bytes(ws.outputs("after")) == padded(samples)
        cid = final["finish"]["call_id"]
        first = await nc.jetstream().get_msg(subjects.STREAM, seq=1, subject=subjects.call_all(cid), next=True)
    await ws.close()
    starts = [a["seq"] for a in asked if f".{cid}." in a["next_by_subj"]]
    assert starts and all(1 < s <= first.seq for s in starts), (starts, first.seq)
