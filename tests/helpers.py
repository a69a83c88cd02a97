"""Test helpers: the services as real processes on a real nats-server, and a WS client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
import websockets
import yaml
from nats.js.errors import KeyNotFoundError

from bench.stack import bucket_keys, is_final
from models.echo import FRAME
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.embedded import NatsServer, free_port
from shared.runtime.config import parse_config
from shared.sdk.audio import b64_pcm16

REPO = Path(__file__).resolve().parent.parent


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.p.pid, signal.SIGKILL)
            self.p.wait()

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Stack:
    """Conductor, workers and frontends as separate processes on one nats-server.

    The stream and buckets are deleted first, so each stack starts from a clean bus.
    Two stacks must never run at once on one bus (their workers would serve each
    other's conductor): use one module-scoped stack per module, or function-scoped
    ones in a module without a module-scoped stack.
    """

    def __init__(self, nats_url: str, config: dict[str, Any] | None = None) -> None:
        self.nats_url = nats_url
        self.dir = Path(tempfile.mkdtemp(prefix="duplexbus-stack-"))
        cfg = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0, **(config or {})}
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.procs: dict[str, Proc] = {}
        self.ports: list[int] = []
        self.port_owner: dict[int, str] = {}
        self.env = {**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1", "DUPLEXBUS_LOG": "INFO"}

    def _argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "duplexbus.cli", *args, "--config", str(self.config_path)]

    async def reset_bus(self) -> None:
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()
        with contextlib.suppress(Exception):
            await js.delete_stream(subjects.STREAM)
        for b in (subjects.KV_WORKERS, subjects.KV_FRONTENDS, subjects.KV_CALLS, subjects.KV_REQUEST_IDS):
            with contextlib.suppress(Exception):
                await js.delete_key_value(b)
        await nc.close()

    def start_conductor(self) -> Proc:
        return self._start("conductor", self._argv("conductor"))

    def start_worker(self, name: str, partitions: list[str] | None = None) -> Proc:
        extra = [a for p in (partitions or []) for a in ("--partition", p)]
        return self._start(name, self._argv("worker", *extra))

    def start_frontend(self, name: str = "frontend-0") -> int:
        port = free_port()
        self._start(name, self._argv("frontend", "--port", str(port)))
        self.ports.append(port)
        self.port_owner[port] = name
        return port

    def _start(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.env, self.dir)
        self.procs[name] = p
        return p

    async def start(self, workers: list[list[str] | None] | None = None, frontends: int = 1) -> Stack:
        await self.reset_bus()
        self.start_conductor()
        for i, parts in enumerate(workers if workers is not None else [None]):
            self.start_worker(f"worker-{i}", parts)
        for i in range(frontends):
            self.start_frontend(f"frontend-{i}")
        for port in self.ports:
            await self.wait_ready(port)
        return self

    async def wait_ready(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                pid = await asyncio.to_thread(_ready_pid, f"http://127.0.0.1:{port}/healthz")
                if pid is not None:
                    mine = self.procs[self.port_owner[port]].p.pid
                    if pid != mine:  # another test run on this machine took the port first
                        raise RuntimeError(f"port {port} is served by another process ({pid}, not {mine})")
                    return
            dead = [p for p in self.procs.values() if not p.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} died:\n{dead[0].tail()}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"frontend on {port} not ready:\n" + "\n".join(p.tail(10) for p in self.procs.values()))

    async def wait_workers(self, n: int, timeout: float = 30.0) -> None:
        """Until n worker heartbeats are in the bucket."""
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    kv = await js.key_value(subjects.KV_WORKERS)
                    if len(await kv.keys()) >= n:
                        return
                await asyncio.sleep(0.1)
            raise TimeoutError(f"fewer than {n} workers registered")
        finally:
            await nc.close()

    async def workers_of_live_calls(self) -> dict[str, str]:
        """partition -> the test's process name of the worker the conductor placed it on, from
        its call records. The pid is read from the worker id (worker-{pid}-{random}), not
        looked up in the heartbeat bucket: a killed worker's heartbeat can expire while the
        conductor has yet to move its partitions."""
        name_of = {p.p.pid: name for name, p in self.procs.items()}
        out: dict[str, str] = {}
        for rec in (await call_records(self.nats_url)).values():
            for part, wid in rec.placement.items():
                out[part] = name_of[int(wid.split("-")[1])]
        return out

    def ws_url(self, i: int = 0) -> str:
        return f"ws://127.0.0.1:{self.ports[i]}/generate/ws"

    def http_url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def stop(self) -> None:
        """Stop every process, then remove the stack's folder (its logs are in failure messages)."""
        order = sorted(self.procs.values(), key=lambda p: (not p.name.startswith("frontend"), p.name.startswith("conductor")))
        for p in order:
            p.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.tail()}" for p in self.procs.values())


