"""A rolling upgrade of a compose deployment under load: does any call get lost?

    python -m bench.rolling_upgrade --workers 2 --frontends 2 --every 0.5 --call-s 4

Brings up a compose project of its own (model echo; the repository's compose file with the
test override, so every container carries the run's label and a killed run's leftovers are
removed by the next), opens a call through the gateway's published port every `--every`
seconds, each streaming `--call-s` seconds of audio in real time on a socket of its own, and
meanwhile replaces every service as docs/operations.md ("Upgrading a running deployment")
says: new workers beside the old, the old stopped (they drain); the conductor recreated;
new frontends beside the old, the gateway waited for, the old stopped one at a time. The image is the same
(`duplexbus:latest`, from `scripts/docker.sh prepare`): every process is replaced all the
same, the conductor by `--force-recreate` where a new image would make compose recreate it.

Each call ends `exact` (every frame back once, in order, byte-exact), or `refused` (an error
with a status and no output: the call did nothing, and a client may open it again), or
`lost` (cut after it had output, or wrong). The report counts them by reason and by the
step they fell in, with the gateway's retries and redispatches. Bounded by `--max-calls` and
`--max-s`; the project and its volumes are removed at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import io
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from models.echo import FRAME
from shared.bus.embedded import free_port
from tests.support.containers import Project, compose_project, docker, prepare

FRAME_S = FRAME / 16000
STATS_URL = "http://127.0.0.1:8404/stats;csv"  # the gateway's, inside its container (deploy/haproxy.cfg)


@dataclass
class Outcome:
    rid: str
    opened: float  # seconds since the load began
    kind: str = "lost"  # exact, refused, lost
    reason: str = ""


@dataclass
class Timeline:
    """What the upgrade did when (seconds since the load began), to place each failure."""

    t0: float = field(default_factory=time.monotonic)
    marks: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    said: list[str] = field(default_factory=list)  # the replaced containers' warnings and errors

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, what: str) -> None:
        with self.lock:
            self.marks.append((self.now(), what))
        print(f"  {self.now():6.1f} s  {what}", flush=True)

    def step_at(self, t: float) -> str:
        """The upgrade step under way at t (`before` and `after` outside them)."""
        step = "before"
        for at, what in self.marks:
            if at > t:
                break
            step = what.split(":")[0]
        return step


# --- one call --------------------------------------------------------------------------


def samples_of(i: int, frames: int) -> np.ndarray:
    return ((np.arange(frames * FRAME) * (i % 7 + 1)) % 20000).astype("<i2")


def judge(final: dict[str, object], outputs: list[dict[str, object]], sent: bytes) -> tuple[str, str]:
    if "finish" in final:
        frames = [o.get("frame") for o in outputs]
        got = b"".join(base64.b64decode(str(o["audio"])) for o in outputs)
        if frames == list(range(len(frames))) and got == sent:
            return "exact", ""
        return "lost", f"finished but not exact ({len(frames)} frames)"
    kind = "lost" if outputs else "refused"
    return kind, f"error {final.get('status')}: {final.get('error')}"


async def stream(ws: websockets.ClientConnection, rid: str, samples: np.ndarray, reader: asyncio.Task[dict[str, object]]) -> None:
    await ws.send(json.dumps({"request_id": rid, "model": "echo"}))
    start = time.monotonic()
    for k in range(len(samples) // FRAME):
        if reader.done():  # ended early (refused): stop sending
            return
        data = base64.b64encode(samples[k * FRAME : (k + 1) * FRAME].tobytes()).decode()
        await ws.send(json.dumps({"request_id": rid, "append": [{"name": "a.pcm", "data": data}]}))
        await asyncio.sleep(max(0.0, start + (k + 1) * FRAME_S - time.monotonic()))
    await ws.send(json.dumps({"request_id": rid, "end_input": True}))


async def one_call(url: str, i: int, call_s: float, timeline: Timeline) -> Outcome:
    out = Outcome(f"roll-{i}", timeline.now())
    samples = samples_of(i, max(1, round(call_s / FRAME_S)))
    outputs: list[dict[str, object]] = []

    async def read(ws: websockets.ClientConnection) -> dict[str, object]:
        async for raw in ws:
            m = json.loads(raw)
            if "output" in m:
                outputs.append(m["output"])
            elif "finish" in m or ("error" in m and not m.get("append")):
                return dict(m)
        raise ConnectionError("closed before the call ended")

    try:
        async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
            reader = asyncio.create_task(read(ws))
            try:
                await stream(ws, out.rid, samples, reader)
                final = await asyncio.wait_for(asyncio.shield(reader), call_s + 30)
            finally:
                reader.cancel()
            out.kind, out.reason = judge(final, outputs, samples.tobytes())
    except InvalidStatus as e:
        out.kind, out.reason = "refused", f"handshake: HTTP {e.response.status_code} {e.response.body[:60]!r}"
    except TimeoutError:
        out.reason = "no finish in time" if outputs else "handshake timed out"
    except (ConnectionClosed, ConnectionError, OSError) as e:
        out.kind = "lost" if outputs else "refused"
        out.reason = f"{type(e).__name__}: {e}"[:120]
    if out.kind == "lost":
        out.reason += f" (after {len(outputs)} outputs, at {timeline.now():.1f} s)"
    return out


async def load(url: str, args: argparse.Namespace, timeline: Timeline, stop: asyncio.Event) -> list[Outcome]:
    """A call every `every` seconds until `stop` (or max_calls), then every call's end."""
    calls: list[asyncio.Task[Outcome]] = []
    while not stop.is_set() and len(calls) < args.max_calls:
        calls.append(asyncio.create_task(one_call(url, len(calls), args.call_s, timeline)))
        try:
            await asyncio.wait_for(stop.wait(), args.every)
        except TimeoutError:
            pass
    return list(await asyncio.gather(*calls))


