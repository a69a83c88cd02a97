"""The bus: wire schema, subject names, the NATS connection, the embedded server.

The only package that imports nats-py."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


def defer_aiohttp() -> None:
    """aiohttp imported on its first use, not when nats-py names it. Called by every `duplexbus`
    command (`duplexbus.cli.main`) before anything imports nats-py.

    nats-py imports aiohttp for its WebSocket transport (`ws://` servers) alone, which the
    services' `nats://` connections never use; aiohttp's import builds its TLS contexts and
    took 0.3 s of the 1.2 s each service process spent importing (`python -X importtime`), in
    every process `duplexbus up`, compose and the suite start. A stand-in module takes its
    place: the first attribute read of it (a `ws://` connection, or any later import of a
    submodule) imports the real one, which then replaces it. (`importlib.util.LazyLoader` does
    not do here: an `import` statement reads the module's `__spec__`, which loads it.)"""
    spec = None if "aiohttp" in sys.modules else importlib.util.find_spec("aiohttp")
    if spec is None:
        return
    stand_in = types.ModuleType("aiohttp", "aiohttp, imported on first use (shared.bus.defer_aiohttp)")
    stand_in.__spec__ = spec  # read by every `import aiohttp` and by find_spec: neither loads it
    stand_in.__file__ = spec.origin  # read by tools that walk sys.modules (Hypothesis, at collection)

    def load(attr: str) -> Any:
        if sys.modules.get("aiohttp") is stand_in:
            del sys.modules["aiohttp"]
        return getattr(importlib.import_module("aiohttp"), attr)

    stand_in.__getattr__ = load  # type: ignore[method-assign]  # a module's own __getattr__ (PEP 562)
    sys.modules["aiohttp"] = stand_in
