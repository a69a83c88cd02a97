"""Skipping a test module whose packages are not installed, without importing them.

`pytest.importorskip` imports the package to see that it is there, at collection, in every
pytest process of the suite (`make test` starts eight): `silero_vad`'s import is torch's,
2.4 s of CPU each time, for modules most of those processes then deselect."""

from __future__ import annotations

import importlib.util

import pytest


def installed(*packages: str) -> None:
    """After a test module's imports: skip it unless every package is installed. (They are
    the project's own dependencies; this is for an install that left one out.)"""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}", allow_module_level=True)
