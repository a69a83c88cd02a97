"""`duplexbus up`'s supervisor without a running stack: readiness, which NATS it uses."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplexbus.shared.config import ServingConfig
from duplexbus.supervisor import UpOptions, run_up, wait_workers


def test_wait_workers_gives_up_on_unreachable_nats() -> None:
    cfg = ServingConfig(nats_url="nats://127.0.0.1:1")
    start = time.monotonic()
    assert not wait_workers(cfg, 1, 1.0, [])
    assert time.monotonic() - start < 10


@pytest.fixture
def signals_kept() -> Iterator[None]:
    """run_up installs its own SIGINT/SIGTERM handlers; put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_up_uses_the_configs_nats_url_and_fails_when_never_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signals_kept: None
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    cfg = ServingConfig(model="echo", nats_url="nats://127.0.0.1:1")
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
    assert "using NATS at nats://127.0.0.1:1" in out
    assert "embedded" not in out
    assert "did not become ready" in out
