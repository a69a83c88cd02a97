"""`duplexbus replay`: a call found by cid or request_id, its timeline, its raw messages, its
audio, a rerun against a deployment, a live call followed, and all of it after every
process has restarted. Through the real services and the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from clients.eval.core import Event, Kind
from clients.replay import Table, describe
from clients.replay_rerun import differences
from models.echo import FRAME
from shared.bus import subjects, wire
from shared.bus.embedded import NatsServer
from shared.bus.history import Stored, _ack_fields
from shared.sdk.chunking import Item
from tests.support.audio import padded, pcm_file
from tests.support.client import WS
from tests.support.stack import Stack, running_stack

SAMPLES = (np.arange(5 * FRAME) % 700 - 350).astype("<i2")


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo"}) as s:
        yield s


def replay(nats_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duplexbus.cli", "replay", *args, "--nats-url", nats_url],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def areplay(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(replay, nats_url, *args)


async def live_call(url: str, rid: str, samples: np.ndarray, pace_s: float = 0.0) -> str:
    """A live call of `samples` in FRAME appends (pace_s apart); its cid."""
    ws = await WS.connect(url)
    await ws.send({"request_id": rid})
    for i in range(0, len(samples), FRAME):
        await ws.send({"request_id": rid, "append": [pcm_file(samples[i : i + FRAME])]})
        await asyncio.sleep(pace_s)
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid)
    await ws.close()
    return str(final["finish"]["call_id"])


def rows(out: str) -> list[list[str]]:
    """The table's rows, split into t, gap, kind, and the rest."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("t ms")) + 1
    return [line.split(None, 3) for line in lines[start:]]


async def test_timeline_by_cid_from_the_streams_own_timestamps(stack: Stack) -> None:
    cid = await live_call(stack.ws_url(), "tl-1", SAMPLES, pace_s=0.08)
    proc = await areplay(stack.nats_url, cid)
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    kinds = [r[2] for r in table]
    assert kinds.count("in") == 5 and kinds.count("edge") == 5 and kinds.count("out") == 5
    assert kinds.count("open") == 1 and kinds.count("done") == 2 and kinds[-1] == "fin"
    t = [float(r[0]) for r in table]
    assert t == sorted(t) and t[kinds.index("open")] == 0.0
    ins = [t[i] for i, k in enumerate(kinds) if k == "in"]
    assert 250 < ins[-1] - ins[0] < 2000  # ms: the appends' own pacing, 80 ms apart
    out_rows = [r for r in table if r[2] == "out"]
    assert all("Talker" in r[3] and "audio 2560 B" in r[3] for r in out_rows)
    assert [r[3].split()[1] for r in out_rows] == ["0", "1", "2", "3", "4"]  # seq


async def test_a_reused_request_id_lists_every_call_with_it(stack: Stack) -> None:
    first = await live_call(stack.ws_url(), "again", SAMPLES[:FRAME])
    second = await live_call(stack.ws_url(), "again", SAMPLES[:FRAME])
    proc = await areplay(stack.nats_url, "again")
    assert proc.returncode == 0, proc.stderr
    assert "2 calls with request_id 'again'" in proc.stdout
    assert proc.stdout.index(first) < proc.stdout.index(second)  # oldest first
    one = await live_call(stack.ws_url(), "only-once", SAMPLES[:FRAME])
    proc = await areplay(stack.nats_url, "only-once")
    assert proc.returncode == 0 and f"call {one}:" in proc.stdout
    missing = await areplay(stack.nats_url, "never-used")
    assert missing.returncode == 1 and "no call with cid or request_id 'never-used'" in missing.stdout


