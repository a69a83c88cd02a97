"""`duplexbus call` reads only the WAVs the models take as raw PCM: mono 16-bit 16 kHz."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.call import pcm_file, read_wav, reply_audio
from shared.sdk.audio import b64_pcm16, encode_wav, pcm16_from_b64
from tests.support.audio import wav_bytes


def test_reads_mono_16bit_16khz(tmp_path: Path) -> None:
    samples = (np.arange(1000) - 500).astype("<i2")
    path = tmp_path / "ok.wav"
    path.write_bytes(encode_wav(samples, 16000))
    got, rate = read_wav(str(path))
    assert rate == 16000
    assert np.array_equal(got, samples)


def test_refuses_another_sample_rate(tmp_path: Path) -> None:
    path = tmp_path / "cd.wav"
    path.write_bytes(encode_wav(np.zeros(441, dtype="<i2"), 44100))
    with pytest.raises(SystemExit, match="16000 Hz") as e:
        read_wav(str(path))
    assert "44100" in str(e.value)


@pytest.mark.parametrize(("channels", "width", "expected"), [(2, 2, "1 channel"), (1, 1, "16-bit")])
def test_refuses_stereo_and_8bit(tmp_path: Path, channels: int, width: int, expected: str) -> None:
    path = tmp_path / "x.wav"
    path.write_bytes(wav_bytes(np.zeros(32, dtype="<i2"), 16000, channels, width))
    with pytest.raises(SystemExit, match=expected):
        read_wav(str(path))


def test_refuses_a_file_that_is_not_wav(tmp_path: Path) -> None:
    path = tmp_path / "no.wav"
    path.write_bytes(b"not a wav at all")
    with pytest.raises(SystemExit, match="not a readable WAV"):
        read_wav(str(path))


def test_appends_and_reply_audio_are_base64_pcm16() -> None:
    samples = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    f = pcm_file(samples)
    assert f["name"] == "chunk.pcm"
    assert np.array_equal(pcm16_from_b64(f["data"]), samples)
    audio, rate = reply_audio([{"text": "hi"}, {"audio": b64_pcm16(samples), "sample_rate": 24000}])
    assert rate == 24000
    assert np.array_equal(audio, samples)
