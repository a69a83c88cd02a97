"""tests/support/source.py: CPython 3.11's spurious AST SystemError is tried again, any other
error is not, and the collector is back on after a parse."""

from __future__ import annotations

import ast
import gc
from typing import Any

import pytest

from tests.support import source


def test_the_spurious_error_is_tried_again_and_gc_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = ast.parse

    def flaky(text: str, *args: Any, **kwargs: Any) -> ast.Module:
        calls.append(gc.isenabled())
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=141, after=189)")
        tree: ast.Module = real(text, *args, **kwargs)
        return tree

    monkeypatch.setattr(ast, "parse", flaky)
    assert isinstance(source.parse("x = 1").body[0], ast.Assign)
    assert calls == [False, False] and gc.isenabled()


def test_another_error_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str, *args: Any, **kwargs: Any) -> ast.Module:
        raise SystemError("something else")

    monkeypatch.setattr(ast, "parse", broken)
    with pytest.raises(SystemError, match="something else"):
        source.parse("x = 1")
    assert gc.isenabled()
