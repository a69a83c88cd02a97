"""`duplexbus up`: the embedded NATS server and every service as supervised children.

Children run in their own sessions so a terminal's Ctrl-C reaches only this
supervisor, which stops them in order: frontends first (stop intake), then
workers (drain), then the conductor, then NATS. A child that dies is restarted; one
whose `/livez` stops answering (frozen) or says it cannot recover is killed and
restarted (liveness.py). If the supervisor itself is killed, the kernel stops the
children (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec

from duplexbus.liveness import Life, LivenessJudge, Probe
from services.frontend.exposure import open_warning
from shared.bus.embedded import NatsServer, StoreInUse, free_port, shared_procs
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError
from shared.runtime.process import die_with_parent

log = logging.getLogger(__name__)

POLL_S = 0.2  # the supervision loop's pass
RESTART_RESET_S = 30.0  # a child that ran this long restarts with the shortest backoff again
PROBE_S = 1.0  # each child's /livez is asked this often
PROBE_TIMEOUT_S = 1.0


@dataclass
class Child:
    name: str
    argv: list[str]
    order: int  # stop order: lower stops first
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started: float = 0.0
    restart_at: float | None = None  # set once its exit is noticed: when it starts again
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the frontends' listening socket)

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        out = open(log_dir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            pass_fds=self.pass_fds,
        )
        out.close()
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def health_port(self) -> int | None:
        """Where its /livez, /readyz and /metrics are (None: it serves none)."""
        return int(self.argv[self.argv.index("--health-port") + 1]) if "--health-port" in self.argv else None


@dataclass
class UpOptions:
    config: str | None
    model: str | None
    frontends: int
    workers: int
    port: int
    host: str
    run_dir: Path
    ready_timeout: float = 120.0
    colocate: bool = False  # each worker process runs every partition
    stop_timeout: float = 15.0  # per group of children; more than their shutdown_drain_s
    nats_monitor_port: int | None = None  # the embedded nats-server's monitoring port (None: a free one)
    nats_procs: int | None = None  # the embedded nats-server's GOMAXPROCS (None: shared_procs decides)
    health_host: str = "127.0.0.1"  # where the conductor's and workers' /livez, /readyz, /metrics listen (health_host)


def plan(opts: UpOptions, partitions: list[str], listen_fds: list[int] | None = None) -> list[Child]:
    """The children to start. With `listen_fds`, frontend i accepts on inherited socket i (all
    on one port); without, frontend i binds port + i itself."""
    py = [sys.executable, "-m", "duplexbus.cli"]
    common = (["--config", opts.config] if opts.config else []) + (["--model", opts.model] if opts.model else [])
    children = [Child("conductor", [*py, "conductor", *common, *_health(opts)], order=2)]
    if opts.colocate:
        for i in range(opts.workers):
            children.append(Child(f"worker-{i}", [*py, "worker", *common, *_health(opts)], order=1))
    else:
        for p in partitions:
            for i in range(opts.workers):
                argv = [*py, "worker", *common, "--partition", p, *_health(opts)]
                children.append(Child(f"worker-{p}-{i}", argv, order=1))
    for i in range(opts.frontends):
        fd = listen_fds[i] if listen_fds else None
        where = ["--fd", str(fd)] if fd is not None else ["--host", opts.host, "--port", str(opts.port + i)]
        fds = (fd,) if fd is not None else ()
        # A port of its own too: the shared port cannot tell one frontend's /livez from another's.
        argv = [*py, "frontend", *common, *where, *_health(opts)]
        children.append(Child(f"frontend-{i}", argv, order=0, pass_fds=fds))
    return children


def _health(opts: UpOptions) -> list[str]:
    """A child's /livez, /readyz and /metrics: a free port of its own."""
    return ["--health-port", str(free_port(opts.health_host))]


def health_urls(children: list[Child], host: str) -> list[str]:
    out = []
    for c in children:
        if c.health_port is not None and not c.name.startswith("frontend"):  # (theirs: on the serving port)
            out.append(f"{c.name} http://{host}:{c.health_port}/metrics")
    return out


