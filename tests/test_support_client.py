"""The test client itself (tests/support/client.py): a socket whose test leaves its messages
unread keeps reading the connection, so its keepalive pongs are not stuck behind them.

A live call that sends for a minute and reads its outputs at the end (the fuzz module's
live calls) used to close itself: websockets stops reading a socket with 16 unread
messages, its pongs waited behind them, and its keepalive gave up 20 s after a ping.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve

from tests.support.client import WS

UNREAD = 100  # messages the server sends that the test does not read: well past websockets' 16


async def _flood(conn: ServerConnection) -> None:
    for i in range(UNREAD):
        await conn.send(f'{{"i": {i}}}')
    await conn.wait_closed()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serve(_flood, "127.0.0.1", 0) as s:
        yield s


async def test_a_socket_with_unread_messages_still_reads_its_pongs(server: Server) -> None:
    port = next(iter(server.sockets)).getsockname()[1]
    ws = await WS.connect(f"ws://127.0.0.1:{port}")
    try:
        # Sent after every flood message (the server sent them first): its pong is read
        # only by a connection that read them all.
        pong = await ws.ws.ping()
        await asyncio.wait_for(pong, 5.0)
        got = [await ws.recv() for _ in range(UNREAD)]
        assert [m["i"] for m in got] == list(range(UNREAD))  # nothing lost by reading ahead
    finally:
        await ws.close()


async def test_a_socket_sends_no_keepalive_pings_of_its_own(server: Server) -> None:
    """A ping's payload comes from the global `random` module (websockets): one drawn in a
    thread of live calls while Hypothesis draws an example elsewhere in the process fails
    that example as a strategy using `random` (the fuzz module, now and then)."""
    port = next(iter(server.sockets)).getsockname()[1]
    ws = await WS.connect(f"ws://127.0.0.1:{port}")
    try:
        assert ws.ws.ping_interval is None and ws.ws.keepalive_task is None
    finally:
        await ws.close()
