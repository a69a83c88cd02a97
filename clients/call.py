"""`duplexbus call FILE.wav`: stream a WAV as a live call, print what comes back.

Sends the file in appends of `--append-ms` (80 ms by default) paced in real time
(or as fast as possible with --fast), ends the input, waits for the finish and
writes the reply audio (outputs carrying "audio") to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from shared.sdk.audio import WAV_ERRORS, b64_pcm16, encode_wav, pcm16_from_b64, pcm16_mono_mismatch
from shared.sdk.audio import read_wav as parse_wav

# Appends go as raw PCM (`chunk.pcm`), which the models read at their own rate:
# 16 kHz mono 16-bit for every built-in model. A file at another rate would play
# at the wrong speed, so it is refused rather than sent.
SAMPLE_RATE = 16_000


def read_wav(path: str, rate: int | None = SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """Samples and rate of a mono 16-bit WAV at `rate` (any rate where None); SystemExit with
    the reason otherwise."""
    try:
        channels, width, got, frames = parse_wav(Path(path).read_bytes())
    except OSError as e:
        raise SystemExit(f"{path}: cannot read: {e}") from None
    except WAV_ERRORS as e:
        raise SystemExit(f"{path}: not a readable WAV file: {e}") from None
    wrong = pcm16_mono_mismatch(channels, width, got, rate or got)
    if wrong:
        hint = "; resample it first" if rate and got != rate else ""
        raise SystemExit(f"{path}: expected {wrong}{hint}")
    return np.frombuffer(frames, dtype="<i2"), got


def pcm_file(samples: np.ndarray) -> dict[str, str]:
    return {"name": "chunk.pcm", "data": b64_pcm16(samples)}


async def stream_call(
    url: str,
    samples: np.ndarray,
    rate: int,
    append_ms: int = 80,
    fast: bool = False,
    model: str | None = None,
    request_id: str | None = None,
    on_message: Any = None,
) -> dict[str, Any]:
    """One live call over its own socket; returns outputs, the final message and timings."""
    rid = request_id or f"call-{secrets.token_hex(4)}"
    step = max(1, rate * append_ms // 1000)
    outputs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"request_id": rid, "outputs": outputs, "final": None, "append_errors": []}
    async with websockets.connect(url, max_size=None) as ws:

        async def send() -> None:
            opening: dict[str, Any] = {"request_id": rid}
            if model:
                opening["model"] = model
            await ws.send(json.dumps(opening))
            t0 = time.monotonic()
            for i, start in enumerate(range(0, len(samples), step)):
                await ws.send(json.dumps({"request_id": rid, "append": [pcm_file(samples[start : start + step])]}))
                if not fast:
                    await asyncio.sleep(max(0.0, t0 + (i + 1) * append_ms / 1000 - time.monotonic()))
            await ws.send(json.dumps({"request_id": rid, "end_input": True}))

        sender = asyncio.create_task(send())
        try:
            async for raw in ws:
                msg = json.loads(raw)
                if on_message is not None:
                    on_message(msg)
                if "output" in msg:
                    outputs.append(msg["output"])
                elif msg.get("append"):
                    result["append_errors"].append(msg)
                elif "finish" in msg or "error" in msg:
                    result["final"] = msg
                    break
        finally:
            sender.cancel()
    return result


def reply_audio(outputs: list[dict[str, Any]]) -> tuple[np.ndarray, int]:
    chunks, rate = [], 16_000
    for o in outputs:
        if "audio" in o:
            chunks.append(pcm16_from_b64(o["audio"]))
            rate = int(o.get("sample_rate", rate))
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype="<i2")), rate


async def run_call(args: argparse.Namespace) -> int:
    samples, rate = read_wav(args.file)

    def show(msg: dict[str, Any]) -> None:
        if args.quiet:
            return
        if "output" in msg:
            o = {k: (f"<{len(v)} b64 chars>" if k == "audio" else v) for k, v in msg["output"].items()}
            print(json.dumps({"output": o}))
        else:
            print(json.dumps(msg))

    result = await stream_call(args.url, samples, rate, args.append_ms, args.fast, args.model, args.request_id, show)
    audio, out_rate = reply_audio(result["outputs"])
    if len(audio):
        Path(args.out).write_bytes(encode_wav(audio, out_rate))
        print(f"reply audio: {len(audio) / out_rate:.2f}s written to {args.out}", file=sys.stderr)
    final = result["final"] or {}
    print(f"{len(result['outputs'])} outputs; final: {json.dumps(final)}", file=sys.stderr)
    return 0 if "finish" in final else 1
