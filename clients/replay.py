"""`duplexbus replay CID`: every message a call put on the bus, in stream order (I-3)."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client

from shared.bus import nats_io as bus
from shared.bus import subjects, wire
from shared.runtime.config import ServingConfig, load_config


async def read_call(nc: Client, cid: str, config: ServingConfig) -> AsyncIterator[tuple[str, wire.AnyMsg]]:
    """Every stored message of the call, oldest first (large payloads fetched from the Object Store)."""
    js = nc.jetstream()
    async for subject, data, _ in bus.read_stored(js, bus.Payloads(nc, js, config), [subjects.call_all(cid)]):
        yield subject, wire.decode(data)


def summarize(msg: wire.AnyMsg) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(msg)
    item = d.get("item")
    if isinstance(item, dict) and isinstance(item.get("data"), dict):
        t = item["data"]
        item["data"] = {"dtype": t["dtype"], "shape": t["shape"]}
    if isinstance(msg, wire.OutputMsg):
        data = json.loads(msg.json)
        if isinstance(data.get("audio"), str):
            data["audio"] = f"<{len(data['audio'])} b64 chars>"
        d["json"] = data
    return d


async def run_replay(args: argparse.Namespace) -> int:
    cfg = load_config(None, nats_url=args.nats_url)
    nc = await bus.connect(cfg, "duplexbus-replay")
    try:
        n = 0
        async for subject, msg in read_call(nc, args.cid, cfg):
            print(json.dumps({"subject": subject, **summarize(msg)}, default=str))
            n += 1
        if n == 0:
            print(f"no messages for call {args.cid} in {subjects.STREAM}")
            return 1
    finally:
        await bus.close(nc)
    return 0
