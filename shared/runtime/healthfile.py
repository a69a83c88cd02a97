"""A process's sign of life for container healthchecks (`duplexbus health`).

Where $DUPLEXBUS_HEALTH_FILE is set (the Docker image sets it), a service touches that file
each time it has shown it works: a worker or frontend after each heartbeat stored in KV (the
very sign the conductor judges liveness by), the conductor after each round trip to NATS. The
healthcheck reads the file's age, so a check costs no connection to the bus.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HEALTH_FILE_ENV = "DUPLEXBUS_HEALTH_FILE"


def health_file() -> Path | None:
    path = os.environ.get(HEALTH_FILE_ENV)
    return Path(path) if path else None


def beat() -> None:
    """Record that this process works, now (a no-op where no health file is configured)."""
    path = health_file()
    if path is None:
        return
    try:
        path.touch()
    except OSError:
        pass  # a healthcheck that cannot be fed reports the process unhealthy, as it should


def unhealthy(max_age_s: float, now: float | None = None) -> str | None:
    """Why this process is not healthy, or None when its last beat is at most max_age_s old."""
    path = health_file()
    if path is None:
        return f"${HEALTH_FILE_ENV} is not set: this process keeps no health file"
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return f"no beat yet ({path} does not exist)"
    if age > max_age_s:
        return f"last beat {age:.1f} s ago (more than {max_age_s:g} s)"
    return None
