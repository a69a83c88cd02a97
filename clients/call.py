"""`duplexbus call FILE.wav`: stream a WAV as a live call, print what comes back.

Sends the file in appends of `--append-ms` (80 ms by default) paced in real time
(or as fast as possible with --fast), ends the input, waits for the finish and
writes the reply audio (outputs carrying "audio") to `--out`. Messages go in msgpack
(binary frames: audio as raw bytes both ways, no base64 to encode or decode), or with
`--json` as JSON text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import websockets

from shared.sdk.audio import b64_pcm16, encode_wav, pcm16_from_b64, resample_pcm16

# Appends go as raw PCM (`chunk.pcm`), which the models read at their own rate: 16 kHz mono
# 16-bit for every built-in model. A file at another rate, width or channel count is
# converted first (downmixed, resampled with soxr), and the command says so.
SAMPLE_RATE = 16_000


def read_wav(path: str, rate: int | None = SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """Mono PCM16 samples from any WAV soundfile reads, at `rate` (its own rate where None),
    and that rate; SystemExit with the reason where it cannot."""
    import soundfile

    if not os.path.isfile(path):  # (libsndfile says only "System error")
        raise SystemExit(f"{path}: no such file")
    try:
        data, got = soundfile.read(path, dtype="float32", always_2d=True)
    except (OSError, RuntimeError, soundfile.LibsndfileError) as e:
        raise SystemExit(f"{path}: cannot read it as audio: {e}") from None
    channels = data.shape[1]
    mono = data.mean(axis=1) if channels > 1 else data[:, 0]
    samples = np.clip(np.round(mono * 32768.0), -32768, 32767).astype("<i2")
    want = rate or got
    if channels > 1 or got != want:
        what = [f"{channels} channels to 1"] if channels > 1 else []
        what += [f"{got} Hz to {want} Hz"] if got != want else []
        print(f"{path}: converting {' and '.join(what)}", file=sys.stderr)
        samples = resample_pcm16(samples, got, want)
    return samples, want


def pcm_file(samples: np.ndarray, binary: bool = False) -> dict[str, Any]:
    """One append's file: raw PCM16, as bytes (msgpack) or base64 text (JSON)."""
    if binary:
        return {"name": "chunk.pcm", "data": np.asarray(samples, dtype="<i2").tobytes()}
    return {"name": "chunk.pcm", "data": b64_pcm16(samples)}


def decode(frame: str | bytes) -> dict[str, Any]:
    """A server message: a binary frame's is msgpack, a text frame's JSON."""
    msg: dict[str, Any] = msgspec.msgpack.decode(frame) if isinstance(frame, bytes) else json.loads(frame)
    return msg


# A --fast upload runs ahead of the server by all that the two sockets buffer, minutes of
# audio on one machine, and the server takes it at the model's and the bus's pace. A
# WebSocket ping waits behind all of it: twenty uploads at once on a busy machine had pongs
# later than the library's 20 s keepalive, and the calls were closed (1011) while the server
# worked through them. So a fast call judges the server by progress instead: it is alive
# while it takes what is sent or sends something back.
STALL_S = 60.0
PING_S = 20.0  # the keepalive's ping interval, and its timeout where the call is paced


class Stalled(Exception):
    """The server took nothing and sent nothing for STALL_S during a --fast call."""


async def stream_call(
    url: str,
    samples: np.ndarray,
    rate: int,
    append_ms: int = 80,
    fast: bool = False,
    model: str | None = None,
    request_id: str | None = None,
    on_message: Any = None,
    binary: bool = True,
) -> dict[str, Any]:
    """One live call over its own socket, in msgpack (`binary`) or JSON; returns outputs,
    the final message and timings."""
    encode: Any = msgspec.msgpack.encode if binary else json.dumps
    rid = request_id or f"call-{secrets.token_hex(4)}"
    step = max(1, rate * append_ms // 1000)
    outputs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"request_id": rid, "outputs": outputs, "final": None, "append_errors": []}
    progress = time.monotonic()  # when the server last took an append or sent a message
    async with websockets.connect(url, max_size=None, ping_interval=PING_S, ping_timeout=None if fast else PING_S) as ws:

        async def send() -> None:
            nonlocal progress
            opening: dict[str, Any] = {"request_id": rid}
            if model:
                opening["model"] = model
            await ws.send(encode(opening))
            t0 = time.monotonic()
            for i, start in enumerate(range(0, len(samples), step)):
                await ws.send(encode({"request_id": rid, "append": [pcm_file(samples[start : start + step], binary)]}))
                progress = time.monotonic()
                if not fast:
                    await asyncio.sleep(max(0.0, t0 + (i + 1) * append_ms / 1000 - time.monotonic()))
            await ws.send(encode({"request_id": rid, "end_input": True}))

        async def receive() -> str | bytes:
            if not fast:
                return await ws.recv()
            while True:
                try:
                    return await asyncio.wait_for(ws.recv(), timeout=1.0)  # recv may be cancelled safely
                except TimeoutError:
                    if time.monotonic() - progress > STALL_S:
                        raise Stalled(f"the server took nothing and sent nothing for {STALL_S:.0f} s") from None

        sender = asyncio.create_task(send())
        try:
            while True:
                try:
                    msg = decode(await receive())
                except websockets.ConnectionClosedOK:
                    break
                progress = time.monotonic()
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


def _short(audio: object) -> str:
    return f"<{len(audio)} bytes>" if isinstance(audio, bytes) else f"<{len(str(audio))} b64 chars>"


def reply_audio(outputs: list[dict[str, Any]]) -> tuple[np.ndarray, int]:
    chunks, rate = [], 16_000
    for o in outputs:
        if "audio" in o:
            audio = o["audio"]  # bytes in msgpack, base64 text in JSON
            chunks.append(np.frombuffer(audio, dtype="<i2") if isinstance(audio, bytes) else pcm16_from_b64(audio))
            rate = int(o.get("sample_rate", rate))
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype="<i2")), rate


async def run_call(args: argparse.Namespace) -> int:
    samples, rate = read_wav(args.file)

    def show(msg: dict[str, Any]) -> None:
        if args.quiet:
            return
        if "output" in msg:
            o = {k: (_short(v) if k == "audio" else v) for k, v in msg["output"].items()}
            print(json.dumps({"output": o}))
        else:
            print(json.dumps(msg))

    try:
        result = await stream_call(
            args.url, samples, rate, args.append_ms, args.fast, args.model, args.request_id, show, not args.json
        )
    except (OSError, websockets.InvalidHandshake, websockets.ConnectionClosedError) as e:
        print(f"error: cannot talk to {args.url}: {e or type(e).__name__} (is duplexbus up running?)", file=sys.stderr)
        return 1
    except Stalled as e:
        print(f"error: {args.url}: {e}", file=sys.stderr)
        return 1
    audio, out_rate = reply_audio(result["outputs"])
    if len(audio):
        Path(args.out).write_bytes(encode_wav(audio, out_rate))
        print(f"reply audio: {len(audio) / out_rate:.2f}s written to {args.out}", file=sys.stderr)
    final = result["final"] or {}
    print(f"{len(result['outputs'])} outputs; final: {json.dumps(final)}", file=sys.stderr)
    return 0 if "finish" in final else 1
