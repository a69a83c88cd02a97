"""The services as real processes: `Stack` starts each one by itself on the test session's
nats-server (to kill, freeze or restart one), `UpStack` runs `duplexbus up` as a user does
(its own embedded nats-server, N frontends, M workers per partition)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from duplexbus.supervisor import UpOptions, saved_nats_url
from shared.bus.embedded import NatsCluster, free_port
from tests.support import bus

# The bound on a stack's processes coming up (a frontend ready, a worker's heartbeat stored). A
# worker registers once its model is loaded: the voice models take 5 s on an idle machine, and
# more than 30 s once in a fresh clone's first minute (beside the container tests' image build and the
# other xdist worker's stacks), which a bound of 30 s failed. Coming up is not what these tests
# measure (where it is, they pass their own bound): they get what `duplexbus up` gives its own.
START_S = UpOptions.ready_timeout


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=pass_fds,
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


class Served:
    """What both stacks offer a client: the frontends' ports and the bus's URL."""

    nats_url: str
    ports: list[int]

    def ws_url(self, i: int = 0) -> str:
        """The WebSocket of frontend i (UpStack's frontends share one port: any i is that port)."""
        return f"ws://127.0.0.1:{self.ports[i % len(self.ports)]}/generate/ws"

    def http_url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[i % len(self.ports)]}"

    async def worker_stats(self, reset: bool = False) -> list[dict[str, Any]]:
        return await bus.worker_stats(self.nats_url, reset)


class Stack(Served):
    """Conductor, workers and frontends as separate processes on one nats-server.

    The stream and buckets are deleted first, so each stack starts from a clean bus.
    Two stacks must never run at once on one bus (their workers would serve each
    other's conductor): use one module-scoped stack per module, or function-scoped
    ones in a module without a module-scoped stack.
    """

    def __init__(self, nats_url: str, config: dict[str, Any] | None = None) -> None:
        self.nats_url = nats_url
        self.dir = Path(tempfile.mkdtemp(prefix="duplexbus-stack-"))
        # shutdown_unlist_s 0: no gateway here waits to see a stopping frontend's 503 before it
        # closes its listener, and each stop would take 3 s more (tests/test_frontend_unlist.py
        # sets its own).
        cfg = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0, "shutdown_unlist_s": 0.0, **(config or {})}
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.procs: dict[str, Proc] = {}
        self.ports = []
        self.port_owner: dict[int, str] = {}
        self.env = {**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1", "DUPLEXBUS_LOG": "INFO"}

    def _argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "duplexbus.cli", *args, "--config", str(self.config_path)]

    async def reset_bus(self) -> None:
        await bus.reset_bus(self.nats_url)

    def start_conductor(self) -> Proc:
        return self._start("conductor", self._argv("conductor"))

    def start_worker(self, name: str, partitions: list[str] | None = None) -> Proc:
        extra = [a for p in (partitions or []) for a in ("--partition", p)]
        return self._start(name, self._argv("worker", *extra))

    def start_frontend(self, name: str = "frontend-0") -> int:
        """A frontend on a listening socket made here and handed over (`--fd`, as `duplexbus up`
        does): the port is held from the moment it is chosen. A port found free and passed as a
        number could be taken by another process while the frontend starts (seconds, with two
        test runs on the machine), and the test would then talk to that one."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            # Our copy closes once the frontend has its own: held here, it would queue the
            # connections of a test that has killed the frontend instead of refusing them.
            port: int = listener.getsockname()[1]
            fd = listener.fileno()
            self._start(name, self._argv("frontend", "--fd", str(fd)), pass_fds=(fd,))
        self.ports.append(port)
        self.port_owner[port] = name
        return port

    def _start(self, name: str, argv: list[str], pass_fds: tuple[int, ...] = ()) -> Proc:
        p = Proc(name, argv, self.env, self.dir, pass_fds)
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

    async def wait_ready(self, port: int, timeout: float = START_S) -> None:
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

    async def wait_workers(self, n: int, timeout: float = START_S) -> None:
        """Until n worker heartbeats are in the bucket; past `timeout`, a TimeoutError with the
        processes' logs (a worker still loading its model reads differently from one that died)."""
        try:
            await bus.wait_workers(self.nats_url, n, timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e} within {timeout:.0f} s:\n{self.logs()}") from None

    async def workers_of_live_calls(self) -> dict[str, str]:
        """partition -> the test's process name of the worker the conductor placed it on, from
        its call records. The pid is read from the worker id (worker-{pid}-{random}), not
        looked up in the heartbeat bucket: a killed worker's heartbeat can expire while the
        conductor has yet to move its partitions."""
        name_of = {p.p.pid: name for name, p in self.procs.items()}
        out: dict[str, str] = {}
        for rec in (await bus.call_records(self.nats_url)).values():
            for part, wid in rec.placement.items():
                out[part] = name_of[int(wid.split("-")[1])]
        return out

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


