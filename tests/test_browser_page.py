"""The page's first-hour help in a real headless Chromium, against real services serving echo:

- a model that is not a voice assistant (echo) says so, plays its audio and counts its outputs;
- the call goes in msgpack (binary frames both ways), and the page's msgpack codec reads and
  writes what msgspec does;
- a finished call shows its call id and the replay command;
- a denied microphone, and a page on an insecure origin, say what to do;
- the favicon is served.

Needs Debian's `chromium` and Playwright (see tests/test_browser.py); skipped without them.
"""

from __future__ import annotations

import re
import struct
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from shared.sdk.audio import encode_wav
from tests.support.stack import Stack, running_stack

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; scripts/system-deps.sh)", allow_module_level=True)
try:
    from playwright.async_api import Browser, Page, WebSocket, async_playwright
except ImportError:
    pytest.skip("playwright is not installed (pip install playwright)", allow_module_level=True)

BASE_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    # duplexbus.test: the name the insecure-origin test reaches the server under, allowed (a
    # loopback frontend without tokens takes no other Host: services/frontend/hosts.py).
    async with running_stack(nats_url, {"model": "echo", "auth": {"allowed_hosts": ["duplexbus.test"]}}) as s:
        yield s


def tone_wav(path: Path, seconds: float = 2.0, rate: int = 48_000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    path.write_bytes(encode_wav((np.sin(2 * np.pi * 300 * t) * 8000).astype("<i2"), rate))
    return path


async def with_browser(args: list[str], run: Any) -> Any:
    async with async_playwright() as pw:
        browser: Browser = await pw.chromium.launch(executable_path=CHROMIUM, args=BASE_ARGS + args, headless=True)
        try:
            return await run(browser)
        finally:
            await browser.close()


CODEC_VALUE = {
    "str8": "é" * 40,
    "str16": "x" * 300,
    "bin8": b"\x00\xff",
    "bin16": bytes(range(256)) * 2,
    "map16": {f"k{i}": i for i in range(20)},
    "array16": list(range(20)),
    "ints": [200, 60_000, 4_000_000_000, 2**40, -100, -30_000, -2_000_000_000, -(2**40), -1, 127],
    "float": 0.1,
    "other": [True, False, None],
}


async def codec_check(page: Page) -> None:
    """The page's msgpack codec: every type a reply may hold, each size of head, decoded by the
    page; and what the page encodes, decoded by msgspec (the frontend's decoder)."""
    packed = msgspec.msgpack.encode(CODEC_VALUE)
    float32 = b"\xca" + struct.pack(">f", 1.5)
    decoded = await page.evaluate(
        """([packed, float32]) => {
            const v = msgpackDecode(new Uint8Array(packed));
            v.bin8 = Array.from(v.bin8); v.bin16 = Array.from(v.bin16);
            return { v, float32: msgpackDecode(new Uint8Array(float32)) };
        }""",
        [list(packed), list(float32)],
    )
    assert decoded["v"] == {**CODEC_VALUE, "bin8": [0, 255], "bin16": list(bytes(range(256)) * 2)}
    assert decoded["float32"] == 1.5
    encoded = await page.evaluate(
        """() => Array.from(msgpackEncode({ request_id: "r", append: [{ name: "mic.pcm", data: new Uint8Array([1, 2, 255]) }],
             n: [0, 127, -1, -32, -33, 255, 70000, -70000, 0xffffffff, 1.5, 2 ** 40], s: "é".repeat(40),
             long: "x".repeat(70000), bin: new Uint8Array(300), arr: new Array(20).fill(null), t: true, f: false }))"""
    )
    assert msgspec.msgpack.decode(bytes(encoded)) == {
        "request_id": "r",
        "append": [{"name": "mic.pcm", "data": b"\x01\x02\xff"}],
        "n": [0, 127, -1, -32, -33, 255, 70000, -70000, 0xFFFFFFFF, 1.5, 2**40],
        "s": "é" * 40,
        "long": "x" * 70000,
        "bin": bytes(300),
        "arr": [None] * 20,
        "t": True,
        "f": False,
    }


async def test_echo_says_it_is_no_voice_assistant_plays_back_and_shows_the_replay_command(stack: Stack, tmp_path: Path) -> None:
    wav = tone_wav(tmp_path / "mic.wav")
    args = [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
    ]

    async def run(browser: Browser) -> dict[str, Any]:
        page = await browser.new_page()
        failed: list[str] = []
        frames: dict[str, list[str | bytes]] = {"sent": [], "received": []}
        page.on("pageerror", lambda e: failed.append(str(e)))
        page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)

        def watch(ws: WebSocket) -> None:
            ws.on("framesent", lambda f: frames["sent"].append(f))
            ws.on("framereceived", lambda f: frames["received"].append(f))

        page.on("websocket", watch)
        await page.goto(stack.http_url() + "/?model=echo")
        await page.click("#start")
        await page.wait_for_function("window.duplexbus.stats.rawOutputs >= 10", timeout=20_000)
        await page.click("#stop")
        await page.wait_for_function("document.body.dataset.state === 'ended'", timeout=20_000)
        await codec_check(page)
        return {
            "failed": failed,
            "notice": await page.inner_text("#notice"),
            "replay": await page.inner_text("#replay"),
            "error": await page.inner_text("#error"),
            "stats": await page.evaluate("window.duplexbus.stats"),
            "frames": frames,
        }

    got = await with_browser(args, run)
    frames = got.pop("frames")
    assert got["failed"] == [] and got["error"] == "", got
    assert frames["sent"] and all(isinstance(f, bytes) for f in frames["sent"]), frames["sent"][:3]  # msgpack
    assert frames["received"] and all(isinstance(f, bytes) for f in frames["received"]), frames["received"][:3]
    opening, append = (msgspec.msgpack.decode(f) for f in frames["sent"][:2])
    assert set(opening) == {"request_id", "model"} and isinstance(append["append"][0]["data"], bytes), append
    assert "echo is not a voice assistant" in got["notice"], got
    assert got["stats"]["audioPlayed"] >= 5 and got["stats"]["rawOutputs"] >= 10, got
    shown = re.fullmatch(r"call id ([0-9a-f]{24}) · replay it with duplexbus replay ([0-9a-f]{24})", got["replay"])
    assert shown is not None and shown[1] == shown[2], got