@contextlib.asynccontextmanager
async def running_stack(
    nats_url: str,
    config: dict[str, Any],
    workers: list[list[str] | None] | None = None,
    frontends: int = 1,
    cls: type[Stack] = Stack,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Stack]:
    """A started stack (one worker with every partition by default), stopped afterwards.
    `env`: extra environment variables for its processes."""
    s = cls(nats_url, config)
    s.env.update(env or {})
    try:
        await s.start(workers=workers, frontends=frontends)
        if workers != []:
            await s.wait_workers(len(workers) if workers is not None else 1)
        yield s
    finally:
        s.stop()


async def call_records(nats_url: str, tries: int = 20) -> dict[str, wire.CallRecord]:
    """The conductor's call records (its calls bucket) by call id. `tries` as for `bucket_keys`:
    1 where an empty bucket is what the caller waits for."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(subjects.KV_CALLS)
        out = {}
        for key in await bucket_keys(kv, tries):
            try:
                e = await kv.get(key)
            except KeyNotFoundError:  # deleted since it was listed: the call ended meanwhile
                continue
            if e.value:
                r = wire.decode_as(e.value, wire.CallRecord)
                out[r.cid] = r
        return out
    finally:
        await nc.close()


def _ready_pid(url: str) -> int | None:
    with urllib.request.urlopen(url, timeout=1) as r:
        return int(json.loads(r.read())["pid"]) if r.status == 200 else None


def pcm(samples: np.ndarray) -> str:
    """PCM16 samples as the base64 text of a `.pcm` file."""
    return b64_pcm16(samples)


def pcm_file(samples: np.ndarray, stream: str | None = None) -> dict[str, Any]:
    """A raw PCM16 client file (`a.pcm`) of `samples`, for `stream` if given."""
    f = {"name": "a.pcm", "data": pcm(samples)}
    if stream:
        f["stream"] = stream
    return f


class WS:
    """A client socket with a receive buffer, for protocol tests."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.inbox: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, url: str) -> WS:
        return cls(await websockets.connect(url, max_size=None))

    async def send(self, msg: dict[str, Any] | str) -> None:
        await self.ws.send(msg if isinstance(msg, str) else json.dumps(msg))

    async def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, pred: Any, timeout: float = 20.0, keep: bool = False) -> dict[str, Any]:
        """The first message (kept or new) matching pred; others stay in the inbox (it too, with keep)."""
        for i, m in enumerate(self.inbox):
            if pred(m):
                return m if keep else self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message; inbox: {[_short(m) for m in self.inbox[-5:]]}")
            m = await self.recv(left)
            if pred(m):
                if keep:
                    self.inbox.append(m)
                return m
            self.inbox.append(m)

    async def final(self, rid: str, timeout: float = 20.0) -> dict[str, Any]:
        """The finish or error that ends call `rid`."""
        return await self.until(lambda m: m.get("request_id") == rid and is_final(m), timeout)

    def outputs(self, rid: str) -> list[dict[str, Any]]:
        out = [m["output"] for m in self.inbox if m.get("request_id") == rid and "output" in m]
        self.inbox = [m for m in self.inbox if not (m.get("request_id") == rid and "output" in m)]
        return out

    async def close(self) -> None:
        await self.ws.close()


async def nothing_for(ws: WS, pred: Any, seconds: float) -> None:
    """No message matching pred comes on `ws` for `seconds` (the others received meanwhile stay in its inbox)."""
    with pytest.raises(TimeoutError):
        await ws.until(pred, timeout=seconds)


