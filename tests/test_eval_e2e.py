"""`duplexbus eval` as a user runs it, against a real `echo` stack: each reply byte-exact
against the sent audio, over generate-ws and over realtime (the frontend's `WS /v1/realtime`).
(`voice_assistant`: tests/test_eval_voice.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from shared.sdk.audio import encode_wav
from tests.support.eval import eval_cli, results
from tests.support.stack import Stack, running_stack


def echo_corpus(folder: Path) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    clips = [rng.integers(-8000, 8000, n, dtype=np.int16) for n in (16000, 12345, 24000 + 1)]
    folder.mkdir()
    for i, c in enumerate(clips):
        (folder / f"clip{i}.wav").write_bytes(encode_wav(c, 16000))
    (folder / "clip0.txt").write_text("a reference that echo's check ignores\n")
    return clips


@pytest.fixture(scope="module")
async def echo_stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "echo"}) as s:
        yield s


async def test_echo_over_generate_ws_is_byte_exact(echo_stack: Stack, tmp_path: Path) -> None:
    clips = echo_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    proc = await asyncio.to_thread(
        eval_cli, str(tmp_path / "corpus"), "--url", echo_stack.ws_url(), "--expect-echo", "--concurrency", "2",
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs, summary = results(out)
    assert summary["samples"] == summary["ok"] == summary["echo_exact"] == 3 and summary["failed"] == 0
    assert summary["wer"] is None  # echo's quality is byte-exactness, not words
    assert all(r["ok"] and r["echo_exact"] and r["retries"] == 0 for r in recs)
    by_name = {r["sample"]: r for r in recs}
    for i, clip in enumerate(clips):
        r = by_name[f"clip{i}"]
        assert r["ttfa_s"] is not None and r["ttfa_s"] < 1.0
        assert r["reply_audio_s"] >= len(clip) / 16000
        assert (out / r["reply_wav"]).exists()
    assert "echo byte-exact" in proc.stdout and "3/3" in proc.stdout  # the summary table
    assert (out / "latency.png").stat().st_size > 0 and (out / "timelines.png").stat().st_size > 0


async def test_a_sample_the_deployment_refuses_is_recorded_with_its_stage_and_reason(echo_stack: Stack, tmp_path: Path) -> None:
    echo_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    proc = await asyncio.to_thread(
        eval_cli, str(tmp_path / "corpus"), "--url", echo_stack.ws_url(), "--model", "no-such-model", "--pace", "fast",
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 1
    recs, summary = results(out)
    assert summary["failed"] == 3 and summary["ok"] == 0
    assert all(r["reason"] == "server_error" and r["retries"] == 0 and "400" in r["detail"] for r in recs)


async def test_echo_over_realtime_is_byte_exact(echo_stack: Stack, tmp_path: Path) -> None:
    echo_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    url = echo_stack.ws_url().replace("/generate/ws", "/v1/realtime")
    proc = await asyncio.to_thread(
        eval_cli, str(tmp_path / "corpus"), "--protocol", "realtime", "--url", url, "--model", "echo",
        "--turn-detection", "none", "--expect-echo", "--out", str(out),
        "--quiet", "1",  # echo's reply is whole within milliseconds; the default 5 s window waits for slow models
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs, summary = results(out)
    assert summary["samples"] == summary["ok"] == summary["echo_exact"] == 3 and summary["failed"] == 0
    assert all(r["ok"] and r["echo_exact"] and r["retries"] == 0 for r in recs)
