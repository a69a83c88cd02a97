"""Freezing a process (SIGSTOP) for a fault test, as a GC pause, a disk stall or a VM hiccup
would: `frozen(pid)` returns once the kernel has stopped it (a signal is delivered when the
process is next scheduled, so the kill's return alone does not say it), and thaws it after."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from tests.support.poll import until_sync


def state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T for stopped...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        until_sync(lambda: state(pid) in ("T", "t"), 5.0, f"process {pid} stopped", interval=0.005)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed while frozen: nothing to thaw
            os.kill(pid, signal.SIGCONT)
