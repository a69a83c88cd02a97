"""The health server of workers and the conductor: /livez, /readyz, /metrics over a real socket,
and the answers themselves without one."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from shared.runtime.health import HealthServer
from shared.runtime.metrics import WorkerMetrics


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
