"""`duplexbus replay CID`: every message a call put on the bus, in stream order (I-3)."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.runtime.config import ServingConfig

CONNECT_TIMEOUT_S = 5.0  # a CLI command says it cannot reach NATS rather than wait forever


async def read_call(conn: BusConnection, cid: str) -> AsyncIterator[tuple[str, wire.AnyMsg]]:
    """Every stored message of the call, oldest first (large payloads fetched from the Object Store)."""
    async for subject, data, _ in conn.read_stored([subjects.call_all(cid)]):
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


async def run_replay(args: argparse.Namespace, cfg: ServingConfig) -> int:
    conn = await BusConnection.open(cfg, "duplexbus-replay", stream=False, connect_timeout=CONNECT_TIMEOUT_S)
    try:
        n = 0
        async for subject, msg in read_call(conn, args.cid):
            print(json.dumps({"subject": subject, **summarize(msg)}, default=str))
            n += 1
        if n == 0:
            print(f"no messages for call {args.cid} in {subjects.STREAM}")
            return 1
    finally:
        await conn.close()
    return 0
