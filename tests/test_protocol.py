"""The client protocol's rules (docs/clients.md), each through the real services: one
conductor, one echo worker and two frontends as processes on a real nats-server."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from models.echo import FRAME
from shared.bus import subjects, wire
from tests.support.audio import echo_bytes, padded, pcm, pcm_file, wav_bytes
from tests.support.bus import bus_client
from tests.support.client import WS, PackedMessage, nothing_for
from tests.support.stack import Stack, running_stack

MAX_MESSAGE_MB = 0.5
MAX_INPUT_MB = 1.0
CONFIG = {"model": "echo", "max_message_mb": MAX_MESSAGE_MB, "max_call_input_mb": MAX_INPUT_MB}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG, frontends=2) as s:
        yield s


def samples(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-20000, 20000, n).astype("<i2")


def wav(x: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> str:
    return base64.b64encode(wav_bytes(x, rate, channels, width)).decode()


def is_error(rid: str | None, status: int | None = None) -> Any:
    return lambda m: m.get("request_id") == rid and "error" in m and not m.get("append") and status in (None, m["status"])


def is_append_error(rid: str | None, status: int | None = None) -> Any:
    return lambda m: m.get("request_id") == rid and m.get("append") is True and status in (None, m["status"])


def ended_input_or_after_finish(ws: WS, rid: str, m: dict[str, Any]) -> bool:
    """An append (or end) after the input ended gets 409; after the call ended, 404. On a
    loaded machine echo's finish can overtake a message sent right after the end of input:
    then the finish came first on the socket, and the 404 is the right answer."""
    if m["status"] == 409:
        return "input has ended" in m["error"] or "already ended" in m["error"]
    finished = any(o.get("request_id") == rid and "finish" in o for o in ws.inbox)
    return m["status"] == 404 and finished


async def live_call(ws: WS, rid: str, x: np.ndarray) -> None:
    """Opens `rid` and appends `x`; waits for the first output (the call runs)."""
    await ws.send({"request_id": rid})
    await ws.send({"request_id": rid, "append": [pcm_file(x)]})
    await ws.until(lambda m: m.get("request_id") == rid and "output" in m, keep=True)  # kept for ws.outputs(rid)


async def finish(ws: WS, rid: str, sent: np.ndarray) -> dict[str, Any]:
    """Ends `rid`'s input and checks that exactly `sent` came back."""
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid)
    assert "finish" in final, final
    outs = ws.outputs(rid)
    assert echo_bytes(outs) == padded(sent)
    assert final["finish"]["usage"]["frames"] == len(outs)
    return final


# -- request_id ----------------------------------------------------------------
async def test_request_id_must_be_a_subject_token(ws: WS) -> None:
    """`.`, `*`, `>`, spaces, non-ASCII, empty, over 64: 400, and the reply echoes what was sent."""
    for rid in ["a.b", "a*", "a>", "a b", "naïve", "日本", "", "x" * 65, "a/b", "tab\t"]:
        await ws.send({"request_id": rid})
        m = await ws.until(lambda m, rid=rid: m.get("request_id") == rid)
        assert m["status"] == 400 and "[A-Za-z0-9_-]" in m["error"] and "append" not in m, m
        await ws.send({"request_id": rid, "files": [pcm_file(samples(10))], "end_input": True})  # one-shot too
        m = await ws.until(lambda m, rid=rid: m.get("request_id") == rid)
        assert m["status"] == 400, m
    x = samples(2000)
    for rid in ["A-z_09", "y" * 64]:
        await live_call(ws, rid, x)
        await finish(ws, rid, x)


# -- ownership -----------------------------------------------------------------
async def test_only_the_opening_socket_may_append(stack: Stack, ws: WS) -> None:
    other = await WS.connect(stack.ws_url(0))
    far = await WS.connect(stack.ws_url(1))
    x = samples(3000, seed=1)
    await live_call(ws, "owned", x)
    for sock in (other, far):
        await sock.send({"request_id": "owned", "append": [pcm_file(samples(5000, seed=2))]})
        m = await sock.until(is_append_error("owned"))
        assert m["status"] == 404 and "on this socket" in m["error"]
        await sock.send({"request_id": "owned", "end_input": True})
        assert (await sock.until(is_append_error("owned")))["status"] == 404
        await sock.send({"request_id": "owned", "abort": True})
        assert (await sock.until(is_append_error("owned")))["status"] == 404
    await finish(ws, "owned", x)  # the owner's call went on, with none of the others' input
    await other.close()
    await far.close()