async def test_json_keeps_the_raw_form(stack: Stack) -> None:
    cid = await live_call(stack.ws_url(), "raw-1", SAMPLES[:FRAME])
    proc = await areplay(stack.nats_url, cid, "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["subject"].startswith(f"call.{cid}.")
    [open_] = [m for m in lines if m["t"] == "open"]
    assert open_["request_id"] == "raw-1" and open_["model"] == "echo"
    assert [m["json"]["frame"] for m in lines if m["t"] == "out"] == [0]


async def test_audio_writes_the_input_and_the_reply(stack: Stack, tmp_path: Path) -> None:
    samples = SAMPLES[: 3 * FRAME + 100]
    cid = await live_call(stack.ws_url(), "audio-1", samples)
    proc = await areplay(stack.nats_url, cid, "--audio", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for name in ("input.audio_in.wav", "reply.wav"):
        with wave.open(str(tmp_path / name)) as w:
            assert w.getframerate() == 16000 and w.getnchannels() == 1
            assert w.readframes(w.getnframes()) == padded(samples), name


async def test_rerun_of_an_echo_call_is_identical(stack: Stack) -> None:
    cid = await live_call(stack.ws_url(), "rerun-1", SAMPLES, pace_s=0.1)
    t0 = time.monotonic()
    proc = await areplay(stack.nats_url, cid, "--rerun", stack.ws_url())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout and "5 outputs (recorded: 5)" in proc.stdout
    assert time.monotonic() - t0 > 0.4  # sent with the recorded pacing (four gaps of 100 ms), not at once


def test_rerun_reports_how_outputs_differ() -> None:
    a = [Event(Kind.REPLY_AUDIO, "audio", audio=b"\x01\x02\x03\x04"), Event(Kind.TRANSCRIPT, "transcript", text="hi")]
    assert differences(a, list(a)) == []
    b = [Event(Kind.REPLY_AUDIO, "audio", audio=b"\x01\x02\x09\x04"), Event(Kind.TRANSCRIPT, "transcript", text="ho")]
    assert differences(a, b) == [
        "reply audio differs from byte 2 (recorded 4 bytes, rerun 4)",
        "output 0 differs: recorded transcript 'hi', rerun transcript 'ho'",
    ]
    assert differences(a, a[:1]) == ["1 other outputs recorded, 0 in the rerun"]


async def test_follow_tails_a_live_call_until_it_ends(stack: Stack) -> None:
    rid = "follow-1"
    ws = await WS.connect(stack.ws_url())
    # The opening carries the first frame: its item is stored before the call's open.
    await ws.send({"request_id": rid, "files": [pcm_file(SAMPLES[:FRAME])]})
    await ws.until(lambda m: m.get("request_id") == rid and "output" in m, keep=True)  # open, and an output to follow
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "duplexbus.cli", "replay", rid, "--follow", "--nats-url", stack.nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    while not any(" out " in line for line in lines):  # the output so far came while the call is live
        lines.append((await asyncio.wait_for(proc.stdout.readline(), 30)).decode())
    assert proc.returncode is None
    for i in range(1, 5):
        await ws.send({"request_id": rid, "append": [pcm_file(SAMPLES[i * FRAME : (i + 1) * FRAME])]})
        await asyncio.sleep(0.05)
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid)
    await ws.close()
    rest, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    followed = rows("".join(lines) + rest.decode())
    kinds = [r[2] for r in followed]
    assert kinds.count("out") == 5 and kinds[-1] == "fin"
    # Times count from the call's open, as in the table of the ended call, not from the
    # first message seen (the opening's item, stored before the open).
    assert kinds.index("in") < kinds.index("open") and float(followed[kinds.index("open")][0]) == 0.0
    whole = await areplay(stack.nats_url, str(final["finish"]["call_id"]))
    assert whole.returncode == 0, whole.stderr
    assert [r[:3] for r in followed] == [r[:3] for r in rows(whole.stdout)]


async def test_a_nats_url_list_reaches_the_server_that_answers(stack: Stack) -> None:
    cid = await live_call(stack.ws_url(), "list-1", SAMPLES[:FRAME])
    # a cluster's URLs, comma-separated: the first one does not answer
    proc = await areplay(f"nats://127.0.0.1:1,{stack.nats_url}", cid)
    assert proc.returncode == 0, proc.stderr
    assert f"call {cid}:" in proc.stdout


def test_rows_show_gaps_and_mark_stalls() -> None:
    cid = subjects.new_cid()
    item = wire.InputItem(seq=3, item=wire.WireItem.from_item(Item(np.full(4, 100, "<i2"), {})))
    t = Table(t0_ns=1_000_000_000, stall_ms=500)
    first = t.row(Stored(subjects.input_(cid, "audio_in"), b"", 1, 1_010_000_000), item)
    late = t.row(Stored(subjects.input_(cid, "audio_in"), b"", 2, 1_710_000_000), item)
    assert first.split()[:5] == ["10.0", "0.0", "in", "audio_in", "3"] and "rms 100" in first
    assert "stall" not in first and late.split()[:2] == ["710.0", "700.0"] and late.endswith("<-- stall")
    assert describe(wire.Fin(status=408, reason="timeout", error="idle"))[2].startswith("408 timeout, error idle")


def test_delivery_fields_of_both_reply_forms() -> None:
    assert _ack_fields("$JS.ACK.DUPLEX_CALLS.c1.1.42.7.1700000000123456789.5") == (42, 1700000000123456789, 5)
    assert _ack_fields("$JS.ACK.dom.hash.DUPLEX_CALLS.c1.1.42.7.1700000000123456789.0.tok") == (42, 1700000000123456789, 0)


async def test_replay_works_after_every_process_restarted() -> None:
    """The stream is the record: stop the services and the nats-server, start a new server
    on the same store, and the call is all there (found by request_id too)."""
    with tempfile.TemporaryDirectory(prefix="duplexbus-replay-") as store:
        server = NatsServer(store).start()
        try:
            async with running_stack(server.url, {"model": "echo"}) as s:
                cid = await live_call(s.ws_url(), "restart-1", SAMPLES, pace_s=0.02)
        finally:
            server.stop()
        again = NatsServer(store).start()  # a new process, a new port, the same store
        try:
            with tempfile.TemporaryDirectory() as out:
                proc = await areplay(again.url, "restart-1", "--audio", out)
                assert proc.returncode == 0, proc.stderr
                assert f"call {cid}:" in proc.stdout and [r[2] for r in rows(proc.stdout)][-1] == "fin"
                with wave.open(str(Path(out) / "reply.wav")) as w:
                    assert w.readframes(w.getnframes()) == padded(SAMPLES)
        finally:
            again.stop()