def probe_host(host: str) -> str:
    """Where to reach a port bound on `host` from this machine (a wildcard: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def probe_livez(url: str, timeout: float = PROBE_TIMEOUT_S) -> Probe:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return Probe.LIVE if r.status == 200 else Probe.FAILING
    except urllib.error.HTTPError as e:  # it answers: 503 is its word that it cannot recover
        return Probe.FAILING if e.code == 503 else Probe.LIVE
    except OSError:  # refused, reset, timed out: a process that does not answer
        return Probe.SILENT


class Prober:
    """Asks each child's /livez every PROBE_S, in threads (a frozen child's timeout never holds
    the supervision loop), and kills the children its judges condemn (liveness.py); the
    loop's `tend` then restarts them as any child that exited."""

    def __init__(
        self, children: list[Child], host: str, bound_s: float, start_grace_s: float,
        probe: Callable[[str], Probe] | None = None, pool: Executor | None = None,
    ) -> None:  # fmt: skip
        """`start_grace_s`: what a restarted child has before its silence counts (the children
        there at the first pass are up and ready: none). `probe` and `pool`: probe_livez, and
        threads of its own, unless given (tests)."""
        watched = [c for c in children if c.health_port is not None]
        self.start_grace_s = start_grace_s
        self._host = probe_host(host)
        self._judges = {c.name: LivenessJudge(bound_s) for c in watched}
        self._probe = probe or probe_livez
        self._pool = pool or ThreadPoolExecutor(max_workers=max(1, len(watched)), thread_name_prefix="livez")
        self._asked: dict[str, tuple[int, Future[Probe]]] = {}  # name -> (the pid asked, its answer)
        self._pids: dict[str, int] = {}  # the process each judge judges
        self._due: dict[str, float] = {}

    def tend(self, children: list[Child], now: float) -> None:
        for c in children:
            judge = self._judges.get(c.name)
            if judge is None or c.proc is None or not c.alive():
                continue  # an exit is the restart loop's
            if self._pids.get(c.name) != c.proc.pid:  # (re)started
                judge.started(now, self.start_grace_s if c.name in self._pids else 0.0)
                self._pids[c.name] = c.proc.pid
            self._hear(c, judge, now)
            if c.name not in self._asked and now >= self._due.get(c.name, 0.0):
                url = f"http://{self._host}:{c.health_port}/livez"
                self._asked[c.name] = (c.proc.pid, self._pool.submit(self._probe, url))
                self._due[c.name] = now + PROBE_S

    def _hear(self, c: Child, judge: LivenessJudge, now: float) -> None:
        asked = self._asked.get(c.name)
        if asked is None or not asked[1].done():
            return
        del self._asked[c.name]
        if asked[0] != self._pids[c.name] or judge.heard(asked[1].result(), now) is not Life.REPLACING:
            return
        print(f"{c.name} (pid {asked[0]}): {judge.why}; killing it (SIGKILL) to start a new one", flush=True)
        assert c.proc is not None
        with contextlib.suppress(ProcessLookupError):
            c.proc.kill()

    def state(self, name: str) -> Life | None:
        """How child `name` is judged now (None: it serves no /livez)."""
        judge = self._judges.get(name)
        return None if judge is None else judge.state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _never() -> bool:
    return False


def wait_http(url: str, timeout: float, children: list[Child], stopping: Callable[[], bool] = _never, frontends: int = 1) -> bool:
    """Until `frontends` distinct frontends have answered `url` (their /healthz) 200.

    Several frontends listen on the one port, each on a socket of its own, and the kernel
    hands each new connection to one of them: one ready answer says nothing of the others,
    and a client the kernel gives a frontend still starting is refused (503, or 1013 on a
    WebSocket). So the probe goes on, on fresh connections, until every frontend has said
    ready once; a frontend once ready stays so until it stops."""
    deadline = time.monotonic() + timeout
    ready: set[str] = set()
    while time.monotonic() < deadline and not stopping():
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    ready.add(str(json.loads(r.read()).get("frontend_id")))
        if len(ready) >= frontends:
            return True
        if any(c.proc is not None and c.proc.poll() is not None for c in children if c.name.startswith("frontend")):
            return False
        time.sleep(0.05 if ready else 0.1)  # one answered: the others are likely up, or nearly
    return False


