"""Frontend memory under issue 11's hostile loads (docs/reliability.md).

Starts `duplexbus up --model echo` (one frontend, the default serving config unless
`--config` names overrides), then runs each load in turn against it, on loopback, and
samples the frontend process's resident memory every 0.2 s:

- fragments: 40 sockets each send 30 MB of one fragmented message, never its last fragment;
- unread: 20 sockets each run a live call whose output (about 20 MB) they never read;
- idle: 2,000 sockets that open no call;
- headers: 400 raw TCP connections that never finish their request headers.

For each: the frontend's RSS before, at its peak, and at the end of the hold (`--hold`
seconds after the load was sent), and how the clients' connections ended. Run it with
PYTHONPATH pointing at another checkout to measure that code (the script needs only
`bench.stack` and `duplexbus` from it).

    python bench/frontend_hostile.py [--loads fragments,unread,idle,headers] [--hold 45]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import resource
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import websockets
from websockets.client import ClientProtocol
from websockets.protocol import State
from websockets.uri import parse_uri

from bench.stack import UpStack, machine

MB = 1024 * 1024


def frontend_pid(stack: UpStack) -> int:
    """The frontend child of `duplexbus up` (found by its command line)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"frontend" in argv and any(a.endswith(b"duplexbus.cli") for a in argv):
                return int(d.name)
    raise RuntimeError("no frontend process")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.base = pid, 0.0, rss_mb(pid)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb(self.pid))
            await asyncio.sleep(0.2)


async def raw_ws(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, ClientProtocol]:
    uri = parse_uri(url)
    proto = ClientProtocol(uri, max_size=None)
    reader, writer = await asyncio.open_connection(uri.host, uri.port)
    proto.send_request(proto.connect())
    writer.write(b"".join(proto.data_to_send()))
    while proto.state is State.CONNECTING:
        data = await asyncio.wait_for(reader.read(65536), 30)
        if not data:
            raise ConnectionError("closed during the handshake")
        proto.receive_data(data)
    return reader, writer, proto


async def until_closed(reader: asyncio.StreamReader, proto: ClientProtocol, hold: float) -> str:
    """How the server ended the connection within `hold` seconds: its close code, 'dropped'
    (no close frame), or 'open'."""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), hold)
            if not data:
                break
            proto.receive_data(data)
    except TimeoutError:
        return "open"
    except ConnectionError:
        pass
    return str(proto.close_rcvd.code) if proto.close_rcvd is not None else "dropped"


async def fragments(url: str, hold: float, n: int = 40, mb: int = 30) -> Counter[str]:
    conns = [await raw_ws(url) for _ in range(n)]

    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: ClientProtocol) -> str:
        try:
            proto.send_text(b'{"request_id": "m", "text": "' + b"a" * MB, fin=False)
            for _ in range(mb - 1):
                proto.send_continuation(b"a" * MB, fin=False)
                writer.write(b"".join(proto.data_to_send()))
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        return await until_closed(reader, proto, hold)

    try:
        return Counter(await asyncio.gather(*(send(*c) for c in conns)))
    finally:
        for _, w, _ in conns:
            w.close()


async def unread(url: str, hold: float, n: int = 20, audio_s: float = 460.0) -> Counter[str]:
    """Each: a live echo call sent `audio_s` of audio at once (about 20 MB of output), read never."""
    frame = {"name": "a.pcm", "data": base64.b64encode(np.ones(32000, "<i2").tobytes()).decode()}  # 2 s

    async def one(i: int) -> str:
        host, port = url.split("//")[1].split("/")[0].split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect((host, int(port)))
        sock.setblocking(False)
        ws = await websockets.connect(url, sock=sock, max_size=None, max_queue=1)
        rid = f"unread-{i}"
        try:
            await ws.send(json.dumps({"request_id": rid}))
            for _ in range(int(audio_s / 2)):
                await ws.send(json.dumps({"request_id": rid, "append": [frame]}))
            t0 = time.monotonic()
            while time.monotonic() - t0 < hold:
                await asyncio.sleep(0.5)
                if ws.protocol.state is State.CLOSED:
                    return "dropped"
                with contextlib.suppress(ConnectionError, websockets.ConnectionClosed):
                    await ws.send(json.dumps({"request_id": rid, "append": [frame]}))  # still sending, never reading
            return "open"
        except websockets.ConnectionClosed:
            return "dropped"
        finally:
            ws.transport.abort()

    return Counter(await asyncio.gather(*(one(i) for i in range(n))))


async def idle(url: str, hold: float, n: int = 2000) -> Counter[str]:
    conns: list[Any] = []
    refused = 0
    for _ in range(n):
        try:
            conns.append(await raw_ws(url))
        except (ConnectionError, OSError, websockets.InvalidMessage, websockets.InvalidStatus):
            refused += 1
    try:
        out = Counter(await asyncio.gather(*(until_closed(r, p, hold) for r, _, p in conns)))
        if refused:
            out["refused at connect"] = refused
        return out
    finally:
        for _, w, _ in conns:
            w.close()


async def headers(url: str, hold: float, n: int = 400) -> Counter[str]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]
    for _, w in conns:
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")

    async def one(reader: asyncio.StreamReader) -> str:
        try:
            data = await asyncio.wait_for(reader.read(), hold)
        except TimeoutError:
            return "open"
        except ConnectionError:
            return "dropped"
        return data.split(b"\r\n", 1)[0].decode() or "closed"

    try:
        return Counter(await asyncio.gather(*(one(r) for r, _ in conns)))
    finally:
        for _, w in conns:
            w.close()


LOADS: dict[str, Callable[[str, float], Awaitable[Counter[str]]]] = {
    "fragments": fragments,
    "unread": unread,
    "idle": idle,
    "headers": headers,
}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--hold", type=float, default=45.0, help="seconds each load is held before it is let go")
    ap.add_argument("--config", default="{}", help="serving config overrides, as JSON")
    args = ap.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"machine: {machine()}")
    print("| load | RSS before (MB) | peak (MB) | at the end of the hold (MB) | how the clients' connections ended |")
    print("|---|---|---|---|---|")
    with UpStack("echo", config=json.loads(args.config)) as stack:
        pid = frontend_pid(stack)
        for name in args.loads.split(","):
            sampler = Sampler(pid)
            task = asyncio.create_task(sampler.run())
            t0 = time.monotonic()
            ends = await LOADS[name](stack.ws_url(), args.hold)
            end = rss_mb(pid)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            how = ", ".join(f"{k}: {v}" for k, v in sorted(ends.items()))
            print(f"| {name} | {sampler.base:.0f} | {sampler.peak:.0f} | {end:.0f} | {how} ({time.monotonic() - t0:.0f} s) |")
            await asyncio.sleep(3)


if __name__ == "__main__":
    asyncio.run(main())
