"""Fuzzing `/generate/ws` and `POST /generate` (issue 11) with live calls alongside.

Hypothesis makes client messages: any JSON value, objects with the protocol's fields
holding anything, valid openings and appends among them, the same in msgpack (binary
frames), bytes that are not UTF-8 or not msgpack, nesting thousands deep. Each example runs
on a socket of its own (and a POST of its own). Every reply must say what was wrong with a
status under 500, the socket must stay open (or close with the code its rule gives: 1009
for a frame too large to read), no process may exit, and three live calls that run all
along, on sockets of their own, must get back every frame byte-exact. Bounded: a fixed number of examples, no shrinking
database on disk.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.support.audio import echo_bytes, padded, pcm_file
from tests.support.client import WS
from tests.support.poll import until_sync
from tests.support.stack import Stack, running_stack

CONFIG: dict[str, Any] = {"model": "echo", "max_message_mb": 0.25, "request_timeout_s": 30.0}
FUZZ = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


# Hypothesis keeps caches (even with no database) in a folder of its own, from the moment
# its tests are collected (selected or not): a temporary one here, removed when the run
# ends, not the repository's.
HYPOTHESIS_HOME = Path(tempfile.gettempdir()) / f"duplexbus-hypothesis-{os.getpid()}"
set_hypothesis_home_dir(HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, HYPOTHESIS_HOME, ignore_errors=True)


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, CONFIG) as s:
        yield s


# -- what a client may send ------------------------------------------------------
leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_value = st.recursive(
    leaf, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=16
)
request_id = st.none() | st.sampled_from(["fz", "live-0", "a.b", "", "x" * 65, "é"]) | st.text(max_size=6) | st.integers()
pcm = st.binary(max_size=4000).map(lambda b: base64.b64encode(b).decode())
data = pcm | st.text(max_size=12) | st.sampled_from(["AAA", "=", "UklGRg=="])
a_file = st.fixed_dictionaries(
    {"name": st.sampled_from(["a.pcm", "a.wav", "", "x.bin"]), "data": data},
    optional={"stream": st.sampled_from(["audio_in", "nope"]) | st.none() | json_value},
)
files = st.lists(a_file | json_value, max_size=3)
fields = {
    "request_id": request_id,
    "model": st.sampled_from(["echo", "nope"]) | json_value,
    "text": st.text(max_size=12) | json_value,
    "files": files | json_value,
    "model_kwargs": json_value,
    "end_input": st.booleans() | st.lists(st.sampled_from(["audio_in", "x"]), max_size=2) | json_value,
    "append": files | st.fixed_dictionaries({}, optional={"text": st.text(max_size=5), "files": files}) | json_value,
    "abort": st.just(True) | json_value,
    "bogus": json_value,
}
protocol_object = st.fixed_dictionaries({}, optional=fields)
valid_append = st.builds(lambda f: {"request_id": "fz", "append": [{"name": "a.pcm", "data": f}]}, pcm)
packed_append = st.builds(lambda f: {"request_id": "fz", "append": [{"name": "a.pcm", "data": f}]}, st.binary(max_size=4000))


def packed(value: object) -> bytes:
    """The value in msgpack (an integer msgpack cannot hold: a byte msgpack never uses)."""
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:
        return b"\xc1"


def reply(frame: str | bytes) -> dict[str, Any]:
    """A reply: JSON text, or msgpack in a binary frame."""
    m: dict[str, Any] = msgspec.msgpack.decode(frame) if isinstance(frame, bytes) else json.loads(frame)
    return m


message: st.SearchStrategy[str | bytes] = st.one_of(
    protocol_object.map(json.dumps),
    valid_append.map(json.dumps),
    json_value.map(json.dumps),
    protocol_object.map(packed),
    packed_append.map(packed),
    json_value.map(packed),
    st.binary(max_size=64),  # a binary frame: msgpack (or JSON, where it starts with "{")
    st.text(max_size=64),
    st.integers(1, 20_000).map(lambda n: "[" * n),
    st.integers(1, 3000).map(lambda n: '{"request_id": "fz", "append": ' + '{"a": ' * n),
    st.just("x" * 300_000),  # over max_message_mb
)
session = st.tuples(st.booleans(), st.lists(message, min_size=1, max_size=5))


# -- live calls alongside --------------------------------------------------------
class LiveCalls:
    """Three live calls on sockets of their own, appending every 50 ms in a thread of their
    own, until stopped; then each is finished and checked byte-exact."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.stop = threading.Event()
        self.result: list[str] = []
        self.running = 0  # calls that have had an output (written by the thread, read by the tests)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, i: int) -> None:
        # It reads its outputs only at the end, in a thread beside Hypothesis: the test client
        # reads whatever comes and sends no pings of its own (WS.connect says why).
        ws = await WS.connect(self.stack.ws_url(0))
        rid = f"live-{i}"
        sent: list[np.ndarray] = []
        await ws.send({"request_id": rid})
        rng = np.random.default_rng(i)
        while not self.stop.is_set():
            x = rng.integers(-20000, 20000, int(rng.integers(1, 3000))).astype("<i2")
            sent.append(x)
            await ws.send({"request_id": rid, "append": [pcm_file(x)]})
            if len(sent) == 1:  # under way: its first output is back (kept for the check at the end)
                await ws.until(lambda m: m.get("request_id") == rid and "output" in m, keep=True)
                self.running += 1
            await asyncio.sleep(0.05)  # the client's pace, not a wait
        await ws.send({"request_id": rid, "end_input": True})
        final = await ws.final(rid, timeout=30)
        ok = "finish" in final and echo_bytes(ws.outputs(rid)) == padded(np.concatenate(sent))
        self.result.append("ok" if ok else f"{rid}: {final}")
        await ws.close()

    async def _run(self) -> None:
        results = await asyncio.gather(*(self._one(i) for i in range(3)), return_exceptions=True)
        self.result.extend(f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException))