@contextlib.asynccontextmanager
async def cluster_stack(
    config: dict[str, Any], placement: dict[str, int], prefix: str
) -> AsyncIterator[tuple[NatsCluster, Stack]]:
    """A stack on a 3-node NatsCluster of its own, each process connected to the node that
    `placement` gives it (name -> node index; names start with conductor, worker or frontend),
    started in that order; stopped afterwards with the cluster."""
    with tempfile.TemporaryDirectory(prefix=prefix) as store, NatsCluster(store) as cluster:
        urls = [n.url for n in cluster.nodes]
        stack = Stack(urls[0], config)
        try:
            await stack.reset_bus()
            for name, node in placement.items():
                stack.env["NATS_URL"] = urls[node]
                if name.startswith("conductor"):
                    stack.start_conductor()
                elif name.startswith("worker"):
                    stack.start_worker(name)
                else:
                    stack.start_frontend(name)
            await stack.wait_ready(stack.ports[0])
            await stack.wait_workers(sum(name.startswith("worker") for name in placement))
            yield cluster, stack
        finally:
            stack.stop()


def _ready_pid(url: str) -> int | None:
    with urllib.request.urlopen(url, timeout=1) as r:
        # frontend-{pid}-{random}: /healthz does not give the pid itself (nothing to give away)
        return int(json.loads(r.read())["frontend_id"].split("-")[1]) if r.status == 200 else None