# --- the upgrade (in a thread: plain docker and compose commands) ----------------------


def healthy(ids: list[str], deadline: float) -> None:
    while True:
        states = [docker("inspect", "-f", "{{.State.Health.Status}}", c).strip() for c in ids]
        if all(s == "healthy" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy: {states}")
        time.sleep(1)


def gateway_servers(project: Project) -> list[dict[str, str]]:
    """The gateway's frontend servers as its stats page has them (status, retries, ...)."""
    text = project("exec", "-T", "gateway", "wget", "-qO-", STATS_URL)
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return [r for r in rows if r["pxname"] == "frontends" and r["svname"] not in ("BACKEND", "FRONTEND")]


def gateway_sees(project: Project, n: int, deadline: float, fewer: bool = False) -> None:
    """Until the gateway has n frontends up (or, `fewer`, no more than n): docs/operations.md's
    waits before an old frontend is stopped."""
    while True:
        up = sum(r["status"] == "UP" for r in gateway_servers(project))
        if (up <= n) if fewer else (up >= n):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway has {up} frontends up, not {n}")
        time.sleep(0.5)


def stop(project: Project, service: str, old: list[str], timeline: Timeline, deadline: float) -> None:
    """Workers all at once; frontends one at a time, each out of the gateway before the next
    stops, so that an opening refused by one is retried on a frontend that listens."""
    batches = [[c] for c in old] if service == "frontend" else [old]
    for batch in batches:
        docker("stop", *batch, timeout=120)
        for c in batch:  # what they said while they drained, for the report
            said = docker("logs", "--tail", "200", c).splitlines()
            timeline.said += [f"{service} {c[:12]}: {line[:200]}" for line in said if "WARNING" in line or "ERROR" in line]
        docker("rm", *batch)
        if service == "frontend":
            gateway_sees(project, len(project.containers(service)), deadline, fewer=True)


def replace(project: Project, service: str, timeline: Timeline, deadline: float) -> None:
    """New replicas beside the old ones, then the old ones stopped (they drain) and removed."""
    old = project.containers(service)
    project("up", "-d", "--no-deps", "--no-recreate", "--scale", f"{service}={2 * len(old)}", service)
    new = [c for c in project.containers(service) if c not in old]
    timeline.mark(f"{service}s: {len(new)} new started")
    healthy(new, deadline)
    if service == "frontend":
        gateway_sees(project, 2 * len(old), deadline)
    timeline.mark(f"{service}s: new healthy, stopping the old")
    stop(project, service, old, timeline, deadline)
    timeline.mark(f"{service}s: old stopped and removed")


def upgrade(project: Project, timeline: Timeline, args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.max_s
    time.sleep(args.settle_s)
    replace(project, "worker", timeline, deadline)
    timeline.mark("conductor: recreating")
    project("up", "-d", "--wait", "--no-deps", "--force-recreate", "conductor")
    timeline.mark("conductor: healthy")
    replace(project, "frontend", timeline, deadline)
    timeline.mark("after: upgrade done")
    time.sleep(args.settle_s)


async def run(project: Project, args: argparse.Namespace) -> tuple[list[Outcome], Timeline]:
    url = f"ws://127.0.0.1:{project.env['DUPLEXBUS_PORT']}/generate/ws"
    timeline, stop = Timeline(), asyncio.Event()
    calls = asyncio.create_task(load(url, args, timeline, stop))
    try:
        await asyncio.wait_for(asyncio.to_thread(upgrade, project, timeline, args), args.max_s)
    finally:
        stop.set()
    return await asyncio.wait_for(calls, args.call_s + 60), timeline


# --- the report ------------------------------------------------------------------------


def report(outcomes: list[Outcome], timeline: Timeline, servers: list[dict[str, str]], gateway_log: str) -> None:
    kinds = Counter(o.kind for o in outcomes)
    print(f"\ncalls opened {len(outcomes)}, exact {kinds['exact']}, refused {kinds['refused']}, lost {kinds['lost']}")
    why = Counter((o.kind, timeline.step_at(o.opened), o.reason) for o in outcomes if o.kind != "exact")
    for (kind, step, reason), n in why.most_common():
        print(f"  {n:4d} {kind:8s} opened during {step:10s} {reason}")
    retries = sum(int(r["wretr"] or 0) for r in servers)
    redispatches = sum(int(r["wredis"] or 0) for r in servers)
    print(f"gateway: {retries} retries, {redispatches} redispatches to another frontend")
    changes = [line for line in gateway_log.splitlines() if "Server frontends/" in line and ("DOWN" in line or "UP" in line)]
    for line in changes[-20:]:
        print(f"  {line.strip()[:200]}")
    print("what the replaced containers warned of:")
    for line in timeline.said[-30:]:
        print(f"  {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between two calls opened")
    ap.add_argument("--call-s", type=float, default=4.0, help="seconds of audio each call streams")
    ap.add_argument("--settle-s", type=float, default=8.0, help="load before and after the upgrade")
    ap.add_argument("--max-calls", type=int, default=2000)
    ap.add_argument("--max-s", type=float, default=900.0, help="the upgrade's bound")
    args = ap.parse_args()
    try:
        prepare("prepare")  # the engine and duplexbus:latest; what killed runs left removed
    except pytest.skip.Exception as e:
        raise SystemExit(f"no container engine: {e}") from None
    project = compose_project(f"dbxroll{os.getpid()}", DUPLEXBUS_PORT=str(free_port()), DUPLEXBUS_MODEL="echo")
    try:
        t0 = time.monotonic()
        project("up", "-d", "--scale", f"worker={args.workers}", "--scale", f"frontend={args.frontends}")
        project.wait_healthy()
        print(f"stack up and healthy in {time.monotonic() - t0:.0f} s; load and upgrade:", flush=True)
        outcomes, timeline = asyncio.run(run(project, args))
        servers = gateway_servers(project)
        report(outcomes, timeline, servers, project("logs", "--no-color", "gateway"))
    finally:
        project.stop()


if __name__ == "__main__":
    main()
