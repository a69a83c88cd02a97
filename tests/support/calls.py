"""Live `echo` calls for fault tests: frames sent as the test goes, every frame checked at the end."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from models.echo import FRAME
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS


class EchoCall:
    """A live `echo` call on a socket of its own: frames sent as the test goes, and at the end
    every frame checked back once, in order, byte-exact (the fault tests' oracle)."""

    def __init__(self, ws: WS, rid: str, frames: int, seed: int) -> None:
        self.ws = ws
        self.rid = rid
        self.samples = ((np.arange(frames * FRAME) * (seed + 1)) % 30011).astype("<i2")
        self.sent = 0

    @classmethod
    async def open(cls, url: str, rid: str, frames: int, seed: int = 0) -> EchoCall:
        call = cls(await WS.connect(url), rid, frames, seed)
        await call.ws.send({"request_id": rid})
        return call

    @property
    def frames(self) -> int:
        return len(self.samples) // FRAME

    async def send(self, upto: int) -> None:
        """Append frames up to `upto` (not past the last), one message each."""
        for k in range(self.sent, min(upto, self.frames)):
            await self.ws.send({"request_id": self.rid, "append": [pcm_file(self.samples[k * FRAME : (k + 1) * FRAME])]})
        self.sent = max(self.sent, min(upto, self.frames))

    async def echoed(self, frame: int, timeout: float = 30.0) -> None:
        """Until frame `frame` has come back (kept for the final check)."""
        await self.ws.until(lambda m: m.get("request_id") == self.rid and "output" in m and m["output"]["frame"] >= frame,
                            timeout=timeout, keep=True)  # fmt: skip

    async def end(self, timeout: float = 60.0) -> dict[str, Any]:
        """Send what is left, end the input: the call's last reply (its finish, or an error)."""
        await self.send(self.frames)
        await self.ws.send({"request_id": self.rid, "end_input": True})
        return await self.ws.final(self.rid, timeout=timeout)

    async def finish(self, timeout: float = 60.0, logs: str = "") -> None:
        """Send what is left, end the input; the call finishes with every frame once, in order."""
        self.check(await self.end(timeout), logs)
        await self.ws.close()

    def check(self, final: dict[str, Any], logs: str = "") -> None:
        """The call finished with every frame once, in order, byte-exact."""
        assert "finish" in final, (self.rid, final, logs)
        outs = self.ws.outputs(self.rid)
        assert [o["frame"] for o in outs] == list(range(self.frames)), (self.rid, logs)
        assert echo_bytes(outs) == self.samples.tobytes(), self.rid


async def stream_for(calls: list[EchoCall], seconds: float, frames_per_s: float = 12.5) -> None:
    """Send every call's frames at about real time (80 ms frames) for `seconds`."""
    start = time.monotonic()
    sent = calls[0].sent if calls else 0
    while (elapsed := time.monotonic() - start) < seconds:
        upto = sent + int(elapsed * frames_per_s) + 1
        for c in calls:
            await c.send(upto)
        await asyncio.sleep(1 / frames_per_s)
