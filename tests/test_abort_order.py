"""Rule 16's order, without NATS: a closing socket aborts its one-shots before its live calls.

Why the order matters: a one-shot may be queued for a slot. Were a live call aborted first,
its slot would free while the socket's own queued one-shot is still at the head of the
queue, and the conductor would admit (and place) that doomed one-shot ahead of another
socket's. The stand-in service below keeps the conductor's admission: one slot, a FIFO.
"""

from __future__ import annotations

import base64
import json
from collections import deque
from typing import Any

from services.frontend.socket_session import SocketSession
from shared.runtime.config import parse_config
from tests.support.poll import until
from tests.test_frontend_session import StubCall  # a call as the session sees it

FILES = [{"name": "a.pcm", "data": base64.b64encode(bytes(2560)).decode()}]


class Sink:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


class OneSlot:
    """The service as a closing socket meets it, with admission as the conductor does it:
    `slots` calls run, further one-shots wait in a FIFO and take a slot as one frees."""

    def __init__(self, slots: int = 1) -> None:
        self.config = parse_config({})
        self.free = slots
        self.queue: deque[StubCall] = deque()
        self.admitted: list[str] = []
        self.aborted: list[str] = []

    def _admit(self, call: StubCall) -> None:
        self.free -= 1
        self.admitted.append(call.cid)

    async def open_call(self, o: Any, sink: Any, on_end: Any = None) -> StubCall:
        live = o.end_input is None
        call = StubCall(o.request_id or f"unnamed{len(self.admitted) + len(self.queue)}", o.request_id, live)
        if self.free > 0:
            self._admit(call)
        elif live:
            raise AssertionError("the test opens a live call only where a slot is free")
        else:
            self.queue.append(call)
        return call

    async def append(self, call: Any, a: Any) -> None:
        raise AssertionError("no appends in these tests")

    async def end_input(self, call: Any, e: Any) -> None:
        raise AssertionError("no end_input in these tests")

    async def abort(self, call: StubCall, reason: str, status: int, tell_client: bool = False) -> None:
        self.aborted.append(call.cid)
        call.ended.set()
        if call in self.queue:
            self.queue.remove(call)
            return
        self.free += 1  # a running call's slot frees: the head of the queue takes it
        if self.queue:
            self._admit(self.queue.popleft())


def opening(rid: str | None = None, one_shot: bool = False) -> str:
    m: dict[str, Any] = {"request_id": rid} if rid is not None else {}
    if one_shot:
        m |= {"files": FILES, "end_input": True}
    return json.dumps(m)


async def opened(session: SocketSession, n: int) -> None:
    """Until the socket holds n calls (an opening runs in a lane of its own)."""
    await until(lambda: len(session.calls) + len(session.unnamed) == n and not session.lanes, 5, f"{n} calls opened")


async def test_a_closing_socket_aborts_every_one_shot_before_any_live_call() -> None:
    """Live and one-shot calls opened interleaved, the one-shots named (so held beside the
    live calls) and one not: however they were opened, the one-shots go first."""
    svc = OneSlot(slots=100)
    session = SocketSession(Sink(), svc)  # type: ignore[arg-type]
    for msg in (opening("live1"), opening("shot1", True), opening("live2"), opening("shot2", True), opening(None, True)):
        await session.handle(msg)
    await opened(session, 5)
    await session.close()
    assert len(svc.aborted) == 5
    assert set(svc.aborted[:3]) == {"shot1", "shot2", "unnamed4"}, svc.aborted
    assert svc.aborted[3:] == ["live1", "live2"]  # and in the order they were opened


async def test_a_closing_socket_does_not_pass_its_queued_one_shot_ahead_of_another_sockets() -> None:
    """One slot: socket A's live call holds it, A's one-shot waits, then B's. A closes: B's
    one-shot takes the slot, and A's was never admitted."""
    svc = OneSlot(slots=1)
    a = SocketSession(Sink(), svc)  # type: ignore[arg-type]
    b = SocketSession(Sink(), svc)  # type: ignore[arg-type]
    await a.handle(opening("a-live"))
    await a.handle(opening("a-shot", True))
    await opened(a, 2)
    await b.handle(opening("b-shot", True))
    await opened(b, 1)
    assert svc.admitted == ["a-live"] and [c.cid for c in svc.queue] == ["a-shot", "b-shot"]
    await a.close()
    assert svc.aborted == ["a-shot", "a-live"]
    assert svc.admitted == ["a-live", "b-shot"]  # not a-shot, which its socket no longer waits for
    await b.close()
