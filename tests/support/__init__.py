"""What the tests share, and the benchmarks import (tests import nothing from bench/):

- `stack`: the services as real processes, one by one (`Stack`, `running_stack`) or under
  `duplexbus up` (`UpStack`); which processes and ports are left (`procs_mentioning`,
  `listening`)
- `client`: a WebSocket client for protocol tests
- `bus`: reading and resetting the bus from outside the services; a nats-server of a
  test's own
- `audio`: client files, echo's replies, WAV files
- `realtime`: checks and helpers for the `/v1/realtime` tests
- `eval`: `duplexbus eval` as a user runs it, and its output
- `tiers`: which tests `make test-fast` leaves out
"""

from __future__ import annotations

from pathlib import Path

from shared.bus import defer_aiohttp

REPO = Path(__file__).resolve().parents[2]

# As every duplexbus process does, before anything here imports nats-py: 0.3 s of each pytest
# process's start (shared/bus/__init__.py; tests/conftest.py imports this package first).
defer_aiohttp()