# -- 409 -----------------------------------------------------------------------
async def test_opening_under_a_live_request_id_is_409(stack: Stack, ws: WS) -> None:
    other = await WS.connect(stack.ws_url(0))
    x = samples(4000, seed=3)
    await live_call(ws, "dup", x)
    await ws.send({"request_id": "dup"})  # the same socket
    m = await ws.until(is_error("dup"))
    assert m["status"] == 409 and "already in use" in m["error"]
    await ws.send({"request_id": "dup", "text": 5})  # a malformed opening under a live id is a 409 too
    assert (await ws.until(is_error("dup")))["status"] == 409
    await other.send({"request_id": "dup", "files": [pcm_file(x)], "end_input": True})  # another socket
    assert (await other.until(is_error("dup")))["status"] == 409
    y = samples(1500, seed=4)
    await ws.send({"request_id": "dup", "append": [pcm_file(y)]})  # the live call goes on
    await finish(ws, "dup", np.concatenate([x, y]))
    await other.send({"request_id": "dup", "files": [pcm_file(x)], "end_input": True})  # free once it ended
    assert "finish" in await other.final("dup")
    await other.close()


async def test_opening_under_a_live_request_id_on_another_frontend_is_409(stack: Stack, ws: WS) -> None:
    far = await WS.connect(stack.ws_url(1))
    x = samples(2600, seed=5)
    await live_call(ws, "across", x)
    await far.send({"request_id": "across"})
    m = await far.until(is_error("across"))
    assert m["status"] == 409 and "already in use" in m["error"]
    await finish(ws, "across", x)
    await far.send({"request_id": "across"})  # the request_id is free on every frontend once the call ended
    await far.send({"request_id": "across", "append": [pcm_file(x)]})
    await finish(far, "across", x)
    await far.close()


# -- input that yields nothing, or the wrong thing -------------------------------
async def test_file_naming_an_unknown_stream_is_400(ws: WS) -> None:
    bad = pcm_file(samples(100), stream="nope")
    await ws.send({"request_id": "unk", "files": [bad]})  # on an opening: refused, nothing opened
    m = await ws.until(is_error("unk"))
    assert m["status"] == 400 and "unknown stream 'nope'" in m["error"] and "audio_in" in m["error"]
    x = samples(1300)
    await live_call(ws, "unk", x)  # so the request_id was never taken
    await ws.send({"request_id": "unk", "append": [bad]})  # on an append: ends the call
    m = await ws.final("unk")
    assert m.get("status") == 400 and "unknown stream 'nope'" in m["error"]


async def test_text_only_append_that_yields_no_item_is_400(ws: WS) -> None:
    await live_call(ws, "txt", samples(2000))
    await ws.send({"request_id": "txt", "append": {"text": "hello"}})
    m = await ws.final("txt")
    assert m.get("status") == 400 and "no text stream" in m["error"]
    await ws.send({"request_id": "txt", "text": "hello"})  # an opening: refused the same way
    m = await ws.until(is_error("txt"))
    assert m["status"] == 400 and "no text stream" in m["error"]
    await live_call(ws, "txt", samples(2000))
    await ws.send({"request_id": "txt", "append": {}})  # neither text nor files nor end_input
    m = await ws.final("txt")
    assert m.get("status") == 400 and "needs text or files" in m["error"]


async def test_unknown_model_is_400(ws: WS) -> None:
    await ws.send({"request_id": "mdl", "model": "no_such_model"})
    m = await ws.until(is_error("mdl"))
    assert m["status"] == 400 and "unknown model 'no_such_model'" in m["error"]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ({"channels": 2}, "1 channel (got 2)"),
        ({"rate": 8000}, "16000 Hz (got 8000)"),
        ({"width": 1}, "16-bit samples (got 8-bit)"),
        ({"width": 3}, "16-bit samples (got 24-bit)"),
    ],
)
async def test_wav_with_wrong_format_is_400_naming_what_was_expected(ws: WS, kind: dict[str, int], expected: str) -> None:
    f = {"name": "x.wav", "data": wav(samples(1600), **kind)}
    await ws.send({"request_id": "wav1", "files": [f]})
    m = await ws.until(is_error("wav1"))
    assert m["status"] == 400 and expected in m["error"], m
    x = samples(1600, seed=7)
    await ws.send({"request_id": "wav2", "files": [{"name": "ok.wav", "data": wav(x)}]})  # the right format works
    await ws.until(lambda m: m.get("request_id") == "wav2" and "output" in m, keep=True)
    await ws.send({"request_id": "wav2", "append": [f]})
    m = await ws.final("wav2")
    assert m.get("status") == 400 and expected in m["error"], m
    assert echo_bytes(ws.outputs("wav2")) == x[:FRAME].tobytes()  # what came before the bad append went through


