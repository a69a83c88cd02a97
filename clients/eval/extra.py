"""The eval's own dependencies: rich, matplotlib and jiwer come with the `eval` extra, not
with the server (a machine that only serves has no use for them). They are imported where
they are used, and a missing one says in one line how to get it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

MODULES = ("rich", "matplotlib", "jiwer")
INSTALL = "pip install 'duplexbus[eval]'"


def missing() -> list[str]:
    """Those of MODULES this Python cannot import."""
    return [m for m in MODULES if importlib.util.find_spec(m) is None]


def require() -> None:
    """Exit with one line where any is missing. `duplexbus eval` asks before its first
    sample: an eval that ran for an hour must not fail at its plots."""
    gone = missing()
    if gone:
        raise SystemExit(f"duplexbus eval needs {', '.join(gone)}, from its eval extra: {INSTALL}")


@contextmanager
def needed() -> Iterator[None]:
    """Around an import of one of MODULES: where it is missing, the error names the extra
    (an error about anything else, a dependency of theirs included, passes as it is)."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name not in MODULES:
            raise
        raise ModuleNotFoundError(f"{e.name} comes with duplexbus's eval extra: {INSTALL}", name=e.name) from None
