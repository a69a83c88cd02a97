"""The nats-server `duplexbus up` embeds shares the machine with the services: it runs on half
the cores (GOMAXPROCS), unless told otherwise (`nats_procs`, `--nats-procs`, $GOMAXPROCS).
Go's own default, a thread per core, spent a fifth more of the server's CPU per frame at 300
live calls on 2 cores, waking and parking threads the Python services keep from running."""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.request
from pathlib import Path

import pytest

from shared.bus.embedded import NatsServer, free_port, shared_procs
from shared.runtime.config import parse_config
from shared.runtime.errors import ConfigError
from tests.support.stack import up_at_terminal


def test_half_the_cores_at_least_one_unless_configured_or_set_in_the_environment() -> None:
    assert [shared_procs(None, {}, cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert shared_procs(None, {"GOMAXPROCS": "3"}, 16) == 0  # the user's own: left to Go
    assert shared_procs(4, {"GOMAXPROCS": "3"}, 16) == 4  # the config's, over the environment's
    assert shared_procs(0, {}, 16) == 0  # 0: Go's own default


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"nats_procs": -1})
    assert e.value.key == "nats_procs"


def varz_procs(monitor_url: str) -> int:
    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as r:
        return int(json.load(r)["gomaxprocs"])


@pytest.mark.parametrize("procs", [1, 0])
def test_the_server_runs_with_the_procs_it_is_given(procs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with tempfile.TemporaryDirectory(prefix="duplexbus-procs-") as store, NatsServer(store, procs=procs) as server:
        assert varz_procs(server.monitor_url) == (procs or os.cpu_count())


def test_up_runs_its_nats_server_on_half_the_cores(tmp_path: Path) -> None:
    argv = ["--model", "echo", "--port", str(free_port()), "--run-dir", str(tmp_path / "run")]
    with up_at_terminal(argv, unset=("NATS_URL", "GOMAXPROCS", "DUPLEXBUS_CONFIG")) as up:
        line = up.line()
        assert line.startswith("nats-server (embedded)"), line
        half = max(1, (os.cpu_count() or 1) // 2)
        assert line.rstrip().endswith(f"GOMAXPROCS {half}"), line  # said at the terminal
        found = re.search(r"monitoring on (http://\S+?)(,|$)", line)
        assert found is not None, line
        assert varz_procs(found.group(1)) == half
