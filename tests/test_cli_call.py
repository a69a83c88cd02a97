"""`duplexbus call` sends mono 16-bit 16 kHz PCM: other WAVs are converted (and it says so)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import websockets
import websockets.asyncio.server

from clients import call
from clients.call import pcm_file, read_wav, reply_audio
from shared.bus.embedded import free_port
from shared.sdk.audio import b64_pcm16, encode_wav, pcm16_from_b64
from tests.support.audio import wav_bytes


def test_reads_mono_16bit_16khz(tmp_path: Path) -> None:
    samples = (np.arange(1000) - 500).astype("<i2")
    path = tmp_path / "ok.wav"
    path.write_bytes(encode_wav(samples, 16000))
    got, rate = read_wav(str(path))
    assert rate == 16000
    assert np.array_equal(got, samples)


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * hz * t) * 12000).astype("<i2")


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def test_another_rate_is_resampled_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cd.wav"
    path.write_bytes(encode_wav(tone(22050, 1.0), 22050))
    got, rate = read_wav(str(path))
    assert rate == 16000 and abs(len(got) - 16000) <= 2
    assert abs(peak_hz(got, 16000) - 440.0) < 2.0  # the same tone, not sped up or slowed down
    assert "converting 22050 Hz to 16000 Hz" in capsys.readouterr().err


def test_stereo_48k_is_downmixed_and_resampled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "st.wav"
    path.write_bytes(wav_bytes(tone(48000, 0.5, 1000.0), 48000, channels=2))
    got, rate = read_wav(str(path))
    assert rate == 16000 and abs(len(got) - 8000) <= 2
    assert abs(peak_hz(got, 16000) - 1000.0) < 4.0
    assert np.abs(got).max() > 10000  # both channels held the tone: the mix keeps its level
    assert "converting 2 channels to 1 and 48000 Hz to 16000 Hz" in capsys.readouterr().err


def test_8bit_is_read_as_pcm16(tmp_path: Path) -> None:
    path = tmp_path / "x.wav"
    path.write_bytes(wav_bytes(np.zeros(32, dtype="<i2"), 16000, 1, 1))
    got, rate = read_wav(str(path))
    assert rate == 16000 and len(got) == 32


def test_refuses_a_file_that_is_not_audio(tmp_path: Path) -> None:
    path = tmp_path / "no.wav"
    path.write_bytes(b"not a wav at all")
    with pytest.raises(SystemExit, match="cannot read it as audio"):
        read_wav(str(path))


def test_a_missing_file_is_named_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no\.wav: no such file$"):
        read_wav(str(tmp_path / "no.wav"))


def test_a_server_that_is_down_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ok.wav"
    path.write_bytes(encode_wav(tone(16000, 0.2), 16000))
    out = subprocess.run(
        [sys.executable, "-m", "duplexbus.cli", "call", str(path), "--url", f"ws://127.0.0.1:{free_port()}/generate/ws"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.strip().startswith("error: cannot talk to ws://127.0.0.1:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_appends_and_reply_audio_are_base64_pcm16() -> None:
    samples = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    f = pcm_file(samples)
    assert f["name"] == "chunk.pcm"
    assert np.array_equal(pcm16_from_b64(f["data"]), samples)
    audio, rate = reply_audio([{"text": "hi"}, {"audio": b64_pcm16(samples), "sample_rate": 24000}])
    assert rate == 24000
    assert np.array_equal(audio, samples)


def test_in_msgpack_appends_and_reply_audio_are_raw_pcm16() -> None:
    samples = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    assert pcm_file(samples, binary=True) == {"name": "chunk.pcm", "data": samples.tobytes()}
    audio, rate = reply_audio([{"audio": samples[:2].tobytes()}, {"audio": b64_pcm16(samples[2:])}])
    assert rate == 16000 and np.array_equal(audio, samples)


class DeafServer:
    """A WebSocket server that reads nothing of a call for `deaf_s` (a server working through
    other uploads: the client's pings wait unanswered), then reads it all and finishes it,
    or, with `answer` false, never says anything at all."""

    def __init__(self, deaf_s: float, answer: bool = True) -> None:
        self.deaf_s, self.answer = deaf_s, answer
        self.appends = 0
        self.binary = False  # the client's last message came in a binary frame

    async def handler(self, ws: websockets.asyncio.server.ServerConnection) -> None:
        ws.transport.pause_reading()
        await asyncio.sleep(self.deaf_s)
        ws.transport.resume_reading()
        if not self.answer:
            await ws.wait_closed()  # it answers the client's close, and nothing else
            return
        async for raw in ws:
            msg = call.decode(raw)
            self.binary = isinstance(raw, bytes)
            self.appends += "append" in msg
            if msg.get("end_input"):
                await ws.send(json.dumps({"request_id": msg["request_id"], "finish": {"reason": "end_input"}}))
                return

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        port = free_port()
        async with websockets.asyncio.server.serve(self.handler, "127.0.0.1", port, max_size=None):
            yield f"ws://127.0.0.1:{port}/generate/ws"


async def test_a_fast_call_outlasts_pings_that_wait_behind_its_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A --fast upload's pings wait behind the upload itself. Before, a server busy for longer
    than the keepalive (20 s; 0.3 s here) had the call closed with 1011 while it was still
    taking it; now the call finishes. A paced call keeps its keepalive."""
    monkeypatch.setattr(call, "PING_S", 0.3)
    samples = tone(16000, 2.0)
    server = DeafServer(deaf_s=2.0)
    async with server.serving() as url:
        result = await call.stream_call(url, samples, 16000, fast=True)
        assert result["final"] == {"request_id": result["request_id"], "finish": {"reason": "end_input"}}
        assert server.appends == 25 and server.binary  # `duplexbus call` speaks msgpack
        with pytest.raises(websockets.ConnectionClosedError, match="keepalive ping timeout"):
            await call.stream_call(url, samples[:1600], 16000, fast=False)


async def test_a_fast_call_to_a_server_that_takes_nothing_stops_with_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call, "STALL_S", 1.0)
    server = DeafServer(deaf_s=0.0, answer=False)
    async with server.serving() as url:
        started = time.monotonic()
        with pytest.raises(call.Stalled, match="took nothing and sent nothing for 1 s"):
            await call.stream_call(url, tone(16000, 1.0), 16000, fast=True)
        assert time.monotonic() - started < 10
