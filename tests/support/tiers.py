"""The two tiers of the suite, found from what each test uses, so that no one has to mark one.

`make test` runs every test; `make test-fast` leaves out the ones marked `integration`, those
that use a real nats-server (the `nats_url` fixture) or can start a process (the services, a
nats-server of their own, `make`, a browser), and those marked `slow` by hand (in one
process, but seconds each). A test can start one when its code, its
fixtures' code, or code they reach by name in this repository (the test module's helpers,
tests/support, the project's packages) uses `subprocess`, asyncio's subprocesses,
`multiprocessing` or playwright. The reach is followed by the names each function's code
uses, looked up in its module: generous (a class counts with all its methods), never blind
to a helper in between.

What the names cannot show (a process started through an object handed in from elsewhere)
the guard catches: a test left in the fast tier that starts a process fails and says so.
"""

from __future__ import annotations

import subprocess
import types
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

MARK = "integration"
BUS_FIXTURE = "nats_url"

# Packages of this repository: code in them is followed; code elsewhere is not (the standard
# library and the dependencies start no process behind a test's back, except these below).
PROJECT = frozenset({"tests", "shared", "services", "models", "clients", "duplexbus", "bench"})
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "playwright"})
SPAWNING_NAMES = frozenset({"create_subprocess_exec", "create_subprocess_shell"})  # asyncio's

_SPAWNS = object()  # what a spawning name resolves to


def _top(module_name: str | None) -> str:
    """The package a module is in, for the lists above; this module's own guard (which patches
    subprocess) is in none of them."""
    return "" if module_name == __name__ else (module_name or "").partition(".")[0]


def _names(code: types.CodeType) -> set[str]:
    """Every global and attribute name the code uses, its nested functions and lambdas too."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _functions_of(obj: Any) -> Iterator[types.FunctionType]:
    """The plain functions behind a function, method, property, partial, decorator or project class."""
    if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
        obj = obj.__func__
    wrapped = getattr(obj, "__wrapped__", None)  # behind a decorator (contextmanager, wraps)
    if wrapped is not None and not isinstance(obj, type):
        yield from _functions_of(wrapped)
    if isinstance(obj, property):
        yield from (f for f in (obj.fget, obj.fset, obj.fdel) if isinstance(f, types.FunctionType))
    elif isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type) and _top(obj.__module__) in PROJECT:
        for cls in obj.__mro__:
            if _top(cls.__module__) in PROJECT:
                for member in vars(cls).values():
                    if not isinstance(member, type):  # nested classes are followed where named
                        yield from _functions_of(member)
    elif callable(getattr(obj, "func", None)):  # functools.partial
        yield from _functions_of(obj.func)


class Reach:
    """Whether code can start a process, remembered per code object across the session."""

    def __init__(self) -> None:
        self._known: dict[types.CodeType, bool] = {}

    def item(self, item: pytest.Item) -> bool:
        """Whether a collected test uses the bus or can start a process."""
        if BUS_FIXTURE in getattr(item, "fixturenames", ()):
            return True
        roots: list[Any] = [getattr(item, "function", None)]
        # pytest's fixture closure of the item: the documented way to it is only at run time.
        info = getattr(item, "_fixtureinfo", None)
        for defs in getattr(info, "name2fixturedefs", {}).values():
            roots += [d.func for d in defs]
        return any(self.function(f) for root in roots for f in _functions_of(root))

    def function(self, fn: types.FunctionType) -> bool:
        if _top(fn.__module__) in SPAWNING_MODULES:
            return True
        if _top(fn.__module__) not in PROJECT:
            return False
        return self._code(fn.__code__, fn.__globals__, set())[0]

    def _code(self, code: types.CodeType, globals_: dict[str, Any], open_: set[types.CodeType]) -> tuple[bool, bool]:
        """(reaches a process, the answer leaned on a function still being looked at). Only an
        answer that did not lean on one is remembered: in a cycle it may still turn true."""
        if code in self._known:
            return self._known[code], False
        if code in open_:
            return False, True
        open_.add(code)
        leaned = False
        try:
            for obj in self._referenced(code, globals_):
                if obj is _SPAWNS:
                    self._known[code] = True
                    return True, False
                for fn in _functions_of(obj):
                    if _top(fn.__module__) in SPAWNING_MODULES:
                        self._known[code] = True
                        return True, False
                    if _top(fn.__module__) in PROJECT:
                        reaches, lean = self._code(fn.__code__, fn.__globals__, open_)
                        if reaches:
                            self._known[code] = True
                            return True, False
                        leaned |= lean
        finally:
            open_.discard(code)
        if not leaned:
            self._known[code] = False
        return False, leaned

    @staticmethod
    def _referenced(code: types.CodeType, globals_: dict[str, Any]) -> Iterator[Any]:
        """What the code's names resolve to in its module; for a module of the project, its
        attributes of those names (`bus.connect` is `bus` and `connect` in the code)."""
        names = _names(code)
        for name in sorted(names):  # the same walk, and the same answers, on every run
            if name in SPAWNING_NAMES:
                yield _SPAWNS
                return
            obj = globals_.get(name)
            if isinstance(obj, types.ModuleType):
                if _top(obj.__name__) in SPAWNING_MODULES:
                    yield _SPAWNS
                    return
                if _top(obj.__name__) in PROJECT:
                    yield from (vars(obj)[n] for n in names & vars(obj).keys())
            elif isinstance(obj, type) and _top(obj.__module__) in SPAWNING_MODULES:
                yield _SPAWNS
                return
            elif obj is not None:
                yield obj


def mark_integration(items: list[pytest.Item]) -> None:
    """Mark every collected test that uses the bus or can start a process (a mark already set by
    hand stays)."""
    reach = Reach()
    for item in items:
        if item.get_closest_marker(MARK) is None and reach.item(item):
            item.add_marker(MARK)


def forbid_processes(monkeypatch: pytest.MonkeyPatch, test: str) -> None:
    """For a test in the fast tier: starting a process fails it, naming the way out."""

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError(
            f"{test} starts a process ({args!r}) but is in the in-process tier: tests/support/tiers.py"
            f" did not see how it gets there; mark it @pytest.mark.{MARK}"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def in_fast_tier(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARK) is None