def wait_workers(
    cfg: ServingConfig, expected: int, timeout: float, children: list[Child], stopping: Callable[[], bool] = _never
) -> bool:
    """Until `expected` workers heartbeat (their models load after the frontend is up), or
    `stopping()`. A bus failure that may pass (NATS busy) is looked past, logged once while it
    lasts; one that will not (credentials, permissions) is raised at once (a BusError), not
    waited out until the timeout."""
    import asyncio

    from shared.bus import subjects
    from shared.bus.connection import BusConnection
    from shared.runtime.errors import BusNotFound
    from shared.runtime.retry import Outage

    outage = Outage("counting the workers' heartbeats", log)

    async def count(conn: BusConnection) -> int:
        try:
            kv = await conn.bucket(subjects.KV_WORKERS, create=False)
        except BusNotFound:  # no worker has made the bucket yet: none so far, no fault
            return 0
        return len(await kv.keys())

    async def poll() -> bool:
        deadline = time.monotonic() + timeout
        if stopping():
            return False
        try:  # the config's credentials and TLS too; its connect retries until NATS answers
            conn = await asyncio.wait_for(BusConnection.open(cfg, "duplexbus-up", stream=False), timeout)
        except TimeoutError:
            return False
        try:
            while time.monotonic() < deadline and not stopping():
                if any(not c.alive() for c in children if c.name.startswith("worker")):
                    return False
                try:
                    n = await count(conn)
                except BusError as e:
                    if not e.recoverable:
                        raise
                    outage.failed(e, time.monotonic())
                else:
                    outage.ok(time.monotonic())
                    if n >= expected:
                        return True
                await asyncio.sleep(0.2)
            return False
        finally:
            await conn.close()

    return asyncio.run(poll())


def tend(
    children: list[Child], env: dict[str, str], log_dir: Path, now: float, exited: Callable[[Child], None] | None = None
) -> None:
    """One pass of the supervision loop: note the children that exited, restart those whose backoff is over.
    `exited` is told of each exit as it is noticed.

    Never waits: the loop checks for a stop between passes, so a backoff neither delays
    Ctrl-C nor restarts a child after it.
    """
    for c in children:
        if c.alive():
            continue
        if c.restart_at is None:
            if exited is not None:
                exited(c)
            if now - c.started > RESTART_RESET_S:
                c.restarts = 0
            backoff = min(10.0, 0.5 * 2**c.restarts)
            code = c.proc.returncode if c.proc else None
            print(f"{c.name} exited ({code}); restarting in {backoff:.1f}s", flush=True)
            c.restart_at = now + backoff
        elif now >= c.restart_at:
            c.restarts += 1
            c.restart_at = None
            c.start(env, log_dir)


NATS_URL_FILE = "nats.url"  # in the run directory: the embedded server's URL, credentials included


def saved_nats_url(run_dir: Path) -> str | None:
    """The URL `duplexbus up` left in `run_dir` for the CLI's bus commands (None: none there)."""
    try:
        return (run_dir / NATS_URL_FILE).read_text().strip() or None
    except OSError:
        return None


