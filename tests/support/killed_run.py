"""A test run to be killed: run only as a child by tests/test_container_cleanup.py (pytest is
given this file by name; its name is not a test module's, so a suite never collects it).

It brings up a compose project of its own (NATS alone: the set-up of the compose test, at a
fraction of its time), prints its run's name, and waits to be killed with SIGKILL, as a CI
timeout or a second Ctrl-C kills a run mid-compose: no `finally`, no `down`.
"""

from __future__ import annotations

import os
import threading

import pytest

from tests.support.containers import compose_project, prepare, this_run

UP = "killed-run up:"


def test_up_until_killed() -> None:
    prepare("nats")
    with compose_project(f"dbxkilled{os.getpid()}", services=["nats"]):
        print(UP, this_run(), flush=True)
        threading.Event().wait(120)  # the parent kills this process long before
    pytest.fail("not killed")
