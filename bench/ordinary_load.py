"""Live echo calls as users' clients make them, beside the tuned load client, against a baseline.

`bench/live_load.py` measures the server with a hand-tuned client (prebuilt frames, zero mask
keys, batched writes). This one measures what a user sees: an *ordinary* client, written as
docs/clients.md shows it, with the `websockets` library and asyncio's own loop, many calls per
socket (`--sockets`, 20), each call a task that opens, then builds and sends one append every
80 ms (a WAV, or `.pcm`, of 80 ms of 16 kHz audio: JSON text with the audio in base64, or
(`ordinary-msgpack`) a binary frame in msgpack with the audio as bytes), while one reader per
socket decodes every reply and the audio in it. The tuned client (`tuned`, live_load's) runs
beside it in the same run, on the same sockets' worth of calls, so both columns share the
machine's moment.

Calls open at random over `--ramp` seconds (`ramp`, 2 s), or all within `--storm` seconds
(`storm`, 80 ms: what a frontend restart or a network blip causes when clients reconnect).

Figures per level: **lag** from sending frame k to receiving echo output k, over the steady
state (frames sent once every call is open and past its first `--warmup` second, and before the
first call ends), per frame (p50, p99) and per call (each call's own p99: the median call's and
the worst); p99 over all frames too (openings included: the storm's figure). **CPU**: the
client's own (its process time: what a user's client costs), and each process of the stack,
per frame (one append in and one output out) and in % of one core.

`--baseline REV` runs the same cases on a second stack started from a `git worktree` of REV
(in a temporary folder, removed afterwards), interleaved (A, B per case; B first on every
other round, `--rounds`), and prints the ratios of this tree's figures over the baseline's,
paired by round: the machine is noisy, so single figures move, ratios of neighbours less.

    .venv/bin/python -m bench.ordinary_load --calls 200,300 --seconds 10
    .venv/bin/python -m bench.ordinary_load --calls 200 --baseline HEAD~5 --rounds 2
    .venv/bin/python -m bench.ordinary_load --calls 300 --clients ordinary-json --opens ramp --profile /tmp/prof

Loopback only; every stack, socket and worktree it makes is gone when it returns (`--keep-logs`
keeps the stacks' logs). `--profile DIR` samples the frontend, the workers and the conductor
with py-spy during each case of this tree's stack (DIR outside the repository: flame graphs
are not kept in it) and prints where their time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import io
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.live_load import socket_calls
from bench.machine import machine
from models.echo import FRAME
from shared.runtime.stats import percentile
from tests.support.stack import UpStack

PERIOD = 0.08  # one 80 ms append every 80 ms
RATE = 16_000
CLIENTS = ("ordinary-json", "ordinary-msgpack", "tuned")
OPENS = ("ramp", "storm")
FINISH_WAIT_S = 60.0  # after the last append, how long the calls' finishes may take
REPO = Path(__file__).resolve().parent.parent


# -- what a level is, and what it measured (pure) ---------------------------------------------
@dataclass(frozen=True)
class Case:
    calls: int
    client: str  # one of CLIENTS
    opening: str  # one of OPENS

    @property
    def name(self) -> str:
        return f"{self.calls} {self.client} {self.opening}"


def open_offsets(n: int, window_s: float, rng: random.Random) -> list[float]:
    """When each of n calls opens, in seconds from the level's start: at random within the window."""
    return [rng.random() * window_s for _ in range(n)]


def frames_of(seconds: float) -> int:
    """Appends a call of `seconds` sends: one every 80 ms while under `seconds` from its first
    (as live_load's client counts them)."""
    return math.ceil(seconds / PERIOD - 1e-9)


