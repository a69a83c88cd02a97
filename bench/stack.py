"""Start `duplexbus up` for a benchmark and stop it afterwards (shared by the bench scripts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

import nats
from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

from duplexbus.supervisor import saved_nats_url
from shared.bus import subjects
from shared.bus.embedded import free_port


async def bucket_keys(kv: KeyValue, tries: int = 20) -> list[str]:
    """A bucket's keys. Listing is a watch, which can come back empty on a busy server: an
    empty listing is tried again, up to `tries` times in all (0.1 s apart)."""
    for i in range(tries):
        with contextlib.suppress(NoKeysError):
            return list(await kv.keys())
        if i + 1 < tries:
            await asyncio.sleep(0.1)
    return []


def is_final(m: dict) -> bool:
    """Whether a reply ends its call: the finish, or an error that is not an append's (those leave the call running)."""
    return "finish" in m or ("error" in m and not m.get("append"))


class UpStack:
    def __init__(
        self,
        model: str = "echo",
        frontends: int = 1,
        workers: int = 1,
        config: dict | None = None,
        colocate: bool = False,
        nats_url: str | None = None,
    ) -> None:
        """`nats_url`: a NATS of the caller's (a cluster) instead of up's embedded server."""
        self.port = free_port()  # every frontend serves on it
        self.dir = Path(tempfile.mkdtemp(prefix="duplexbus-bench-"))
        cmd = [sys.executable, "-m", "duplexbus.cli", "up", "--model", model, "--port", str(self.port)]
        cmd += ["--frontends", str(frontends), "--workers", str(workers), "--run-dir", str(self.dir / "run")]
        cmd += ["--colocate"] if colocate else []
        if config:
            import yaml

            cfg = self.dir / "config.yaml"
            cfg.write_text(yaml.safe_dump({"model": model, **config}))
            cmd += ["--config", str(cfg)]
        env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
        env["DUPLEXBUS_LOG"] = "WARNING"
        if nats_url:
            env["NATS_URL"] = nats_url
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.frontends = frontends
        self._wait_ready()
        url = nats_url or saved_nats_url(self.dir / "run")  # with the embedded server's credentials
        if url is None:
            raise RuntimeError("duplexbus up left no NATS URL in its run directory")
        self.nats_url = url

    def _wait_ready(self) -> None:
        """`up` prints its serving line once every frontend answers and every worker heartbeats."""
        assert self.proc.stdout is not None
        while "serving" not in (line := self.proc.stdout.readline()):
            if not line or "did not become ready" in line:
                raise RuntimeError(f"duplexbus up did not become ready: {line.strip()}")

    def ws_url(self, i: int = 0) -> str:
        return f"ws://127.0.0.1:{self.port}/generate/ws"  # the kernel spreads sockets over the frontends

    async def worker_stats(self, reset: bool = False) -> list[dict]:
        nc = await nats.connect(servers=self.nats_url.split(","))  # a cluster's URLs are a list
        try:
            kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
            out = []
            for wid in await bucket_keys(kv):
                r = await nc.request(subjects.worker_stats(wid), b"reset" if reset else b"", timeout=5)
                out.append(json.loads(r.data))
            return out
        finally:
            await nc.close()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each process of the stack, and of this client."""
        tick = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        mine, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            mine.append(pid)
            todo += [c for c, pp in parent.items() if pp == pid]
        out: dict[str, float] = {}
        for pid in mine:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            out[_role(argv)] = out.get(_role(argv), 0.0) + (int(fields[11]) + int(fields[12])) / tick
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
        # The stream's store (up to retention.max_bytes, 2 GiB) goes; the logs stay for a look.
        shutil.rmtree(self.dir / "run" / "nats", ignore_errors=True)

    def __enter__(self) -> UpStack:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


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


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.machine()}, Python {platform.python_version()}"