@pytest.fixture(scope="module")
def live(stack: Stack) -> Iterator[LiveCalls]:
    calls = LiveCalls(stack)
    calls.thread.start()
    until_sync(lambda: calls.running == 3 or calls.result, 30, "the live calls under way")
    yield calls
    calls.stop.set()
    calls.thread.join(60)


def statuses(msg: dict[str, Any]) -> list[int]:
    return [msg["status"]] if isinstance(msg.get("status"), int) else []


# -- the fuzz tests --------------------------------------------------------------
@FUZZ
@given(session)
def test_fuzzed_socket_messages_get_4xx_replies_and_the_socket_goes_on(stack: Stack, live: LiveCalls, s: Any) -> None:
    open_first, frames = s
    with connect(stack.ws_url(0), max_size=None, open_timeout=10) as ws:
        if open_first:
            ws.send(json.dumps({"request_id": "fz"}))
        for i, frame in enumerate(frames):
            try:
                ws.send(frame)
                probe = f"probe-{i}"
                ws.send(json.dumps({"request_id": probe, "abort": True}))  # its reply marks the end of frame's
                while True:
                    m = reply(ws.recv(timeout=15))
                    assert all(s < 500 for s in statuses(m)), (frame[:200], m)
                    if m.get("request_id") == probe:
                        assert m["status"] == 404, m
                        break
            except ConnectionClosed as e:
                assert e.rcvd is not None and e.rcvd.code == 1009, (frame[:200], e)  # only a frame too large to read
                return


@FUZZ
@given(message)
def test_fuzzed_post_generate_bodies_get_4xx_answers(stack: Stack, live: LiveCalls, body: str | bytes) -> None:
    r = httpx.post(stack.http_url(0) + "/generate", content=body, timeout=30)
    assert r.status_code < 500, (body[:200], r.text[:300])
    if r.status_code == 200:
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert lines and all(s < 500 for m in lines for s in statuses(m)), (body[:200], lines[-1:])
        assert "finish" in lines[-1] or "error" in lines[-1]


def test_after_the_fuzz_no_process_exited_and_the_live_calls_were_byte_exact(stack: Stack, live: LiveCalls) -> None:
    live.stop.set()
    live.thread.join(60)
    assert live.result == ["ok", "ok", "ok"], live.result
    assert all(p.alive() for p in stack.procs.values()), stack.logs()
    frontend_log = stack.procs["frontend-0"].log.read_text(errors="replace")
    assert "Exception in ASGI application" not in frontend_log and "Traceback" not in frontend_log, frontend_log[-3000:]
