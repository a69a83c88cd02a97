"""The health server of workers and the conductor: /livez, /readyz, /metrics over a real socket,
and the answers themselves without one; then a live stack on the test nats-server (each
service a process of its own, `--log-format json`): a worker's /metrics, /livez and /readyz
(its port from $DUPLEXBUS_HEALTH_PORT, as in compose), NATS service discovery of the worker
and the conductor, and a quiet call that logs nothing at INFO but its three events."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.micro.service import ServiceVerb, control_subject

from shared.bus import subjects
from shared.bus.embedded import free_port
from shared.runtime.health import HealthServer
from shared.runtime.metrics import WorkerMetrics
from tests.support.bus import worker_stats
from tests.support.calls import EchoCall
from tests.support.stack import Proc, Stack


def test_readyz_names_each_check_and_fails_on_any() -> None:
    checks = {"nats": True, "stream": True, "conductor": False}
    server = HealthServer(WorkerMetrics(), lambda: checks)
    status, _, body = server.answer("/readyz")
    assert status == 503 and json.loads(body) == {"ready": False, "checks": checks}
    checks["conductor"] = True
    status, _, body = server.answer("/readyz?verbose=1")
    assert status == 200 and json.loads(body)["ready"] is True
    assert server.answer("/livez")[0] == 200
    assert server.answer("/nope")[0] == 404


def test_metrics_are_there_at_zero_before_any_call() -> None:
    m = WorkerMetrics()
    m.batch_size.labels("Talker").observe(3)
    text = HealthServer(m, dict).answer("/metrics")[2].decode()
    assert "duplexbus_worker_live_calls 0.0" in text
    assert 'duplexbus_worker_batch_size_count{partition="Talker"} 1.0' in text


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_served_over_http() -> None:
    ready = {"nats": False}
    server = HealthServer(WorkerMetrics(), lambda: ready, host="127.0.0.1", port=0)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert (await asyncio.to_thread(_get, f"{base}/livez"))[0] == 200
        assert (await asyncio.to_thread(_get, f"{base}/readyz"))[0] == 503
        ready["nats"] = True
        assert (await asyncio.to_thread(_get, f"{base}/readyz"))[0] == 200
        status, body = await asyncio.to_thread(_get, f"{base}/metrics")
        assert status == 200 and b"duplexbus_worker_step_seconds" in body
        # Nonsense, or a probe that never finishes its request, is dropped without an answer.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"garbage\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await server.close()


# --- a live stack ----------------------------------------------------------------------------


class Observed:
    """The stack, and where its conductor's and worker's health servers listen."""

    def __init__(self, stack: Stack, conductor: int, worker: int) -> None:
        self.stack, self.conductor, self.worker = stack, conductor, worker

    def log_records(self, name: str) -> list[dict[str, Any]]:
        """The process's log, every line one JSON object (a line that is not fails the test)."""
        lines = [line for line in self.stack.procs[name].log.read_text().splitlines() if line.strip()]
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
async def observed(nats_url: str) -> AsyncIterator[Observed]:
    stack = Stack(nats_url, {"model": "echo"})
    stack.env.pop("DUPLEXBUS_LOG_FORMAT", None)  # the flag alone says json
    await stack.reset_bus()
    conductor, worker = free_port(), free_port()
    cli = [sys.executable, "-m", "duplexbus.cli"]
    config = ["--config", str(stack.config_path), "--log-format", "json"]

    def start(name: str, argv: list[str], **env: str) -> None:
        stack.procs[name] = Proc(name, [*cli, *argv, *config], {**stack.env, **env}, stack.dir)

    try:
        start("conductor", ["conductor", "--health-port", str(conductor)])
        start("worker-0", ["worker"], DUPLEXBUS_HEALTH_PORT=str(worker))  # as docker-compose.yml gives it
        port = free_port()
        start("frontend-0", ["frontend", "--port", str(port)])
        stack.ports.append(port)
        stack.port_owner[port] = "frontend-0"
        await stack.wait_ready(port)
        await stack.wait_workers(1)
        yield Observed(stack, conductor, worker)
    finally:
        stack.stop()


async def _ready(port: int, timeout: float = 20.0) -> tuple[int, bytes]:
    """/readyz, once it says ready (its checks run every heartbeat), or its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/readyz")
        if status == 200 or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.2)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m is not None, f"{name}{labels} not in:\n{text}"
    return float(m.group(1))


def _stall_reads(metrics: str) -> float:
    """The worker's stall reads so far (a label appears once counted)."""
    label = '{reason="stall"}'
    return _metric(metrics, "duplexbus_worker_catch_up_reads_total", label) if label in metrics else 0.0


async def _worker_metrics(observed: Observed) -> str:
    status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{observed.worker}/metrics")
    assert status == 200
    return body.decode()