def socket_sizes(calls: int, sockets: int) -> list[int]:
    """Calls per socket: as even as they go, no empty socket."""
    s = max(1, min(sockets, calls))
    return [calls // s + (1 if i < calls % s else 0) for i in range(s)]


@dataclass
class Tally:
    """Every output a level's clients received: (request_id, frame, sent at, lag), in seconds."""

    frames: list[tuple[str, int, float, float]] = field(default_factory=list)
    finished: int = 0
    errors: int = 0
    append_errors: int = 0
    last_error: str | None = None

    def record(self, rid: str, k: int, sent: float, lag: float) -> None:
        self.frames.append((rid, k, sent, lag))

    def error(self, text: str, append: bool = False) -> None:
        if append:
            self.append_errors += 1
        else:
            self.errors += 1
        self.last_error = self.last_error or text

    def summary(self, calls: int, frames_per_call: int, warmup_s: float) -> dict[str, Any]:
        """The lag over the steady state, per frame and per call, and over all frames.

        Steady: sent once every call has sent its first frame and `warmup_s` more, and before
        the first call sent its last. Where that window is empty (calls shorter than the
        opening spread), each call's frames past its own first `warmup_s` are counted instead.
        """
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for rid, _, sent, _ in self.frames:
            first[rid] = min(first.get(rid, sent), sent)
            last[rid] = max(last.get(rid, sent), sent)
        steady: list[tuple[str, float]] = []
        if first:
            start, end = max(first.values()) + warmup_s, min(last.values())
            steady = [(rid, lag) for rid, _, sent, lag in self.frames if start <= sent <= end]
            if not steady:
                steady = [(rid, lag) for rid, _, sent, lag in self.frames if sent >= first[rid] + warmup_s]
        per_call: dict[str, list[float]] = collections.defaultdict(list)
        for rid, lag in steady:
            per_call[rid].append(lag * 1000)
        call_p99 = [p for lags in per_call.values() if (p := percentile(lags, 99)) is not None]
        steady_ms = [lag * 1000 for _, lag in steady]
        return {
            "frames": len(self.frames),
            "expected_frames": calls * frames_per_call,
            "steady_frames": len(steady_ms),
            "lag_p50_ms": percentile(steady_ms, 50),
            "lag_p99_ms": percentile(steady_ms, 99),
            "lag_p99_all_ms": percentile([f[3] * 1000 for f in self.frames], 99),
            "call_p99_median_ms": percentile(call_p99, 50),
            "call_p99_worst_ms": max(call_p99) if call_p99 else None,
            "finished": self.finished,
            "errors": self.errors + max(0, calls - self.finished - self.errors),
            "append_errors": self.append_errors,
            "last_error": self.last_error,
        }


def rounds_order(cases: list[Case], stacks: list[str], rounds: int) -> list[tuple[int, Case, str]]:
    """(round, case, stack) in the order they run: each case on every stack in turn, the first
    stack changing from one round to the next (A, B; then B, A): drift in the machine's load
    falls on both."""
    out = []
    for r in range(rounds):
        for case in cases:
            order = stacks if r % 2 == 0 else stacks[::-1]
            out += [(r, case, s) for s in order]
    return out


RATIO_KEYS = ("lag_p50_ms", "lag_p99_ms", "stack_us_per_frame", "frontend", "workers", "nats-server", "conductor")
RATIO_NAMES = (
    "lag p50",
    "lag p99",
    "stack CPU/frame",
    "frontend CPU/frame",
    "workers CPU/frame",
    "nats-server CPU/frame",
    "conductor CPU/frame",
)


def ratios(results: list[dict[str, Any]], a: str, b: str) -> dict[str, dict[str, float | None]]:
    """Per case, stack `a`'s figure over stack `b`'s in the same round, the median over rounds
    (of two, their mean; None where no round has both)."""
    by: dict[tuple[str, int, str], dict[str, Any]] = {(r["case"], r["round"], r["stack"]): r for r in results}
    out: dict[str, dict[str, float | None]] = {}
    for name in dict.fromkeys(r["case"] for r in results):
        rounds = sorted({r["round"] for r in results if r["case"] == name})
        out[name] = {}
        for key in RATIO_KEYS:
            rs = []
            for rd in rounds:
                x, y = _figure(by.get((name, rd, a)), key), _figure(by.get((name, rd, b)), key)
                if x is not None and y:
                    rs.append(x / y)
            out[name][key] = statistics.median(rs) if rs else None
    return out


def _figure(r: dict[str, Any] | None, key: str) -> float | None:
    """A result's figure: one of its own, or a process role's CPU µs per frame."""
    if r is None:
        return None
    v = r.get(key, r.get("us_per_frame", {}).get(key))
    return None if v is None else float(v)


# -- the ordinary client ------------------------------------------------------------------------
def wav_of(pcm: bytes) -> bytes:
    """A WAV file of PCM16 mono samples, as a client wraps each microphone chunk."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return buf.getvalue()


class OrdinarySocket:
    """One socket's calls, written as a user writes them: a task per call that opens, then sends
    an append every 80 ms (`json.dumps` with base64 audio, or msgpack with the bytes), built as it
    goes; one reader that decodes every reply and the audio in it."""

    def __init__(self, ws: ClientConnection, rids: list[str], binary: bool, audio: str, tally: Tally) -> None:
        self.ws = ws
        self.rids = rids
        self.binary = binary
        self.name = "mic.wav" if audio == "wav" else "mic.pcm"
        self.wrap: Callable[[bytes], bytes] = wav_of if audio == "wav" else bytes
        self.tally = tally
        self.sent: dict[str, list[float]] = {rid: [] for rid in rids}
        self.ended: set[str] = set()
        self.done = asyncio.Event()
        rng = np.random.default_rng(len(rids))
        self.pcm = {rid: rng.integers(-8000, 8000, FRAME).astype("<i2").tobytes() for rid in rids}

    def encode(self, msg: dict[str, Any]) -> str | bytes:
        return msgspec.msgpack.encode(msg) if self.binary else json.dumps(msg)

    async def call(self, rid: str, open_at: float, frames: int) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, open_at - loop.time()))
        await self.ws.send(self.encode({"request_id": rid}))
        t0 = loop.time()
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + k * PERIOD - loop.time()))
            data = self.wrap(self.pcm[rid])
            file = {"name": self.name, "data": data if self.binary else base64.b64encode(data).decode()}
            msg = self.encode({"request_id": rid, "append": [file]})
            self.sent[rid].append(time.monotonic())
            await self.ws.send(msg)
        await self.ws.send(self.encode({"request_id": rid, "end_input": True}))

    async def read(self) -> None:
        try:
            async for m in self.ws:
                d = json.loads(m) if isinstance(m, str) else msgspec.msgpack.decode(m)
                now = time.monotonic()
                rid = d.get("request_id")
                out = d.get("output")
                if out is not None:
                    audio = out["audio"]
                    _ = base64.b64decode(audio) if isinstance(audio, str) else audio  # the user plays it
                    times = self.sent.get(rid, [])
                    k = out["frame"]
                    if 0 <= k < len(times):
                        self.tally.record(rid, k, times[k], now - times[k])
                elif "error" in d and d.get("append"):
                    self.tally.error(f"{d['status']} {d['error']}", append=True)
                elif "finish" in d or "error" in d:
                    if "finish" in d:
                        self.tally.finished += 1
                    else:
                        self.tally.error(f"{d['status']} {d['error']}")
                    self.ended.add(rid)
                    if len(self.ended) == len(self.rids):
                        self.done.set()
        except ConnectionClosed as e:
            self.tally.error(f"socket closed: {e}")
        finally:
            self.done.set()


async def ordinary_level(
    url: str, sizes: list[int], tag: str, seconds: float, window_s: float, binary: bool, audio: str, tally: Tally
) -> None:
    loop = asyncio.get_running_loop()
    frames = frames_of(seconds)
    socks = await asyncio.gather(*(connect(url) for _ in sizes))  # a user's defaults
    try:
        sessions = [
            OrdinarySocket(ws, [f"{tag}s{i}-{j}" for j in range(n)], binary, audio, tally)
            for i, (ws, n) in enumerate(zip(socks, sizes, strict=True))
        ]
        start = loop.time() + 0.05
        rng = random.Random(tag)
        readers = [asyncio.create_task(s.read()) for s in sessions]
        calls = [
            asyncio.create_task(s.call(rid, start + off, frames))
            for s in sessions
            for rid, off in zip(s.rids, open_offsets(len(s.rids), window_s, rng), strict=True)
        ]
        await asyncio.gather(*calls)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sessions)), FINISH_WAIT_S)
        for r in readers:
            r.cancel()
    finally:
        await asyncio.gather(*(ws.close() for ws in socks), return_exceptions=True)


async def tuned_level(port: int, sizes: list[int], tag: str, seconds: float, window_s: float, tally: Tally) -> None:
    """live_load's client, its calls opening over the same window from the same moment."""
    stats: dict[str, Any] = {"finished": 0, "errors": 0}
    start = asyncio.get_running_loop().time() + 0.2  # its sockets' handshakes first
    await asyncio.gather(
        *(
            socket_calls("127.0.0.1", port, n, seconds, [], [], stats, f"{tag}s{i}", window_s, start, tally.record)
            for i, n in enumerate(sizes)
        )
    )
    tally.finished = stats["finished"]
    tally.errors = stats["errors"] + stats.get("unfinished", 0) + stats.get("append_errors", 0)
    tally.last_error = stats.get("last_error")


# -- a case on a stack ----------------------------------------------------------------------------
@dataclass
class Settings:
    seconds: float
    sockets: int
    ramp_s: float
    storm_s: float
    warmup_s: float
    audio: str
    profile: Path | None = None


def run_case(stack: UpStack, label: str, case: Case, st: Settings, tag: str) -> dict[str, Any]:
    """One level on one stack, in an event loop of its own (asyncio's for the ordinary client,
    uvloop for the tuned one, as live_load runs it); CPU from /proc and the process clock."""
    sizes = socket_sizes(case.calls, st.sockets)
    window = st.ramp_s if case.opening == "ramp" else st.storm_s
    tally = Tally()
    url = stack.ws_url()
    if case.client == "tuned":
        level = tuned_level(stack.port, sizes, tag, st.seconds, window, tally)
    else:
        level = ordinary_level(url, sizes, tag, st.seconds, window, case.client == "ordinary-msgpack", st.audio, tally)
    factory = _uvloop() if case.client == "tuned" else None
    load0 = os.getloadavg()[0]
    profilers = _profile(stack, st.profile, f"{label}-{case.name.replace(' ', '-')}") if st.profile else []
    cpu0, client0, t0 = stack.cpu_seconds(), time.process_time(), time.monotonic()
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(level)
    finally:
        wall, client = time.monotonic() - t0, time.process_time() - client0
        cpu1 = stack.cpu_seconds()
        for p in profilers:
            p.send_signal(2)  # py-spy writes what it has on SIGINT
    for p in profilers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(30)
    frames_per_call = frames_of(st.seconds)
    r = tally.summary(case.calls, frames_per_call, st.warmup_s)
    stack_cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if k != "load client"}
    per = max(1, r["frames"])
    r.update(
        case=case.name,
        stack=label,
        wall_s=round(wall, 1),
        client_cpu_pct=round(100 * client / wall, 1),
        client_us_per_frame=round(1e6 * client / per, 1),
        stack_cpu_pct={k: round(100 * v / wall, 1) for k, v in stack_cpu.items()},
        stack_us_per_frame=round(1e6 * sum(stack_cpu.values()) / per, 1),
        us_per_frame={role: round(1e6 * v / per, 1) for role, v in _by_role(stack_cpu).items()},
        load_avg=(round(load0, 2), round(os.getloadavg()[0], 2)),
    )
    return r