def save_nats_url(path: Path, url: str) -> None:
    """Readable by this user alone: the URL carries the embedded server's password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")


def listen(host: str, port: int, n: int) -> list[socket.socket]:
    """One listening socket per frontend, all on `host:port` in one SO_REUSEPORT group: the
    kernel spreads new connections evenly over them (one socket shared by every process
    goes mostly to whichever wakes first). A frontend that restarts gets its socket back:
    alone, with what waits in it; with others, a new one (`renew`).

    The port is first bound alone, without SO_REUSEPORT: where anything holds it (another
    duplexbus up included, whose group this would otherwise join) that fails, and the port
    is refused before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def renew(sock: socket.socket) -> None:
    """A new socket in the group in place of `sock` (same descriptor, so the frontend's
    `--fd` stays right), bound and not listening: it takes no connection until the next
    frontend listens on it, as it starts serving. The old one goes (once its frontend is
    gone), and the connections that waited in it are reset: they had landed on a dead or
    frozen frontend, and a client that tries again lands on a live one; the kernel gives new
    connections to the other frontends meanwhile, instead of to a queue that nobody reads
    for the seconds a new frontend takes to start."""
    fresh = socket.socket(sock.family)
    try:
        fresh.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        fresh.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        fresh.bind(sock.getsockname())
        os.dup2(fresh.fileno(), sock.fileno(), inheritable=True)
    finally:
        fresh.close()


def port_taken(host: str, port: int | None) -> str | None:
    """Why `host:port` cannot be listened on (None: it can, or no port was asked for)."""
    if port is None:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


class EmbeddedNats:
    """The embedded nats-server as one more supervised child: restarted on its port and store
    if it exits, so the services (which reconnect by themselves) carry on."""

    def __init__(self, server: NatsServer) -> None:
        self.server = server
        self.restarts = 0
        self.restart_at: float | None = None

    def tend(self, now: float) -> None:
        code = self.server.exited()
        if code is None:
            return
        if self.restart_at is None:
            backoff = min(10.0, 0.5 * 2**self.restarts)
            print(f"nats-server exited ({code}); restarting in {backoff:.1f}s", flush=True)
            self.restart_at = now + backoff
        elif now >= self.restart_at:
            self.restarts += 1
            self.restart_at = None
            try:
                self.server.start()
            except (OSError, RuntimeError, TimeoutError, StoreInUse) as e:
                print(f"nats-server did not start again: {e}", flush=True)


