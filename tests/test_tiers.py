"""The test tiers: which code can start a process, and the guard on the fast tier."""

from __future__ import annotations

import textwrap
import types
from types import SimpleNamespace
from typing import cast

import pytest

from tests.support import tiers

# Code as a test module of this repository would have it. It lives in a module made here, so
# that this file's own tests reach none of it by name and stay in the fast tier.
SAMPLE = textwrap.dedent(
    """
    import asyncio
    import contextlib
    import subprocess

    def pure(x):
        return helper(x) + 1

    def helper(x):
        return x * 2

    def spawns():
        return run_it()

    def run_it():
        return subprocess.run(["true"], check=True)

    def ping(n):  # a cycle (ping, pong) that reaches a process from ping, after pong (in name order)
        return pong(n - 1) if n else spawns()

    def pong(n):
        return ping(n)

    class Server:
        def start(self):
            return spawns()

    def uses_a_class():
        return Server()

    @contextlib.contextmanager
    def server():
        yield spawns()

    def uses_a_context_manager():
        with server():
            pass

    async def uses_asyncio():
        await asyncio.create_subprocess_exec("true")

    def calls_a_lambda():
        return (lambda: helper(1))()
    """
)


@pytest.fixture
def sample() -> types.ModuleType:
    module = types.ModuleType("tests.tiers_sample")
    exec(compile(SAMPLE, "tests/tiers_sample.py", "exec"), module.__dict__)
    return module


def test_code_that_reaches_a_process_by_any_path_is_integration(sample: types.ModuleType) -> None:
    reach = tiers.Reach()
    for name in ("spawns", "run_it", "uses_a_class", "uses_a_context_manager", "uses_asyncio", "ping", "pong"):
        assert reach.function(getattr(sample, name)), name
    for name in ("pure", "helper", "calls_a_lambda"):
        assert not reach.function(getattr(sample, name)), name


def test_a_cycle_is_not_remembered_as_reaching_nothing(sample: types.ModuleType) -> None:
    """pong, looked at while ping is still open, must not be remembered as reaching nothing."""
    for first, then in (("ping", "pong"), ("pong", "ping")):
        reach = tiers.Reach()
        assert reach.function(getattr(sample, first))
        assert reach.function(getattr(sample, then))


def test_a_test_in_the_fast_tier_that_starts_a_process_fails(sample: types.ModuleType) -> None:
    """This test is in the fast tier, so the guard is on: the sample's process is refused."""
    with pytest.raises(AssertionError, match=r"in-process tier.*mark it @pytest\.mark\.integration"):
        sample.spawns()


def test_a_test_that_uses_the_bus_fixture_is_integration(sample: types.ModuleType) -> None:
    def item(fixtures: list[str]) -> pytest.Item:
        return cast(pytest.Item, SimpleNamespace(fixturenames=fixtures, function=sample.pure))

    assert tiers.Reach().item(item([tiers.BUS_FIXTURE, "tmp_path"]))
    assert not tiers.Reach().item(item(["tmp_path"]))
