"""Messages the conductor receives per call, against appends per call (invariant I-1).

Counts what the conductor's durable consumer delivered (every call message it
ever sees) for one call of N appends, through the real services.

    .venv/bin/python -m bench.conductor_load --appends 10,100,1000
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import websockets

from bench.machine import machine
from shared.sdk.audio import b64_pcm16
from tests.support.bus import delivered
from tests.support.client import is_final
from tests.support.stack import UpStack


async def one_call(url: str, appends: int) -> None:
    data = b64_pcm16(np.zeros(160, dtype="<i2"))  # 10 ms each
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"request_id": f"load{appends}"}))
        for _ in range(appends):
            await ws.send(json.dumps({"request_id": f"load{appends}", "append": [{"name": "a.pcm", "data": data}]}))
        await ws.send(json.dumps({"request_id": f"load{appends}", "end_input": True}))
        async for raw in ws:
            m = json.loads(raw)
            if is_final(m):
                return


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--appends", default="10,100,1000")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print("| appends per call | items published | messages the conductor received |")
    print("|---|---|---|")
    with UpStack("echo") as stack:
        for n in [int(x) for x in args.appends.split(",")]:
            before = await delivered(stack.nats_url)
            await one_call(stack.ws_url(), n)
            await asyncio.sleep(0.5)
            got = await delivered(stack.nats_url) - before
            print(f"| {n} | {-(-n * 160 // 1280)} | {got} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