async def test_a_denied_microphone_says_what_to_do(stack: Stack) -> None:
    async def run(browser: Browser) -> str:
        context = await browser.new_context()  # no permission granted: the page is refused the microphone
        page = await context.new_page()
        await page.goto(stack.http_url() + "/")
        await page.click("#start")
        await page.wait_for_function("document.body.dataset.state === 'error'", timeout=20_000)
        return await page.inner_text("#error")

    text = await with_browser(["--use-fake-device-for-media-stream"], run)
    assert "Microphone access was denied" in text and "press Start again" in text, text


async def test_an_insecure_origin_says_to_use_localhost(stack: Stack) -> None:
    port = stack.http_url().rsplit(":", 1)[1]

    async def run(browser: Browser) -> str:
        page = await browser.new_page()
        await page.goto(f"http://duplexbus.test:{port}/")  # the same server, under a name that is not secure
        await page.click("#start")
        await page.wait_for_function("document.body.dataset.state === 'error'", timeout=20_000)
        return await page.inner_text("#error")

    text = await with_browser(["--host-resolver-rules=MAP duplexbus.test 127.0.0.1", "--use-fake-device-for-media-stream"], run)
    assert "only to secure pages" in text and f"http://localhost:{port}/" in text, text


def test_the_favicon_is_served(stack: Stack) -> None:
    for path in ("/favicon.ico", "/favicon.svg"):
        with urllib.request.urlopen(stack.http_url() + path, timeout=10) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("image/svg+xml")
            assert r.read().startswith(b"<svg")
