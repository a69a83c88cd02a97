"""`duplexbus eval` as a user runs it, and what it writes (for the eval tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def eval_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "duplexbus.cli", "eval", *args], capture_output=True, text=True, timeout=timeout)


def results(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-sample records and the summary an eval run wrote to `out`."""
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return recs, json.loads((out / "summary.json").read_text())
