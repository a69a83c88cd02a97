"""How long `duplexbus replay` takes over a 10-minute call.

`duplexbus up --model echo`, one live call of 7,500 appends of 80 ms (10 minutes of 16 kHz
audio, sent as fast as the stack takes them), then the call replayed from the stream:
the timeline (the default), `--json` and `--audio`, each timed in-process from opening the
bus connection to the last byte written (median of `--runs`), and the whole command as a
user runs it (a new Python process: start-up and imports included).

Finding the call: by cid (one subject read) and by request_id, whose index is the stream's
opens (`clients/replay.py::find_calls` reads every `call.*.open`), so its cost grows with
the calls the stream holds. `--other-calls` short one-shot calls are made first, so the
lookup by request_id scans that many opens besides the long call's.

    .venv/bin/python -m bench.replay_speed
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import websockets

from bench.machine import machine
from clients.replay import find_calls, raw, read_call, timeline, write_audio
from models.echo import FRAME
from shared.bus import wire
from shared.bus.connection import BusConnection
from shared.runtime.config import parse_config
from shared.sdk.audio import b64_pcm16
from tests.support.stack import UpStack

APPENDS = 7_500  # 10 minutes of 80 ms appends
OTHER_CALLS = 1_000  # opens in the stream besides the long call's, for the lookup by request_id
REQUEST_ID = "bench-replay"


async def other_calls(url: str, calls: int, at_once: int = 32) -> None:
    """`calls` one-shot echo calls of one frame each (their opens fill the request_id
    index), `at_once` at a time on one socket (under the frontend's one-shot queue)."""
    frame = b64_pcm16(np.zeros(FRAME, dtype=np.int16))
    async with websockets.connect(url, max_size=None) as ws:
        for first in range(0, calls, at_once):
            batch = range(first, min(calls, first + at_once))
            for i in batch:
                opening = {"request_id": f"bench-other-{i}", "files": [{"name": "a.pcm", "data": frame}], "end_input": True}
                await ws.send(json.dumps(opening))
            ended = 0
            async for msg in ws:
                m = json.loads(msg)
                if "finish" in m or ("error" in m and not m.get("append")):
                    if "finish" not in m:
                        raise RuntimeError(f"a call failed: {m}")
                    ended += 1
                    if ended == len(batch):
                        break


async def record_call(url: str, appends: int) -> str:
    """One live call of `appends` echo frames, as fast as the stack takes them; its cid."""
    rng = np.random.default_rng(0)
    frames = [b64_pcm16(rng.integers(-3000, 3000, FRAME, dtype=np.int16)) for _ in range(50)]
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"request_id": REQUEST_ID}))

        async def send() -> None:
            for i in range(appends):
                data = frames[i % len(frames)]
                await ws.send(json.dumps({"request_id": REQUEST_ID, "append": [{"name": "a.pcm", "data": data}]}))
                if i % 100 == 99:
                    await asyncio.sleep(0.02)  # let the stack keep up: this is a recording, not a load test
            await ws.send(json.dumps({"request_id": REQUEST_ID, "end_input": True}))

        sender = asyncio.create_task(send())
        async for msg in ws:
            m = json.loads(msg)
            if "finish" in m or ("error" in m and not m.get("append")):
                await sender
                if "finish" not in m:
                    raise RuntimeError(f"the call failed: {m}")
                return str(m["finish"]["call_id"])
    raise RuntimeError("the socket closed before the call ended")


async def replay_once(nats_url: str, cid: str, mode: str, out_dir: Path) -> tuple[float, int]:
    """Seconds from connecting to the last byte written, and the messages read."""
    t0 = time.perf_counter()
    conn = await BusConnection.open(parse_config({"nats_url": nats_url}), "bench-replay", stream=False, connect_timeout=5)
    try:
        msgs = [sm async for sm in read_call(conn, cid)]
        sink = io.StringIO()
        if mode == "timeline":
            sink.write(timeline(cid, msgs))
        elif mode == "json":
            sink.write("".join(raw(s, m) + "\n" for s, m in msgs))
        else:
            model = next((m.model for _, m in msgs if isinstance(m, wire.Open)), "")
            write_audio(out_dir, model, msgs)
    finally:
        await conn.close()
    return time.perf_counter() - t0, len(msgs)


async def lookup_once(nats_url: str, key: str, cid: str) -> float:
    """Seconds from connecting to the call found by `key` (its cid or its request_id)."""
    t0 = time.perf_counter()
    conn = await BusConnection.open(parse_config({"nats_url": nats_url}), "bench-replay", stream=False, connect_timeout=5)
    try:
        refs = await find_calls(conn, key)
    finally:
        await conn.close()
    if [r.cid for r in refs] != [cid]:
        raise RuntimeError(f"looking up {key!r} found {refs}, not the call {cid}")
    return time.perf_counter() - t0


def cli_once(nats_url: str, key: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "duplexbus.cli", "replay", key, "--nats-url", nats_url],
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=120,
    )
    return time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--appends", type=int, default=APPENDS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--other-calls", type=int, default=OTHER_CALLS, help="short calls in the stream besides the long one")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    with UpStack("echo") as stack, tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        await other_calls(stack.ws_url(), args.other_calls)
        print(f"made {args.other_calls} other calls in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        cid = await record_call(stack.ws_url(), args.appends)
        print(f"recorded call {cid}: {args.appends} appends in {time.monotonic() - t0:.1f} s")
        for what, key in (("cid", cid), ("request_id", REQUEST_ID)):
            secs = [await lookup_once(stack.nats_url, key, cid) for _ in range(args.runs)]
            print(
                f"find the call by {what:<10}: {args.other_calls + 1} opens in the stream, median "
                f"{statistics.median(secs):.3f} s (min {min(secs):.3f}, max {max(secs):.3f}, {args.runs} runs)"
            )
        for mode in ("timeline", "json", "audio"):
            runs = [await replay_once(stack.nats_url, cid, mode, Path(tmp)) for _ in range(args.runs)]
            secs = [s for s, _ in runs]
            print(
                f"replay {mode:<8}: {runs[0][1]} messages, median {statistics.median(secs):.3f} s "
                f"(min {min(secs):.3f}, max {max(secs):.3f}, {args.runs} runs)"
            )
        for what, key in (("CID", cid), ("REQUEST_ID", REQUEST_ID)):
            cli = [await asyncio.to_thread(cli_once, stack.nats_url, key) for _ in range(args.runs)]
            print(f"`duplexbus replay {what}` as a command (new process): median {statistics.median(cli):.3f} s")


if __name__ == "__main__":
    asyncio.run(main())