def _by_role(cpu: dict[str, float]) -> dict[str, float]:
    """CPU seconds of the frontend(s), the workers, nats-server and the conductor."""
    out: dict[str, float] = collections.defaultdict(float)
    for name, v in cpu.items():
        role = "workers" if name.startswith("worker") else name
        if role in ("frontend", "workers", "nats-server", "conductor"):
            out[role] += v
    return dict(out)


def _uvloop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _profile(stack: UpStack, folder: Path, label: str) -> list[subprocess.Popen[bytes]]:
    """py-spy sampling the frontend, the workers and the conductor (raw stacks, for `hot`)."""
    spy = Path(sys.executable).with_name("py-spy")
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for pid, role in stack.processes().items():
        if role.split(" ")[0] in ("frontend", "worker", "conductor"):
            path = folder / f"{label}-{role.replace(' ', '-')}.txt"
            argv = [str(spy), "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--gil", "-o", str(path)]
            out.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return out


def hot(raw: Path, top: int = 12) -> list[tuple[str, float, float]]:
    """(function, self share, inclusive share) of a py-spy raw profile's samples (`--gil`: those
    holding the GIL), the heaviest by self time first. A frame is `name (file.py)`."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or not stack:
            continue
        frames = [_frame_name(f) for f in stack.split(";")]
        total += int(n)
        own[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    if not total:
        return []
    return [(f, c / total, incl[f] / total) for f, c in own.most_common(top)]


def _frame_name(frame: str) -> str:
    """`func (path/to/file.py:12)` as `func (file.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


# -- the baseline ----------------------------------------------------------------------------------
@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A checkout of `rev` in a temporary folder (`git worktree`), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="duplexbus-baseline-"))
    path = folder / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def known_keys(cfg: dict[str, Any], source: Path | None) -> dict[str, Any]:
    """The serving config's keys that the code of `source` knows (an older commit may refuse a
    newer key); all of them for this tree."""
    if source is None:
        return cfg
    text = (source / "shared" / "runtime" / "config.py").read_text()
    return {k: v for k, v in cfg.items() if k in text}


def describe(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s", rev], capture_output=True, text=True)
    return out.stdout.strip()[:80] or rev


# -- the report ----------------------------------------------------------------------------------
def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def row(r: dict[str, Any]) -> str:
    cpu = r["stack_cpu_pct"]
    fe = sum(v for k, v in cpu.items() if k.startswith("frontend"))
    return (
        f"| {r['stack']} | {r['round'] + 1} | {r['case']} | {r['frames']}/{r['expected_frames']} | {fmt(r['lag_p50_ms'])} "
        f"| {fmt(r['lag_p99_ms'])} | {fmt(r['call_p99_median_ms'])} / {fmt(r['call_p99_worst_ms'])} | {fmt(r['lag_p99_all_ms'])} "
        f"| {r['errors']} | {fmt(r['client_cpu_pct'])} | {fmt(r['client_us_per_frame'])} | {fmt(sum(cpu.values()))} "
        f"| {fmt(fe)} | {fmt(r['stack_us_per_frame'])} | {r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f} |"
    )


HEADER = (
    "| stack | round | case | frames back | lag p50 ms | lag p99 ms | call p99 ms: median / worst | p99 all frames ms "
    "| errors | client CPU % | client µs/frame | stack CPU % | frontend % | stack µs/frame | load avg |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="200,300", help="live calls of each level, comma-separated")
    ap.add_argument("--clients", default=",".join(CLIENTS), help=f"of {', '.join(CLIENTS)}")
    ap.add_argument("--opens", default=",".join(OPENS), help="ramp (over --ramp s), storm (within --storm s)")
    ap.add_argument("--seconds", type=float, default=10.0, help="each call's input, in seconds of audio")
    ap.add_argument("--sockets", type=int, default=20, help="client sockets the calls share")
    ap.add_argument("--ramp", type=float, default=2.0)
    ap.add_argument("--storm", type=float, default=0.08)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of each call left out of the steady state")
    ap.add_argument("--audio", choices=("wav", "pcm"), default="wav", help="each append a WAV file, or raw .pcm")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline", help="a git revision: the same cases on a stack of its code, interleaved")
    ap.add_argument(
        "--rev", help="a git revision to measure instead of the working tree (its own checkout: no uncommitted change in it)"
    )
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--colocate", action="store_true", help="one worker process runs both partitions (up --colocate)")
    ap.add_argument("--config", default="{}", help="serving config keys for both stacks, as JSON ('{\"step_window_ms\": 5}')")
    ap.add_argument("--nice", type=int, default=0, help="the client's niceness once the stacks are up")
    ap.add_argument("--profile", type=Path, help="py-spy profiles of this tree's stack go here (outside the repository)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the stacks' folders (their logs)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    for c in args.clients.split(","):
        if c not in CLIENTS:
            ap.error(f"unknown client {c!r}")
    for o in args.opens.split(","):
        if o not in OPENS:
            ap.error(f"unknown opening {o!r}")
    if args.profile is not None and args.profile.resolve().is_relative_to(REPO):
        ap.error("--profile: a folder outside the repository (profiles are not kept in it)")
    return args


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case on this tree's stack (and the baseline's), printed as it ends; the results."""
    levels = [int(x) for x in args.calls.split(",")]
    cases = [Case(n, c, o) for n in levels for o in args.opens.split(",") for c in args.clients.split(",")]
    st = Settings(args.seconds, args.sockets, args.ramp, args.storm, args.warmup, args.audio, args.profile)
    # No gateway in front to see a stopping frontend's 503 first: it stops at once.
    cfg: dict[str, Any] = {
        "max_concurrent_requests": max(levels) + 10,
        "worker_slots": max(levels) + 10,
        "shutdown_unlist_s": 0.0,
        **json.loads(args.config),
    }
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as es:
        stacks: dict[str, UpStack] = {}
        names = ["this tree"]
        base: Path | None = None
        mine: Path | None = None
        if args.rev:
            mine = es.enter_context(worktree(args.rev))
            print(f"this tree: {describe(args.rev)}")
        if args.baseline:
            base = es.enter_context(worktree(args.baseline))
            print(f"baseline: {describe(args.baseline)}")
            names.append("baseline")
        # Both stacks start at once (each `up` waits on its own children): half the wait.
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            starting = {
                name: pool.submit(
                    UpStack, "echo", frontends=args.frontends, colocate=args.colocate, config=known_keys(cfg, src), source=src
                )
                for name in names
                for src in [base if name == "baseline" else mine]
            }
        for fut in starting.values():
            if fut.exception() is None:
                stack = es.enter_context(fut.result())
                if not args.keep_logs:
                    es.callback(shutil.rmtree, stack.dir, True)
        stacks = {name: fut.result() for name, fut in starting.items()}  # the first failure raises; the rest stop
        if args.nice:
            os.nice(args.nice)
        print(HEADER, flush=True)
        for i, (rd, case, name) in enumerate(rounds_order(cases, names, args.rounds)):
            prof = st if name == "this tree" else Settings(**{**asdict(st), "profile": None})
            r = run_case(stacks[name], "a" if name == "this tree" else "b", case, prof, f"c{i}-{random.randrange(10**6)}")
            r["round"], r["stack"] = rd, name
            results.append(r)
            print(row(r), flush=True)
    return results


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print("\nCPU, % of one core, over each case (the machine has " + f"{os.cpu_count()}" + " cores):")
    for r in results:
        cpu = r["stack_cpu_pct"]
        each = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()))
        print(f"  {r['stack']}, {r['case']}, round {r['round'] + 1}: client {r['client_cpu_pct']:.0f}; {each}")
    for r in results:
        if r["last_error"]:
            print(f"{r['stack']}, {r['case']}, round {r['round'] + 1}: last error: {r['last_error']}")
    if args.baseline:
        print("\nthis tree / baseline, the median over rounds of each round's ratio:")
        print("| case | " + " | ".join(RATIO_NAMES) + " |\n" + "|---" * (len(RATIO_NAMES) + 1) + "|")
        for name, rs in ratios(results, "this tree", "baseline").items():
            print(f"| {name} | " + " | ".join("-" if rs[k] is None else f"{rs[k]:.2f}" for k in RATIO_KEYS) + " |")
    if args.profile:
        print(f"\nwhere the time goes (py-spy, {args.profile}): self share of the samples holding the GIL (inclusive)")
        for raw in sorted(args.profile.glob("a-*.txt")):
            print(f"- {raw.stem}:")
            for f, own, incl in hot(raw):
                print(f"    {100 * own:5.1f}% ({100 * incl:5.1f}%)  {f}")


def main() -> None:
    args = parse_args()
    print(f"machine: {machine()}")
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = run(args)
    report(args, results)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine(), "args": vars(args), "results": results}, indent=2, default=str)
        )


if __name__ == "__main__":
    main()