async def test_a_live_workers_metrics_livez_and_readyz(observed: Observed) -> None:
    call = await EchoCall.open(observed.stack.ws_url(), "metered", frames=4)
    await call.finish(logs=observed.stack.logs())
    status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{observed.worker}/livez")
    assert status == 200 and json.loads(body) == {"live": True, "checks": {"bus": True}}  # its connection not lost
    status, body = await _ready(observed.worker)
    checks = {"nats": True, "stream": True, "conductor": True, "serving": True}  # serving: not stuck (worker_stuck_s)
    assert status == 200 and json.loads(body) == {"ready": True, "checks": checks}
    text = await _worker_metrics(observed)
    for partition in ("Encoder", "Talker"):  # echo's two, both on this worker
        assert _metric(text, "duplexbus_worker_batch_size_count", f'{{partition="{partition}"}}') >= 1
        assert _metric(text, "duplexbus_worker_step_seconds_count", f'{{partition="{partition}"}}') >= 1
    assert _metric(text, "duplexbus_worker_catch_up_reads_total", '{reason="placed"}') >= 1
    assert _metric(text, "duplexbus_worker_live_calls") == 0  # it ended
    # The conductor's, on its --health-port, sees the same worker.
    status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{observed.conductor}/metrics")
    assert status == 200 and _metric(body.decode(), "duplexbus_conductor_workers_alive") == 1


async def test_the_worker_and_the_conductor_answer_ping_info_and_stats(observed: Observed) -> None:
    """What `nats micro ls/info/stats` asks, over the standard subjects."""
    [worker] = await worker_stats(observed.stack.nats_url)  # a request to the worker's own endpoint
    nc = await nats.connect(observed.stack.nats_url)
    try:
        await nc.request(subjects.conductor_status(), b"", timeout=5)  # and one to the conductor's

        async def ask(verb: ServiceVerb, service: str) -> dict[str, Any]:
            reply = await nc.request(control_subject(verb, service), b"", timeout=5)
            answer: dict[str, Any] = json.loads(reply.data)
            assert answer["name"] == service and answer["type"] == f"io.nats.micro.v1.{verb.value.lower()}_response", answer
            return answer

        ping = await ask(ServiceVerb.PING, subjects.SERVICE_WORKER)
        info = await ask(ServiceVerb.INFO, subjects.SERVICE_WORKER)
        assert info["id"] == ping["id"] and info["metadata"]["model"] == "echo"
        assert info["metadata"]["partitions"] == "Encoder,Talker"
        [endpoint] = info["endpoints"]
        assert endpoint["name"] == "stats" and endpoint["subject"] == subjects.worker_stats(info["metadata"]["worker_id"])
        assert worker["worker_id"] == info["metadata"]["worker_id"]  # the one worker of the stack
        stats = await ask(ServiceVerb.STATS, subjects.SERVICE_WORKER)
        assert stats["endpoints"][0]["num_requests"] >= 1 and stats["endpoints"][0]["num_errors"] == 0

        info = await ask(ServiceVerb.INFO, subjects.SERVICE_CONDUCTOR)
        assert [(e["name"], e["subject"]) for e in info["endpoints"]] == [("status", subjects.conductor_status())]
        stats = await ask(ServiceVerb.STATS, subjects.SERVICE_CONDUCTOR)
        assert stats["endpoints"][0]["num_requests"] >= 1 and stats["endpoints"][0]["num_errors"] == 0
    finally:
        await nc.close()


async def test_log_format_json_flag_makes_every_line_one_json_object(observed: Observed) -> None:
    # uvicorn's own warning too (it logged a text line of its own before)
    reader, writer = await asyncio.open_connection("127.0.0.1", observed.stack.ports[0])
    writer.write(b"NOT HTTP \x00\x01\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 400")
    writer.close()
    log = observed.stack.procs["frontend-0"].log
    deadline = time.monotonic() + 10
    while "Invalid HTTP request" not in log.read_text():
        assert time.monotonic() < deadline, "uvicorn said nothing of a request that is not HTTP"
        await asyncio.sleep(0.1)
    for name, role in (("conductor", "conductor"), ("worker-0", "worker"), ("frontend-0", "frontend")):
        records = observed.log_records(name)  # a line that is not JSON fails here
        assert records and all(r["role"] == role and {"time", "level", "logger", "message"} <= set(r) for r in records), name
    assert any(r["message"].startswith("worker ") and "serving echo" in r["message"] for r in observed.log_records("worker-0"))


async def test_a_quiet_call_logs_nothing_at_info_but_its_three_events(observed: Observed) -> None:
    """A client that goes quiet mid-call is ordinary: the worker reads the stream again after
    a while (a lost last item would leave no gap otherwise), and says so at DEBUG only."""
    before = _stall_reads(await _worker_metrics(observed))
    call = await EchoCall.open(observed.stack.ws_url(), "quiet", frames=3)
    await call.send(1)
    await call.echoed(0)
    deadline = time.monotonic() + 20
    while True:  # quiet until the worker has read the stream for it at least once
        if _stall_reads(await _worker_metrics(observed)) > before:
            break
        assert time.monotonic() < deadline, "no stall read in 20 s"
        await asyncio.sleep(0.5)
    final = await call.end()
    call.check(final, observed.stack.logs())
    await call.ws.close()
    cid = final["finish"]["call_id"]
    said = [
        (name, r["level"], r.get("event") or r["message"])
        for name in ("frontend-0", "conductor", "worker-0")
        for r in observed.log_records(name)
        if cid in json.dumps(r) and r["level"] != "DEBUG"
    ]
    assert sorted(said) == [
        ("conductor", "INFO", "call placed"),
        ("frontend-0", "INFO", "call finished"),
        ("frontend-0", "INFO", "call opened"),
    ], said
