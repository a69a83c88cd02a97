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
import os
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

from bench.machine import machine
from tests.support.stack import UpStack

MB = 1024 * 1024


def frontend_pid(stack: UpStack) -> int:
    """The frontend child of this stack's `duplexbus up` (its command line names the role;
    other stacks on the machine are not this one's children)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if ppid == stack.proc.pid and b"frontend" in argv:
                return int(d.name)
    raise RuntimeError("no frontend process")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sockets(pid: int) -> int:
    """Sockets the process holds: its clients' connections (and a few of its own)."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd).startswith("socket:")
    return n


class Sampler:
    """The frontend's RSS and client connections (its sockets beyond those it held before)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.base = pid, 0.0, rss_mb(pid)
        self.base_sockets = sockets(pid)
        self.peak_conns = 0

    def conns(self) -> int:
        return max(0, sockets(self.pid) - self.base_sockets)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb(self.pid))
            self.peak_conns = max(self.peak_conns, self.conns())
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


async def until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: ClientProtocol, hold: float) -> str:
    """How the server ended the connection within `hold` seconds: its close code, 'dropped'
    (no close frame), or 'open'. Pings are answered, as any client library does."""
    deadline = time.monotonic() + hold
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not data:
                break
            proto.receive_data(data)
            writer.write(b"".join(proto.data_to_send()))
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
        return await until_closed(reader, writer, proto, hold)

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
            while time.monotonic() - t0 < hold:  # silent now, never reading
                await asyncio.sleep(0.5)
                if ws.protocol.state is State.CLOSED or ws.transport.is_closing():
                    return f"dropped within {10 * (1 + int((time.monotonic() - t0) // 10))} s of going silent"
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
        out = Counter(await asyncio.gather(*(until_closed(r, w, p, hold) for r, w, p in conns)))
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


HOLD_S = {"idle": 130.0, "unread": 90.0}  # past socket_idle_timeout_s (120 s); the output takes a while to come

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
    head = ["load", "RSS before (MB)", "peak (MB)", "at the end of the hold (MB)", "client connections held: most, at the end"]
    print("| " + " | ".join([*head, "what the clients saw"]) + " |")
    print("|---|---|---|---|---|---|")
    for name in args.loads.split(","):
        with UpStack("echo", config=json.loads(args.config)) as stack:  # a fresh frontend for each load
            pid = frontend_pid(stack)
            sampler = Sampler(pid)
            task = asyncio.create_task(sampler.run())
            t0 = time.monotonic()
            ends = await LOADS[name](stack.ws_url(), max(args.hold, HOLD_S.get(name, 0.0)))
            end, left = rss_mb(pid), sampler.conns()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            how = ", ".join(f"{k}: {v}" for k, v in sorted(ends.items()))
            took = time.monotonic() - t0
            row = [name, f"{sampler.base:.0f}", f"{sampler.peak:.0f}", f"{end:.0f}", f"{sampler.peak_conns}, {left}"]
            print("| " + " | ".join([*row, f"{how} ({took:.0f} s)"]) + " |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