# -- a rejected append ----------------------------------------------------------
async def test_rejected_append_ends_the_call_with_no_finish(ws: WS) -> None:
    x = samples(3000, seed=8)
    await live_call(ws, "rej", x)
    await ws.send({"request_id": "rej", "append": [{"name": "a.pcm", "data": "@@not base64@@"}]})
    m = await ws.until(lambda m: m.get("request_id") == "rej" and ("error" in m or "finish" in m))
    assert m.get("status") == 400 and "append" not in m and "base64" in m["error"]
    await ws.send({"request_id": "rej", "append": [pcm_file(x)]})  # the call is gone
    assert (await ws.until(is_append_error("rej")))["status"] == 404
    await nothing_for(ws, lambda m: m.get("request_id") == "rej" and "finish" in m, 1.0)
    ws.outputs("rej")  # the ended call's
    await live_call(ws, "rej", x)  # and its request_id is free
    await finish(ws, "rej", x)


# -- after the end --------------------------------------------------------------
async def test_append_after_end_of_input_or_after_the_call_gets_the_append_error(ws: WS) -> None:
    x = samples(3000, seed=9)
    await live_call(ws, "after", x)
    # Back to back: a socket's messages are handled in order, so both come after the end of
    # input and (echo being quick) possibly before the finish.
    await ws.send({"request_id": "after", "end_input": True})
    await ws.send({"request_id": "after", "append": [pcm_file(samples(5000))]})
    await ws.send({"request_id": "after", "end_input": ["audio_in"]})
    for _ in range(2):
        m = await ws.until(is_append_error("after"))
        assert ended_input_or_after_finish(ws, "after", m), m
    final = await ws.final("after")  # the call went on, without the late append
    assert "finish" in final and echo_bytes(ws.outputs("after")) == padded(x)
    await ws.send({"request_id": "after", "append": [pcm_file(x)]})
    m = await ws.until(is_append_error("after"))
    assert m["status"] == 404 and "no live call" in m["error"]


async def test_late_append_for_an_ended_stream_is_neither_charged_nor_sent(ws: WS) -> None:
    """echo has one stream: once it ended, a file naming it gets the append-error reply (409).
    Late appends to one stream while another is open: test_protocol_streams."""
    x = samples(1280, seed=10)
    await live_call(ws, "late", x)
    await ws.send({"request_id": "late", "end_input": ["audio_in"]})
    await ws.send({"request_id": "late", "append": [pcm_file(samples(640), stream="audio_in")]})
    m = await ws.until(is_append_error("late"))
    assert m["status"] == 409 or ended_input_or_after_finish(ws, "late", m), m
    assert "finish" in await ws.final("late")
    assert echo_bytes(ws.outputs("late")) == x.tobytes()


# -- end_input -----------------------------------------------------------------
async def test_end_input_alone_true_or_a_list(ws: WS) -> None:
    for rid, end in [("endt", True), ("endl", ["audio_in"])]:
        x = samples(2222)
        await live_call(ws, rid, x)
        await ws.send({"request_id": rid, "end_input": end})
        assert "finish" in await ws.final(rid)
        assert echo_bytes(ws.outputs(rid)) == padded(x)


async def test_end_input_on_an_append(ws: WS) -> None:
    for rid, end in [("apt", True), ("apl", ["audio_in"])]:
        x, y = samples(1000, seed=11), samples(3333, seed=12)
        await ws.send({"request_id": rid})
        await ws.send({"request_id": rid, "append": [pcm_file(x)]})
        await ws.send({"request_id": rid, "append": [pcm_file(y)], "end_input": end})
        assert "finish" in await ws.final(rid)
        assert echo_bytes(ws.outputs(rid)) == padded(np.concatenate([x, y]))


