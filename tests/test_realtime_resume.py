"""A `/v1/realtime` session resumes on any frontend (docs/realtime.md, "Resume"): over raw
sockets on a stack of two frontends, a session dropped on one is resumed on the other with
every event after last_event_id once and its call going on byte-exact (echo), and neither
the first frontend's grace period nor the conductor's reconciliation ends it; a resume
while the old socket is open, a move back, and the refusals; then `duplexbus up --frontends
2`, whose frontends share one port, resumes 12 sessions of 12 wherever the kernel sends
the reconnect. The pure rules: tests/test_realtime_moves.py, tests/test_reconcile.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.frontend.realtime.session import event_number, token_cid
from shared.bus import subjects, wire
from shared.sdk.audio import b64_pcm16
from tests.support.bus import bucket_keys, conductor_status, connected
from tests.support.poll import until
from tests.support.realtime import MANUAL_16K, RT, audio_of, check_responses, drop_and_resume, moves_listed, tone
from tests.support.stack import Stack, UpStack, running_stack

GRACE_S = 1.0
HEARTBEAT_S = 0.5
CONFIG = {"model": "echo", "heartbeat_s": HEARTBEAT_S, "realtime": {"resume_grace_s": GRACE_S}}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG, frontends=2) as s:
        yield s


async def rt_at(port: int) -> RT:
    return await RT.at(f"ws://127.0.0.1:{port}/v1/realtime?model=echo")


def held(port: int) -> int:
    """The calls the frontend on `port` holds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return int(json.loads(r.read())["calls"])


async def listings(nats_url: str) -> dict[str, wire.FrontendHeartbeat]:
    """Each frontend's latest heartbeat."""
    async with connected(nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.KV_FRONTENDS)
        return {k: wire.decode_as((await kv.get(k)).value or b"", wire.FrontendHeartbeat) for k in await bucket_keys(kv)}


async def conductor_live(nats_url: str) -> int:
    live: int = (await conductor_status(nats_url))["live_calls"]
    return live


async def turn(rt: RT, seconds: float, hz: float) -> tuple[bytes, dict[str, Any]]:
    """A committed clip and its response: (the clip, response.done)."""
    clip = tone(seconds, 16000, hz=hz)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    return clip.tobytes(), await rt.next("response.done")


async def test_a_session_dropped_on_one_frontend_resumes_on_the_other_and_lives_on(stack: Stack) -> None:
    first, other = stack.ports
    rt = await rt_at(first)
    token = (await rt.next("session.created"))["session"]["resume_token"]
    cid = token_cid(token)
    assert cid is not None
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    clip = tone(2.0, 16000)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    await rt.next("response.output_audio.delta")
    last = rt.seen[-1]["event_id"]
    rt.ws.transport.abort()  # mid-reply: the rest of the response is stored, not read
    dropped = time.monotonic()
    before = list(rt.seen)

    again = await rt_at(other)
    await again.send({"type": "session.resume", "resume_token": token, "last_event_id": last})
    done = await again.next("response.done")
    assert done["response"]["status"] == "completed"
    resumed = [e for e in again.seen if e["type"] != "session.created" or e["session"]["resume_token"] == token]
    events = before + resumed
    numbers = [event_number(e["event_id"]) for e in events]
    assert numbers == list(range(1, len(numbers) + 1)), numbers  # none lost, none repeated
    assert audio_of(events) == clip.tobytes()
    # The call moved: the other frontend holds it (and ended its own fresh session's), the
    # first holds none.
    await until(lambda: (held(first), held(other)) == (0, 1), 10, "the call held by the other frontend only")

    # The first frontend's grace period passes, and two heartbeats of each: nothing ends it.
    await asyncio.sleep(max(0.0, dropped + GRACE_S + 3 * HEARTBEAT_S - time.monotonic()))
    beats = await listings(stack.nats_url)
    holders = {fid: hb.adopted.get(cid) for fid, hb in beats.items() if hb.calls and cid in hb.calls}
    assert list(holders.values()) == [1], beats  # one frontend lists it, as adopted once
    assert await conductor_live(stack.nats_url) == 1
    second, done2 = await turn(again, 0.3, 880)
    assert audio_of(again.seen, done2["response"]["id"]) == second
    check_responses(before + [e for e in again.seen if e["type"] != "session.created" or e["session"]["resume_token"] == token])
    await again.close()
    await until(lambda: held(other) == 0, 10, "the session's call ended with its socket")


async def test_a_resume_while_the_old_socket_is_open_moves_it_and_it_moves_back(stack: Stack) -> None:
    first, other = stack.ports
    rt = await rt_at(first)
    token = (await rt.next("session.created"))["session"]["resume_token"]
    await rt.send(MANUAL_16K)
    last = (await rt.next("session.updated"))["event_id"]
    there = await rt_at(other)
    await there.send({"type": "session.resume", "resume_token": token, "last_event_id": last})
    assert await rt.closed() == 4000  # the old socket, still open, is closed: the session went on
    clip, done = await turn(there, 0.2, 440)
    assert audio_of(there.seen, done["response"]["id"]) == clip
    # Wrong secret, or a last_event_id the session never sent: refused there, and nothing moves.
    cid = token_cid(token)
    for resume, code in [
        ({"resume_token": f"{cid}.not-the-secret", "last_event_id": last}, "invalid_resume_token"),
        ({"resume_token": token, "last_event_id": f"event_x_{10**6}"}, "invalid_value"),
        ({"resume_token": "0" * 24 + ".unheld", "last_event_id": last}, "invalid_resume_token"),
    ]:
        probe = await rt_at(first)
        await probe.send({"type": "session.resume", "event_id": "r", **resume})
        err = (await probe.next("error"))["error"]
        assert (err["code"], err["event_id"]) == (code, "r"), err
        await probe.close()
    # Dropped on the other frontend, resumed on the first again: a second move.
    last = there.seen[-1]["event_id"]
    there.ws.transport.abort()
    back = await rt_at(first)
    await back.send({"type": "session.resume", "resume_token": token, "last_event_id": last})
    clip, done = await turn(back, 0.2, 660)
    assert audio_of(back.seen, done["response"]["id"]) == clip
    await until(lambda: (held(first), held(other)) == (1, 0), 10, "the call back on the first frontend")
    await back.close()
    await until(lambda: held(first) == 0, 10, "the session's call ended with its socket")


@pytest.fixture
async def up() -> AsyncIterator[UpStack]:
    # shutdown_unlist_s 0: no gateway waits to see a stopping frontend's 503 (as in `Stack`).
    config = {"heartbeat_s": HEARTBEAT_S, "shutdown_unlist_s": 0.0, "realtime": {"resume_grace_s": 10.0}}
    stack = await asyncio.to_thread(UpStack, "echo", 2, 1, config)
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.close)


RESUMES = 12


async def test_twelve_resumes_of_twelve_succeed_across_the_frontends_of_up(up: UpStack) -> None:
    """`duplexbus up --frontends 2`: both frontends on one port, the kernel spreads the
    sockets over them, so about half the reconnects reach the frontend the session was not
    on (7 of 12 resumes failed with invalid_resume_token when only that one could resume it)."""
    sessions = await drop_and_resume(f"ws://127.0.0.1:{up.port}/v1/realtime?model=echo", RESUMES)
    # Every session is held once, and some moved (a frontend lists it as adopted).
    moves = await moves_listed(up.nats_url, [t for t, _ in sessions], HEARTBEAT_S)
    assert any(moves.values()), moves
    for _, rt in sessions:
        await rt.close()
