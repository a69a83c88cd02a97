"""What an operator sees of a running stack (`duplexbus up --model echo`, JSON logs): Prometheus
metrics on the frontend and on the conductor's health port, /livez and /readyz on both, one
log line per call opened, placed and finished (with its cid), the conductor in NATS
service discovery, and the embedded nats-server's monitoring on the configured port."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import nats
import numpy as np
import pytest

from models.echo import FRAME
from shared.bus import subjects
from shared.bus.embedded import free_port
from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.poll import until_sync
from tests.support.stack import UpStack


@pytest.fixture(scope="module")
def monitor_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def up(monitor_port: int) -> Iterator[UpStack]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DUPLEXBUS_LOG_FORMAT", "json")
    try:
        # shutdown_unlist_s 0: no gateway waits on a stopping frontend's 503 here (3 s a stop).
        config = {"nats_monitor_port": monitor_port, "shutdown_unlist_s": 0.0}
        with UpStack("echo", log_level=None, config=config) as stack:
            yield stack
    finally:
        mp.undo()


def _ready(url: str) -> str:
    """/readyz's body once it answers 200, else "" (not yet)."""
    status, body = get(f"{url}/readyz")
    return body if status == 200 else ""


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m is not None, f"{name}{labels} not in the metrics"
    return float(m.group(1))


async def one_call(port: int) -> str:
    ws = await WS.connect(f"ws://127.0.0.1:{port}/generate/ws")
    try:
        samples = (np.arange(4 * FRAME) % 3000).astype("<i2")
        await ws.send({"request_id": "observed", "files": [pcm_file(samples)], "end_input": True})
        final = await ws.final("observed", timeout=30)
        assert "finish" in final, final
        return str(final["finish"]["call_id"])
    finally:
        await ws.close()


def test_metrics_health_and_call_lines(up: UpStack) -> None:
    cid = asyncio.run(one_call(up.port))
    base = f"http://127.0.0.1:{up.port}"
    conductor = next(line for line in up.lines if line.startswith("metrics:")).split("conductor ")[1].split(",")[0].strip()
    status, text = get(f"{base}/metrics")
    assert status == 200
    assert metric(text, "duplexbus_frontend_calls_total", '{outcome="completed",status="200"}') == 1
    assert metric(text, "duplexbus_frontend_appends_total") == 4
    assert metric(text, "duplexbus_frontend_reply_lag_seconds_count") == 4
    assert metric(text, "duplexbus_frontend_live_calls") == 0
    # The loop's timer, sampled every 0.1 s from the frontend's connect on (a call that ends
    # within the first 0.1 s finds none yet).
    until_sync(lambda: metric(get(f"{base}/metrics")[1], "duplexbus_frontend_loop_lag_seconds_count") > 0, 5, "a loop sample")
    status, text = get(conductor)
    assert status == 200
    assert metric(text, "duplexbus_conductor_placements_total") == 2  # echo's two partitions
    assert metric(text, "duplexbus_conductor_placement_wait_seconds_count") == 1
    assert metric(text, "duplexbus_conductor_workers_alive") == 2
    for url in (base, conductor.removesuffix("/metrics")):
        assert get(f"{url}/livez")[0] == 200
        # Its checks run every heartbeat, each asking the bus with a 1 s bound: one answer late on
        # a busy machine leaves a check false until the next (seen once in a full run), so wait
        # for ready within a few beats, as test_health does.
        ready = until_sync(functools.partial(_ready, url), 10, f"{url}/readyz says ready")
        assert json.loads(ready) == {"ready": True, "checks": {"nats": True, "stream": True, "conductor": True}}
    # One JSON line per call event, the cid a key of its own.
    logs = up.run_dir / "logs"
    records = [
        json.loads(line)
        for name in ("frontend-0.log", "conductor.log")
        for line in (logs / name).read_text().splitlines()
        if line.startswith("{")
    ]
    events = {r["event"]: r for r in records if r.get("cid") == cid}
    assert set(events) == {"call opened", "call placed", "call finished"}, records[-5:]
    assert events["call finished"]["status"] == 200 and events["call finished"]["outputs"] == 4
    assert events["call finished"]["role"] == "frontend" and events["call placed"]["role"] == "conductor"


def test_the_conductor_answers_service_discovery(up: UpStack) -> None:
    async def ask() -> dict[str, object]:
        nc = await nats.connect(up.nats_url)
        try:
            reply = await nc.request(subjects.service_ping(subjects.SERVICE_CONDUCTOR), b"", timeout=5)
            info = json.loads(reply.data)
            status = await nc.request(subjects.conductor_status(), b"", timeout=5)
            return {"ping": info, "status": json.loads(status.data)}
        finally:
            await nc.close()

    got = asyncio.run(ask())
    ping, status = got["ping"], got["status"]
    assert (
        isinstance(ping, dict) and ping["name"] == subjects.SERVICE_CONDUCTOR and ping["type"] == "io.nats.micro.v1.ping_response"
    )
    assert isinstance(status, dict) and len(status["workers"]) == 2


def test_the_embedded_nats_monitoring_is_on_the_configured_port_and_printed(up: UpStack, monitor_port: int) -> None:
    line = next(line for line in up.lines if line.startswith("nats-server (embedded)"))
    assert f"monitoring on http://127.0.0.1:{monitor_port}" in line, line
    status, body = get(f"http://127.0.0.1:{monitor_port}/healthz?js-enabled-only=true")
    assert status == 200 and json.loads(body) == {"status": "ok"}