async def test_end_input_on_the_opening_is_a_one_shot(ws: WS) -> None:
    """No request_id needed: the reply's request_id is null."""
    for end in (True, ["audio_in"]):
        x = samples(4100, seed=13)
        await ws.send({"files": [pcm_file(x)], "end_input": end})
        final = await ws.final(None)
        assert "finish" in final and final["request_id"] is None
        assert echo_bytes(ws.outputs(None)) == padded(x)
    await ws.send({"request_id": "os1", "files": [pcm_file(samples(10))], "end_input": True})
    assert "finish" in await ws.final("os1")


async def test_end_input_naming_an_unknown_stream_is_400(ws: WS) -> None:
    await live_call(ws, "endu", samples(1300))
    await ws.send({"request_id": "endu", "end_input": ["audio_in", "nope"]})
    m = await ws.final("endu")
    assert m.get("status") == 400 and "unknown stream(s) ['nope'] in end_input" in m["error"]


# -- nulls and abort ------------------------------------------------------------
async def test_null_fields_count_as_absent(ws: WS) -> None:
    x = samples(3000, seed=14)
    await ws.send({"request_id": "nul", "model": None, "text": None, "files": None, "model_kwargs": None, "end_input": None})
    await ws.send(
        {
            "request_id": "nul",
            "append": {"text": None, "files": [{"name": "a.pcm", "data": pcm(x), "stream": None}], "model_kwargs": None},
            "end_input": None,
            "abort": None,
        }
    )
    await ws.send({"request_id": "nul", "end_input": True, "append": None})
    final = await ws.final("nul")
    assert "finish" in final and echo_bytes(ws.outputs("nul")) == padded(x)


async def test_abort(ws: WS) -> None:
    await live_call(ws, "abo", samples(5000))
    await ws.send({"request_id": "abo", "abort": True})
    m = await ws.until(is_error("abo"))
    assert m["status"] == 499 and "aborted" in m["error"]
    await ws.send({"request_id": "abo", "append": [pcm_file(samples(10))]})
    assert (await ws.until(is_append_error("abo")))["status"] == 404
    await ws.send({"request_id": "abo", "abort": True})  # nothing left to abort
    assert (await ws.until(is_append_error("abo")))["status"] == 404
    await nothing_for(ws, lambda m: m.get("request_id") == "abo" and "finish" in m, 0.5)
    ws.outputs("abo")  # the aborted call's
    x = samples(1300)
    await live_call(ws, "abo", x)  # the request_id is free
    await finish(ws, "abo", x)


# -- malformed messages ----------------------------------------------------------
async def test_malformed_messages_get_a_clear_error_and_the_socket_goes_on(ws: WS) -> None:
    x = samples(2000, seed=15)
    await live_call(ws, "keep", x)
    cases: list[tuple[str | bytes, str | None, bool, str]] = [
        ("not json", None, False, "not JSON"),
        (b"\xff\xfe", None, False, "not msgpack"),  # a binary frame is msgpack
        (b'{"request_id": 5', None, False, "not JSON"),  # unless it starts as JSON does
        ("[1, 2]", None, False, "JSON object"),
        ('{"request_id": 5}', None, False, "request_id must be a string"),
        ('{"request_id": "m1", "text": 5}', "m1", False, "text must be a string"),
        ('{"text": "hi"}', None, False, "needs a request_id"),
        ('{"request_id": "m2", "bogus": 1}', "m2", False, "unknown field(s) ['bogus']"),
        ('{"request_id": "m3", "append": 5}', "m3", True, "append must be"),
        ('{"request_id": "m4", "end_input": "yes"}', "m4", True, "end_input must be"),
        ('{"request_id": "m5", "abort": "yes"}', "m5", True, "abort must be true"),
        # Nesting past the decoder's recursion limit: before, the socket was dropped, no reply.
        ("[" * 5000, None, False, "nested too deeply"),
        ('{"request_id": "keep", "append": ' + "[" * 5000, None, False, "nested too deeply"),
        ('{"request_id": "m6", "model_kwargs": ' + '{"a": ' * 40 + "1" + "}" * 41, "m6", False, "nest deeper than 32"),
    ]
    for raw, rid, append, words in cases:
        if isinstance(raw, bytes):
            await ws.ws.send(raw)
        else:
            await ws.send(raw)
        m = await ws.until(lambda m: "error" in m and "output" not in m)
        assert m["request_id"] == rid and m["status"] == 400 and words in m["error"], (raw, m)
        assert bool(m.get("append")) is append, (raw, m)
    await ws.ws.send(json.dumps({"request_id": "bin", "files": [pcm_file(x)], "end_input": True}).encode())
    assert "finish" in await ws.final("bin")  # a binary frame holding JSON is read all the same
    ws.outputs("bin")
    await ws.send({"request_id": "keep", "append": [pcm_file(x)]})
    await finish(ws, "keep", np.concatenate([x, x]))