class UpStack(Served):
    """`duplexbus up --model M --frontends N --workers M` with its own embedded nats-server, ready
    once constructed (it blocks: from a coroutine, build it in a thread) and stopped with
    Ctrl-C (SIGINT) as a user stops it. Every frontend serves on the one port; the kernel
    spreads new sockets over them. `folder` holds the config and `up`'s run directory
    (`run_dir`, folder/run); by default a new temporary one, whose logs stay for a look."""

    def __init__(
        self,
        model: str = "echo",
        frontends: int = 1,
        workers: int = 1,
        config: dict[str, Any] | None = None,
        colocate: bool = False,
        folder: Path | None = None,
        log_level: str | None = "WARNING",
        nats_url: str | None = None,
        source: Path | None = None,
    ) -> None:
        """`nats_url`: a NATS of the caller's (a cluster's URLs, comma-separated) instead of
        the embedded server. `source`: run the code of that source tree (a checkout of another
        commit, for a benchmark's baseline) instead of this one's: `up` and every process it
        starts import the project's packages from there (its folder is the first on their path),
        with this environment's interpreter and dependencies."""
        self.port = free_port()
        self.ports = [self.port]
        self.frontends = frontends
        self.dir = Path(tempfile.mkdtemp(prefix="duplexbus-bench-")) if folder is None else folder
        self.run_dir = self.dir / "run"
        self.lines: list[str] = []  # what `up` printed, as read so far
        cmd = [sys.executable, "-m", "duplexbus.cli", "up", "--model", model, "--port", str(self.port)]
        cmd += ["--frontends", str(frontends), "--workers", str(workers), "--run-dir", str(self.run_dir)]
        cmd += ["--colocate"] if colocate else []
        if config:
            cfg = self.dir / "config.yaml"
            cfg.write_text(yaml.safe_dump({"model": model, **config}))
            cmd += ["--config", str(cfg)]
        env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}  # the embedded server, as on a fresh machine
        if log_level is not None:
            env["DUPLEXBUS_LOG"] = log_level
        if nats_url:
            env["NATS_URL"] = nats_url
        if source is not None:
            env = from_source(env, source)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=source)
        try:
            # `up` prints its serving line once every frontend answers and every worker heartbeats.
            self.wait_for("serving", unless="did not become ready")
            url = nats_url or saved_nats_url(self.run_dir)  # with the embedded server's credentials
            if url is None:
                raise RuntimeError("duplexbus up left no NATS URL in its run directory")
            self.nats_url = url
        except BaseException:
            self.close()
            raise

    def wait_for(self, text: str, unless: str | None = None) -> str:
        """The next line `up` prints that holds `text` (every line read is kept in `lines`).
        It blocks: from a coroutine, call it in a thread."""
        assert self.proc.stdout is not None  # opened with stdout=PIPE
        while True:
            line = self.proc.stdout.readline()
            if not line or (unless is not None and unless in line):
                raise RuntimeError(f"no {text!r} from duplexbus up:\n" + "".join(self.lines) + line)
            self.lines.append(line)
            if text in line:
                return line

    def processes(self) -> dict[int, str]:
        """pid -> role (`worker Talker`, `frontend`, `nats-server`...) of every process of the stack."""
        parent: dict[int, int] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        out: dict[int, str] = {}
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                out[pid] = _role(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
            except OSError:
                pass
            todo += [c for c, pp in parent.items() if pp == pid]
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each process of the stack, and of this client."""
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for pid, role in self.processes().items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        t = os.times()
        out["load client"] = t.user + t.system
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        # The stream's store (up to retention.max_bytes, 2 GiB) goes; the logs stay for a look.
        shutil.rmtree(self.run_dir / "nats", ignore_errors=True)

    def __enter__(self) -> UpStack:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def from_source(env: dict[str, str], source: Path) -> dict[str, str]:
    """`env` for a Python process (run in `source`) that imports the project's packages from the
    source tree `source` instead of this one: it goes first on the path, ahead of the editable
    install's finder, which is asked only for what the path does not hold."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(source), *filter(None, [env.get("PYTHONPATH")])])}


def _role(argv: list[bytes]) -> str:
    args = [a.decode(errors="replace") for a in argv if a]
    if args and args[0].endswith("nats-server"):
        return "nats-server"
    for role in ("frontend", "conductor", "worker", "up"):
        if role in args:
            if role == "worker" and "--partition" in args:
                return f"worker {args[args.index('--partition') + 1]}"
            return role
    return " ".join(args[:2])


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def procs_mentioning(text: str) -> list[str]:
    """Processes (other than this one) whose command line or environment mentions `text`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmd or text in env:
            out.append(f"{pid}: {cmd}")
    return out


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class PeakRSS:
    """The largest resident memory of each of some processes, in MiB, sampled every 50 ms
    while in use (`async with PeakRSS(pids) as rss: ...; rss.peak[pid]`)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.idle = {pid: rss_bytes(pid) / 2**20 for pid in pids}
        self.peak = dict(self.idle)
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            for pid in self.pids:
                with contextlib.suppress(OSError, RuntimeError):  # gone meanwhile
                    self.peak[pid] = max(self.peak[pid], rss_bytes(pid) / 2**20)
            await asyncio.sleep(0.05)

    def growth(self) -> dict[int, float]:
        return {pid: self.peak[pid] - self.idle[pid] for pid in self.pids}

    async def __aenter__(self) -> PeakRSS:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass
class AtTerminal:
    """A `duplexbus up` started as at a terminal; `err`: what it wrote to stderr, once stopped."""

    proc: subprocess.Popen[str]
    err: str = ""

    def line(self) -> str:
        """Its next line at the terminal ('' once it has exited)."""
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()


@contextlib.contextmanager
def up_at_terminal(argv: list[str], unset: Iterable[str] = ("NATS_URL", "DUPLEXBUS_CONFIG")) -> Iterator[AtTerminal]:
    """`duplexbus up ARGV` in a session of its own, without the environment's `unset`
    variables; stopped at the end as Ctrl-C stops it (SIGINT to its group)."""
    drop = set(unset)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplexbus.cli", "up", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    up = AtTerminal(proc)
    try:
        yield up
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        up.err = proc.communicate(timeout=40)[1]
