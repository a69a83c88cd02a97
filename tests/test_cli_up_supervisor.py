"""`duplexbus up`'s supervisor: restarts, readiness, which NATS it uses, what it refuses at
once, and what it says at the terminal (one real `up`, the rest without a running stack)."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplexbus.supervisor import Child, UpOptions, run_up, tend, wait_http, wait_workers
from shared.bus.embedded import free_port
from shared.runtime.config import ServingConfig
from tests.support.stack import up_at_terminal


def exited_child(tmp_path: Path) -> Child:
    c = Child("quick", [sys.executable, "-c", "pass"], order=0)
    c.start({}, tmp_path)
    assert c.proc is not None
    c.proc.wait(10)
    return c


def test_a_dead_child_restarts_after_its_backoff_without_waiting(tmp_path: Path) -> None:
    c = exited_child(tmp_path)
    now = time.monotonic()
    before = time.monotonic()
    tend([c], {}, tmp_path, now)  # notices the exit: restart due in 0.5 s
    assert time.monotonic() - before < 0.2  # no sleep in the pass
    first = c.proc
    assert c.restart_at == pytest.approx(now + 0.5)
    tend([c], {}, tmp_path, now + 0.4)
    assert c.proc is first and c.restarts == 0
    tend([c], {}, tmp_path, now + 0.5)
    assert c.proc is not first and c.restarts == 1 and c.restart_at is None
    assert c.proc is not None
    c.proc.wait(10)
    tend([c], {}, tmp_path, now + 1.0)  # a second exit backs off longer
    assert c.restart_at == pytest.approx(now + 2.0)


def test_a_child_that_ran_long_restarts_with_the_shortest_backoff(tmp_path: Path) -> None:
    c = exited_child(tmp_path)
    c.restarts = 5
    tend([c], {}, tmp_path, c.started + 60)
    assert c.restart_at == pytest.approx(c.started + 60.5)


def test_wait_workers_gives_up_on_unreachable_nats() -> None:
    cfg = ServingConfig(nats_url="nats://127.0.0.1:1")
    start = time.monotonic()
    assert not wait_workers(cfg, 1, 1.0, [])
    assert time.monotonic() - start < 10


def test_up_uses_the_configs_nats_url_and_fails_when_never_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_kept: None
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    cfg = ServingConfig(model="echo", nats_url="nats://svc:s3cret@127.0.0.1:1")
    opts = UpOptions(
        config=str(tmp_path / "missing.yaml"),  # every child exits at once with a config error
        model="echo",
        frontends=1,
        workers=1,
        port=1,
        host="127.0.0.1",
        run_dir=tmp_path / "run",
        ready_timeout=20.0,
        stop_timeout=5.0,
    )
    assert run_up(opts, ["Encoder", "Talker"], cfg) == 1
    out = capsys.readouterr().out
    assert "using NATS at nats://svc:***@127.0.0.1:1" in out and "s3cret" not in out  # no password on the terminal
    assert "embedded" not in out
    assert "did not become ready" in out


def test_the_readiness_waits_end_at_once_on_a_stop() -> None:
    start = time.monotonic()
    assert not wait_http("http://127.0.0.1:1/healthz", 30.0, [], lambda: True)
    assert not wait_workers(ServingConfig(nats_url="nats://127.0.0.1:1"), 1, 30.0, [], lambda: True)
    assert time.monotonic() - start < 1.0


class Frontends(http.server.BaseHTTPRequestHandler):
    """One port, two frontends behind it as the kernel spreads connections: every third
    answer is frontend b's, which is still starting for its first `b_starting` answers."""

    answers = 0
    b_starting = 3

    def do_GET(self) -> None:
        cls = type(self)
        cls.answers += 1
        b = cls.answers % 3 == 0
        ready = not b or cls.answers > 3 * cls.b_starting
        body = json.dumps({"ready": ready, "frontend_id": "b" if b else "a"}).encode()
        self.send_response(200 if ready else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def frontends() -> Iterator[tuple[str, type[Frontends]]]:
    handler = type("Frontends", (Frontends,), {"answers": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/healthz", handler
    finally:
        server.shutdown()
        server.server_close()


def test_up_is_ready_once_every_frontend_has_answered_ready(frontends: tuple[str, type[Frontends]]) -> None:
    """With `--frontends 2` one ready answer is not enough: a call the kernel handed the
    other frontend while it was starting was refused with 1013 (a CI run of the suite)."""
    url, handler = frontends
    assert wait_http(url, 10.0, [], frontends=1)
    assert handler.answers == 1  # one frontend: its first ready answer
    assert wait_http(url, 10.0, [], frontends=2)
    assert handler.answers > 3 * handler.b_starting  # not before b said ready
    handler.b_starting = 10**6
    handler.answers = 0
    start = time.monotonic()
    assert not wait_http(url, 1.0, [], frontends=2)  # b never ready: not ready, at the timeout
    assert time.monotonic() - start >= 1.0


def test_up_refuses_a_taken_monitoring_port_at_once_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_kept: None
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        opts = UpOptions(
            config=None, model="echo", frontends=1, workers=1, port=free_port(), host="127.0.0.1",
            run_dir=tmp_path / "run", nats_monitor_port=taken,
        )  # fmt: skip
        assert run_up(opts, ["Encoder", "Talker"], ServingConfig(model="echo")) == 2
    err = capsys.readouterr().err
    assert f"cannot serve NATS monitoring on 127.0.0.1:{taken}" in err and "--nats-monitor-port" in err
    assert not (tmp_path / "run" / "nats").exists()  # no nats-server was started


def test_up_on_an_open_address_without_a_token_says_so_at_the_terminal(tmp_path: Path) -> None:
    """The frontends log the warning into their files under .run/logs; `up` itself must print it."""
    argv = ["--model", "echo", "--host", "0.0.0.0", "--port", str(free_port("0.0.0.0")), "--run-dir", str(tmp_path / "run")]
    with up_at_terminal(argv, unset=("NATS_URL", "DUPLEXBUS_TOKENS", "DUPLEXBUS_CONFIG")) as up:
        lines: list[str] = []
        while not any("duplexbus serving on" in line for line in lines):
            line = up.line()
            assert line, f"up exited ({up.proc.wait(5)}) before serving: {''.join(lines)}"
            lines.append(line)
    err = up.err
    assert "This frontend listens on 0.0.0.0, reachable from other machines, and no bearer token is set" in err, err
    assert "Set auth.tokens" in err