async def test_message_over_max_message_mb(ws: WS) -> None:
    limit = int(MAX_MESSAGE_MB * 1024 * 1024)
    big = samples(limit // 2, seed=16)  # base64 makes it ~2/3 of the limit over
    x = samples(1500)
    await live_call(ws, "keep2", x)
    await ws.send({"request_id": "big1", "files": [pcm_file(big)]})
    m = await ws.until(is_error("big1"))
    assert m["status"] == 400 and m["error"].startswith("max_message_mb:"), m
    await ws.send("x" * (limit + 1))
    m = await ws.until(is_error(None))
    assert m["status"] == 400 and m["error"].startswith("max_message_mb:")
    await live_call(ws, "big2", x)
    await ws.send({"request_id": "big2", "append": [pcm_file(big)]})  # an oversize append is a rejected append
    m = await ws.final("big2")
    assert m.get("status") == 400 and m["error"].startswith("max_message_mb:")
    await finish(ws, "keep2", x)  # the socket and its other calls went on


async def test_frame_far_over_max_message_mb_closes_the_socket(stack: Stack) -> None:
    """Past 2 x max_message_mb + 1 MiB the server does not read the frame: it closes the socket (1009)."""
    import websockets

    sock = await WS.connect(stack.ws_url())
    try:
        await sock.send("x" * (int(2 * MAX_MESSAGE_MB * 1024 * 1024) + 1024 * 1024 + 1))
    except (websockets.ConnectionClosed, ConnectionResetError):
        # the server closed the socket while the frame was still being written: also a refusal
        # (whether the close frame is read first is a matter of timing)
        return
    with pytest.raises(websockets.ConnectionClosed) as e:
        await sock.recv(timeout=10)
    assert e.value.rcvd is None or e.value.rcvd.code == 1009


# -- binary frames -----------------------------------------------------------------
async def test_binary_frames_beside_json_on_one_socket(stack: Stack, ws: WS) -> None:
    """A call opened in msgpack gets every message back in msgpack, its audio as bytes, and a
    JSON call on the same socket JSON, whichever encoding their later messages use; the worker
    published the msgpack call's outputs packed (the frontend relays them as they come). A
    malformed binary message gets the JSON refusal, in msgpack."""
    x, y = samples(3000, seed=40), samples(2000, seed=41)
    await ws.send_packed({"request_id": "bin-mp"})
    await ws.send({"request_id": "bin-js"})
    await ws.send_packed({"request_id": "bin-mp", "append": [{"name": "a.pcm", "data": x.tobytes()}]})
    await ws.send_packed({"request_id": "bin-js", "append": [{"name": "a.pcm", "data": y.tobytes()}]})
    await ws.send_packed({"request_id": "bin-none", "append": [{"name": "a.pcm", "data": pcm(x)}]})
    refused = await ws.until(is_append_error("bin-none", 400))
    assert isinstance(refused, PackedMessage) and "data must be bytes (msgpack bin), got base64 text" in refused["error"]
    await ws.send({"request_id": "bin-mp", "end_input": True})
    await ws.send_packed({"request_id": "bin-js", "end_input": True})
    mp, js = await ws.final("bin-mp"), await ws.final("bin-js")
    assert isinstance(mp, PackedMessage) and "finish" in mp, mp
    assert not isinstance(js, PackedMessage) and "finish" in js, js
    mp_out, js_out = ws.outputs("bin-mp"), ws.outputs("bin-js")
    assert all(isinstance(o["audio"], bytes) for o in mp_out) and all(isinstance(o["audio"], str) for o in js_out)
    assert echo_bytes(mp_out) == padded(x) and echo_bytes(js_out) == padded(y)
    async with bus_client(stack.nats_url, "test-binary-frames") as bus:
        stored = [wire.decode_as(b, wire.OutputMsg) async for _, b, _ in bus.read_stored([subjects.out(mp["finish"]["call_id"])])]
    assert len(stored) == len(mp_out) and all(o.packed for o in stored)


# -- limits ----------------------------------------------------------------------
async def test_max_call_input_mb_over_the_calls_lifetime(ws: WS) -> None:
    part = samples(150_000, seed=17)  # 300,000 bytes an append; the call may have 1 MiB
    await live_call(ws, "mb", part)
    for _ in range(2):
        await ws.send({"request_id": "mb", "append": [pcm_file(part)]})
    await ws.send({"request_id": "mb", "append": [pcm_file(part)]})
    m = await ws.final("mb", timeout=30)
    assert m.get("status") == 400 and m["error"].startswith("max_call_input_mb:"), m
    frames = [o["frame"] for o in ws.outputs("mb")]
    assert len(frames) <= 3 * 150_000 // FRAME  # the refused append was not sent


# -- POST /generate -------------------------------------------------------------
async def test_post_generate_streams_ndjson(stack: Stack) -> None:
    x = samples(5555, seed=18)
    async with httpx.AsyncClient(base_url=stack.http_url(1), timeout=30) as client:
        lines: list[dict[str, Any]] = []
        async with client.stream("POST", "/generate", json={"request_id": "post1", "files": [pcm_file(x)]}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            async for line in r.aiter_lines():
                if line:
                    lines.append(json.loads(line))
        assert all(m["request_id"] == "post1" for m in lines)
        assert "finish" in lines[-1] and lines[-1]["finish"]["usage"]["frames"] == len(lines) - 1
        assert echo_bytes([m["output"] for m in lines[:-1]]) == padded(x)

        r = await client.post("/generate", json={"files": [pcm_file(x)]})  # no request_id: a one-shot needs none
        assert r.status_code == 200 and "finish" in json.loads(r.text.splitlines()[-1])
        for body, words in [
            (b"not json", "not JSON"),
            (json.dumps({"request_id": "p.2", "files": []}).encode(), "[A-Za-z0-9_-]"),
            (json.dumps({"request_id": "p3", "files": [pcm_file(x, stream="nope")]}).encode(), "unknown stream"),
            (json.dumps({"request_id": "p4", "append": []}).encode(), "takes an opening"),
            (b"[" * 5000, "nested too deeply"),  # was a 500
        ]:
            r = await client.post("/generate", content=body)
            assert r.status_code == 400 and words in r.json()["error"] and r.json()["status"] == 400, r.text


async def test_post_generate_refuses_a_live_request_id(stack: Stack, ws: WS) -> None:
    x = samples(1300)
    await live_call(ws, "postdup", x)
    async with httpx.AsyncClient(base_url=stack.http_url(0), timeout=30) as client:
        r = await client.post("/generate", json={"request_id": "postdup", "files": [pcm_file(x)]})
        assert r.status_code == 409 and r.json()["status"] == 409
        t = time.monotonic()
        r = await client.post("/generate", content=b"x" * (int(MAX_MESSAGE_MB * 1024 * 1024) + 1))
        # Its Content-Length says it is over: 413 before the body is read.
        assert r.status_code == 413 and r.json()["error"].startswith("max_message_mb:")
        assert time.monotonic() - t < 10
    await finish(ws, "postdup", x)


async def test_edge_between_partitions_in_one_worker_is_still_stored(stack: Stack, ws: WS) -> None:
    """This stack's one worker runs both echo partitions, so the frames edge is delivered
    inside the process; every edge item and its end are in the stream all the same."""
    audio = samples(5 * FRAME, seed=9)
    await ws.send({"request_id": "local-edge", "files": [pcm_file(audio)], "end_input": True})
    final = await ws.final("local-edge")
    assert echo_bytes(ws.outputs("local-edge")) == audio.tobytes()
    nc = await nats.connect(stack.nats_url)
    try:
        cid = final["finish"]["call_id"]
        info = await nc.jetstream().stream_info(subjects.STREAM, subjects_filter=subjects.call_all(cid))
        held = info.state.subjects or {}
        assert held.get(subjects.edge(cid, "frames")) == 5, held
        assert held.get(subjects.edge_end(cid, "frames")) == 1, held
    finally:
        await nc.close()
