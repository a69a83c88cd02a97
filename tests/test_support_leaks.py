"""tests/support/leaks.py: a client a module leaves open is closed when the module ends and
named, so it cannot log into a later module's test (the suite shares one event loop)."""

from __future__ import annotations

import nats

from tests.support import leaks


async def test_a_client_left_open_is_closed_and_counted_and_a_closed_one_is_not(nats_url: str) -> None:
    leaks.record_connects()
    start = leaks.mark()
    left = await nats.connect(nats_url)
    closed = await nats.connect(nats_url)
    await closed.close()
    await leaks.close_since(start, "a module")
    assert left.is_closed
    assert leaks.left_open.pop("a module") == 1
    assert leaks.mark() == start
