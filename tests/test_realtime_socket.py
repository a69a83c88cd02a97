"""`WS /v1/realtime` over a raw socket against a real echo stack: every error path (bad input
never closes the socket; limits as error events; admission), an abrupt disconnect, and
resume (drop the socket mid-reply, resume, no event lost or repeated)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
import websockets

from services.frontend.realtime.session import event_number
from shared.sdk.audio import b64_pcm16
from tests.support.realtime import MANUAL_16K, RT, audio_of, calls, check_responses, tone, url, wait_calls
from tests.support.stack import Stack, running_stack

GRACE_S = 1.5
CONFIG = {
    "model": "echo",
    "max_concurrent_requests": 2,
    "client_streams": {"audio_in": {"max_items": 40}},  # 3.2 s of audio per session
    "realtime": {"resume_grace_s": GRACE_S},
}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


async def test_bad_input_gets_error_events_and_the_socket_goes_on(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    bad: list[tuple[str, str, str | None]] = [
        ("{oops", "invalid_json", None),
        ('{"type": "no.such.thing", "event_id": "e1"}', "unknown_event", "type"),
        ('{"type": "input_audio_buffer.append", "audio": 12, "event_id": "e2"}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "e3"}', "invalid_value", "audio"),
        ('{"type": "conversation.item.truncate", "item_id": 5, "audio_end_ms": 1, "event_id": "e4"}', "invalid_value", "item_id"),
    ]
    for raw, code, param in bad:
        await rt.send(raw)
        err = (await rt.next("error"))["error"]
        assert (err["code"], err["param"]) == (code, param), err
        assert err["event_id"] == json.loads(raw).get("event_id") if raw.startswith('{"') else err["event_id"] is None
    before = len(rt.seen)
    await rt.send({"type": "session.close"})
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(tone(0.1, 16000)), "event_id": "late"})
    # Input after session.close is refused with `session_closed` while the call finishes (the
    # rule is the pure core's: test_realtime_pure). Here the call's end may overtake the late
    # append on the server's loop (its done comes over the bus while the append waits in the
    # socket), and a session already closed reads nothing more: then there is no error event,
    # only the close. So: any error is that one, then session.closed and a clean close.
    assert await rt.closed() == 1000
    after = rt.seen[before:]
    assert [e["type"] for e in after].count("session.closed") == 1, after
    errors = [e["error"] for e in after if e["type"] == "error"]
    assert all((e["code"], e["event_id"]) == ("session_closed", "late") for e in errors), errors


async def test_json_nested_too_deeply_is_invalid_json_and_the_session_goes_on(stack: Stack) -> None:
    """ "[" * 5000 makes the decoder recurse past the interpreter's limit: it is malformed JSON
    like any other (it used to close the socket with no error event)."""
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    for deep in ("[" * 5000, "[" * 5000 + "]" * 5000, '{"a":' * 5000):
        await rt.send(deep)
        err = (await rt.next("error"))["error"]
        assert (err["code"], err["param"], err["event_id"]) == ("invalid_json", None, None), err
        assert "nested too deeply" in err["message"], err
    clip = tone(0.2, 16000)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    done = await rt.next("response.done")
    assert audio_of(rt.seen, done["response"]["id"]) == clip.tobytes()
    await rt.close()


async def test_client_stream_limit_is_an_error_event_and_the_session_goes_on(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.send({"type": "session.update", "session": {"input_audio_format": "pcm16", "sample_rate_hz": 16000}})
    await rt.next("session.updated")
    big = tone(4.0, 16000)  # 50 items, over the 40 the config allows
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(big), "event_id": "big"})
    err = (await rt.next("error"))["error"]
    assert err["code"] == "limit_exceeded" and err["param"] == "client_streams.audio_in.max_items" and err["event_id"] == "big"
    await rt.send({"type": "session.heartbeat"})
    await rt.next("session.heartbeat")
    await rt.close()


async def test_at_the_cap_a_session_gets_server_busy_and_1013(stack: Stack) -> None:
    await wait_calls(stack, 0)
    a, b = await RT.open(stack), await RT.open(stack)
    await a.next("session.created")
    await b.next("session.created")
    c = await RT.open(stack)
    err = (await c.next("error"))["error"]
    assert err["code"] == "server_busy" and err["type"] == "server_error"
    with pytest.raises(websockets.ConnectionClosed):
        await c.recv(10)
    assert c.ws.close_code == 1013
    await a.close()  # a clean close ends its session at once, freeing its slot
    await wait_calls(stack, 1)
    d = await RT.open(stack)
    await d.next("session.created")
    await d.send({"type": "session.heartbeat"})
    await d.next("session.heartbeat")
    for s in (b, d):
        await s.close()


async def test_abrupt_disconnect_ends_the_call_after_the_grace_period(stack: Stack) -> None:
    await wait_calls(stack, 0)
    rt = await RT.open(stack)
    await rt.next("session.created")
    assert calls(stack) == 1
    rt.ws.transport.abort()  # no close frame: the session waits for a resume
    await asyncio.sleep(GRACE_S / 3)
    assert calls(stack) == 1
    await wait_calls(stack, 0, timeout=GRACE_S + 5)


async def test_resume_after_a_drop_mid_reply_loses_and_repeats_nothing(stack: Stack) -> None:
    await wait_calls(stack, 0)
    rt = await RT.open(stack)
    created = await rt.next("session.created")
    token = created["session"]["resume_token"]
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    clip = tone(2.0, 16000)
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    await rt.next("response.output_audio.delta")
    last = rt.seen[-1]["event_id"]
    rt.ws.transport.abort()  # mid-reply: the rest of the response is stored, not read
    first_part = list(rt.seen)

    again = await RT.open(stack)
    await again.send({"type": "session.resume", "resume_token": token, "last_event_id": last})
    done = await again.next("response.done")
    assert done["response"]["status"] == "completed"
    # The fresh session this socket opened is gone: only the resumed one holds a call.
    await wait_calls(stack, 1)
    resumed = [e for e in again.seen if e["type"] != "session.created" or e["session"]["resume_token"] == token]
    numbers = [event_number(e["event_id"]) for e in first_part + resumed]
    assert numbers == list(range(1, len(numbers) + 1)), numbers  # none lost, none repeated
    events = first_part + resumed
    assert audio_of(events) == clip.tobytes()
    check_responses(events)
    # It carries on: a second commit is answered on the resumed socket.
    second = tone(0.3, 16000, hz=880)
    await again.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(second)})
    await again.send({"type": "input_audio_buffer.commit"})
    await again.send({"type": "response.create"})
    done2 = await again.next("response.done")
    assert audio_of(again.seen, done2["response"]["id"]) == second.tobytes()
    await again.close()
    await wait_calls(stack, 0)


async def test_resume_after_the_grace_period_is_refused_and_the_new_session_goes_on(stack: Stack) -> None:
    await wait_calls(stack, 0)
    rt = await RT.open(stack)
    token = (await rt.next("session.created"))["session"]["resume_token"]
    await rt.send({"type": "session.heartbeat"})
    last = (await rt.next("session.heartbeat"))["event_id"]
    rt.ws.transport.abort()
    await wait_calls(stack, 0, timeout=GRACE_S + 5)  # the grace period is over: the call was ended
    again = await RT.open(stack)
    await again.send({"type": "session.resume", "resume_token": token, "last_event_id": last, "event_id": "late"})
    err = (await again.next("error"))["error"]
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_resume_token", "resume_token", "late"), err
    assert "resume_grace_s" in err["message"]
    assert not any(e["type"] == "session.heartbeat" for e in again.seen)  # nothing of the old session
    await again.send({"type": "session.heartbeat"})
    await again.next("session.heartbeat")
    assert calls(stack) == 1  # the new socket's own session
    await again.close()
    await wait_calls(stack, 0)


async def test_resume_with_an_unknown_token_is_an_error_and_the_new_session_goes_on(stack: Stack) -> None:
    rt = await RT.open(stack)
    await rt.send({"type": "session.resume", "resume_token": "nope", "last_event_id": "event_x_1", "event_id": "r"})
    err = (await rt.next("error"))["error"]
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_resume_token", "resume_token", "r")
    await rt.send(MANUAL_16K)
    await rt.next("session.updated")
    clip = np.asarray(tone(0.2, 16000))
    await rt.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    await rt.send({"type": "input_audio_buffer.commit"})
    await rt.send({"type": "response.create"})
    done = await rt.next("response.done")
    assert audio_of(rt.seen, done["response"]["id"]) == clip.tobytes()
    await rt.close()


async def test_the_beta_header_is_refused_at_once_with_a_clear_error(stack: Stack) -> None:
    """The beta interface is not served (as OpenAI no longer serves it): a client asking for it
    gets one error saying so and a close, before any session or call."""
    async with websockets.connect(url(stack), additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == "beta_api_not_supported", err
        assert "OpenAI-Beta" in err["error"]["message"] and "GA" in err["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 1008
    assert calls(stack) == 0


async def test_clients_that_leave_log_no_error_on_the_frontend(stack: Stack) -> None:
    """A clean close, a close right after connect, an abrupt drop and the SDK's own close: no
    "Exception in ASGI application ... ClientDisconnected" (it was logged for nearly every
    session), nor any other ERROR line, in the frontend's log."""
    from openai import AsyncOpenAI

    log = stack.procs["frontend-0"].log
    start = log.stat().st_size
    rt = await RT.open(stack)
    await rt.next("session.created")
    await rt.close()
    quick = await websockets.connect(url(stack))
    await quick.close()
    dropped = await RT.open(stack)
    await dropped.next("session.created")
    dropped.ws.transport.abort()
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{stack.ports[0]}/v1")
    async with client.realtime.connect(model="echo") as conn:
        await conn.recv()
    await wait_calls(stack, 0, timeout=GRACE_S + 10)  # the dropped ones end after the grace period
    with open(log, "rb") as f:
        f.seek(start)
        written = f.read().decode(errors="replace")
    assert "Exception in ASGI application" not in written and " ERROR " not in written, written[-3000:]