def _short(m: dict[str, Any]) -> dict[str, Any]:
    if "output" in m and isinstance(m["output"], dict) and "audio" in m["output"]:
        return {**m, "output": {**m["output"], "audio": "..."}}
    return m


def padded(samples: np.ndarray) -> bytes:
    """What echo sends back for `samples`: the input zero-padded to whole frames."""
    n = -(-len(samples) // FRAME) * FRAME
    out = np.zeros(n, dtype="<i2")
    out[: len(samples)] = samples
    return out.tobytes()


def echo_bytes(outputs: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(o["audio"]) for o in outputs)


@contextlib.asynccontextmanager
async def bus_client(nats_url: str, name: str) -> AsyncIterator[BusConnection]:
    """A bus connection with the stream in place, as the services have it."""
    conn = await BusConnection.open(parse_config({"nats_url": nats_url}), name)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.contextmanager
def own_nats_server(prefix: str) -> Iterator[NatsServer]:
    """A nats-server of the test's own (one it may freeze, kill or restart on its store), in a
    temporary folder that goes with it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as store, NatsServer(store) as server:
        yield server


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    """A WAV file of `samples` (each repeated on every channel); of any sample width, to test
    refusals (a width other than 2 holds silence of the right length)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        frames = np.repeat(np.asarray(samples, "<i2"), channels).tobytes()
        w.writeframes(frames if width == 2 else bytes(len(samples) * channels * width))
    return buf.getvalue()


class EchoCall:
    """A live `echo` call on a socket of its own: frames sent as the test goes, and at the end
    every frame checked back once, in order, byte-exact (the fault tests' oracle)."""

    def __init__(self, ws: WS, rid: str, frames: int, seed: int) -> None:
        self.ws = ws
        self.rid = rid
        self.samples = ((np.arange(frames * FRAME) * (seed + 1)) % 30011).astype("<i2")
        self.sent = 0

    @classmethod
    async def open(cls, url: str, rid: str, frames: int, seed: int = 0) -> EchoCall:
        call = cls(await WS.connect(url), rid, frames, seed)
        await call.ws.send({"request_id": rid})
        return call

    @property
    def frames(self) -> int:
        return len(self.samples) // FRAME

    async def send(self, upto: int) -> None:
        """Append frames up to `upto` (not past the last), one message each."""
        for k in range(self.sent, min(upto, self.frames)):
            await self.ws.send({"request_id": self.rid, "append": [pcm_file(self.samples[k * FRAME : (k + 1) * FRAME])]})
        self.sent = max(self.sent, min(upto, self.frames))

    async def echoed(self, frame: int, timeout: float = 30.0) -> None:
        """Until frame `frame` has come back (kept for the final check)."""
        await self.ws.until(lambda m: m.get("request_id") == self.rid and "output" in m and m["output"]["frame"] >= frame,
                            timeout=timeout, keep=True)  # fmt: skip

    async def finish(self, timeout: float = 60.0, logs: str = "") -> None:
        """Send what is left, end the input; the call finishes with every frame once, in order."""
        await self.send(self.frames)
        await self.ws.send({"request_id": self.rid, "end_input": True})
        final = await self.ws.final(self.rid, timeout=timeout)
        assert "finish" in final, (self.rid, final, logs)
        outs = self.ws.outputs(self.rid)
        assert [o["frame"] for o in outs] == list(range(self.frames)), (self.rid, logs)
        assert echo_bytes(outs) == self.samples.tobytes(), self.rid
        await self.ws.close()


async def stream_for(calls: list[EchoCall], seconds: float, frames_per_s: float = 12.5) -> None:
    """Send every call's frames at about real time (80 ms frames) for `seconds`."""
    start = time.monotonic()
    sent = calls[0].sent if calls else 0
    while (elapsed := time.monotonic() - start) < seconds:
        upto = sent + int(elapsed * frames_per_s) + 1
        for c in calls:
            await c.send(upto)
        await asyncio.sleep(1 / frames_per_s)
