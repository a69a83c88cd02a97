"""The version of duplexbus that runs (the installed distribution's), for --version and service discovery."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("duplexbus")
except PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0.0.0+source"