def run_up(opts: UpOptions, partitions: list[str], cfg: ServingConfig) -> int:
    """Serve until SIGINT/SIGTERM. NATS is `cfg.nats_url` (the config's or $NATS_URL) when set,
    else an embedded server, with generated credentials. Returns 1 when the stack never became
    ready (a stop during start-up, Ctrl-C say, ends the wait at once), 2 when it could not
    start at all (the port or the NATS store in use), having started nothing."""
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    if not cfg.nats_url and (cfg.nats_creds or cfg.nats_tls):
        # The children would offer both to the embedded server, which takes its own password only.
        print("error: NATS credentials or TLS are set (nats_creds/nats_tls, or $NATS_CREDS, $NATS_CA, $NATS_CERT, "
              "$NATS_KEY) but no NATS URL: they are for your own NATS server, so give its URL too (NATS_URL or "
              "nats_url); the embedded server makes credentials of its own", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = opts.run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    try:
        listeners = listen(opts.host, opts.port, opts.frontends)
    except OSError as e:
        print(f"error: cannot serve on {opts.host}:{opts.port}: {e.strerror or e}; another duplexbus up (or another "
              "program) holds it: stop it, or choose another --port", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    env = dict(os.environ)
    nats: EmbeddedNats | None = None
    children: list[Child] = []
    prober: Prober | None = None
    ready = failed = False
    try:
        if not cfg.nats_url:
            server = NatsServer(
                opts.run_dir / "nats",
                log_file=log_dir / "nats-server.log",
                monitor_port=opts.nats_monitor_port,
                credentials=("duplexbus", secrets.token_urlsafe(24)),
                procs=shared_procs(opts.nats_procs, os.environ, os.cpu_count() or 1),
            )
            taken = port_taken(server.host, opts.nats_monitor_port)
            if taken:
                where = f"{server.host}:{opts.nats_monitor_port}"
                print(f"error: cannot serve NATS monitoring on {where}: {taken}; choose another --nats-monitor-port "
                      "(or nats_monitor_port in the config)", file=sys.stderr, flush=True)  # fmt: skip
                return 2
            try:
                nats = EmbeddedNats(server.start())
            except StoreInUse as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return 2
            except (RuntimeError, TimeoutError) as e:  # it exited, or never answered: its log says why
                print(f"error: the embedded nats-server did not start: {e}", file=sys.stderr, flush=True)
                return 2
            save_nats_url(opts.run_dir / NATS_URL_FILE, server.client_url)
            env["NATS_URL"] = server.client_url
            cfg = msgspec.structs.replace(cfg, nats_url=server.client_url)
            procs = f", GOMAXPROCS {server.procs}" if server.procs else ""
            print(f"nats-server (embedded) on {server.url}, store {opts.run_dir / 'nats'}, "
                  f"monitoring on http://{server.host}:{server.monitor_port}{procs}", flush=True)  # fmt: skip
        else:
            from shared.bus.connection import redacted

            print(f"using NATS at {redacted(cfg.nats_url)}", flush=True)  # the children read the same config
        children = plan(opts, partitions, [s.fileno() for s in listeners])
        for c in sorted(children, key=lambda c: -c.order):  # conductor, workers, then frontends
            c.start(env, log_dir)
        url = f"http://{opts.host}:{opts.port}"
        workers = opts.workers if opts.colocate else len(partitions) * opts.workers
        try:
            ready = wait_http(f"{url}/healthz", opts.ready_timeout, children, lambda: stop, opts.frontends) and wait_workers(
                cfg, workers, opts.ready_timeout, children, lambda: stop
            )
        except BusError as e:  # refused for good (credentials, permissions): waiting longer mends nothing
            print(f"error: duplexbus cannot see its workers start: {e}", file=sys.stderr, flush=True)
            failed = stop = True
        if ready:
            # The frontends log it, into files; the person at the terminal must see it too.
            warning = open_warning(opts.host, cfg)
            if warning is not None:
                print(warning, file=sys.stderr, flush=True)
            print(f"metrics: {url}/metrics (frontends), " + ", ".join(health_urls(children, opts.health_host)), flush=True)
            print(f"duplexbus serving on {url}  (logs in {log_dir}; Ctrl-C stops everything)", flush=True)
        elif not stop:  # (a stop during start-up is no failure)
            print(f"duplexbus did not become ready; see the logs in {log_dir}", flush=True)
            failed = stop = True
        prober = Prober(children, opts.health_host, cfg.liveness_s, opts.ready_timeout)
        exited = _frontend_exits(listeners) if len(listeners) > 1 else None
        while not stop:
            now = time.monotonic()
            if nats is not None:
                nats.tend(now)
            prober.tend(children, now)
            tend(children, env, log_dir, now, exited)
            time.sleep(POLL_S)
    finally:
        if prober is not None:
            prober.close()
        stop_all(children, opts.stop_timeout)
        for s in listeners:
            s.close()
        if nats is not None:
            nats.server.stop()
            (opts.run_dir / NATS_URL_FILE).unlink(missing_ok=True)
        print("stopped", flush=True)
    return 1 if failed else 0


def _frontend_exits(listeners: list[socket.socket]) -> Callable[[Child], None]:
    """What the loop does as a frontend's exit is noticed: the frontend's socket renewed, so
    that no new connection waits on it while the next one starts (the others take them)."""
    by_fd = {s.fileno(): s for s in listeners}

    def exited(c: Child) -> None:
        if "--fd" in c.argv:
            sock = by_fd.get(int(c.argv[c.argv.index("--fd") + 1]))
            if sock is not None:
                renew(sock)

    return exited


def stop_all(children: list[Child], timeout: float) -> None:
    for order in sorted({c.order for c in children}):
        group = [c for c in children if c.order == order and c.alive()]
        for c in group:
            assert c.proc is not None
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in group:
            assert c.proc is not None
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
