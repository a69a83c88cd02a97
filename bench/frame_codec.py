"""The frontend's CPU per append, JSON text frames against msgpack binary frames.

A live call sends an append of 80 ms of 16 kHz audio (2,560 bytes of PCM16) and gets one
echo output back. What the two encodings change on the frontend is timed here, each stage
alone, in-process (no sockets, no bus): the client's frame unmasked, a text frame's UTF-8
decoded, the message parsed (`protocol.parse_frame`); the output's bus message decoded and
its event spliced into the reply (`RelayedCall.relay_output`, through the socket's
`Outbox`), the reply framed. The stages both encodings share (framing into items, the bus
publish, the read loop) are not here: `bench/live_load.py` measures the whole.

Beside the frontend: the worker's side (the event encoded as its client reads it), the
frontend's conversion for an output of a worker before wire 1.3 (JSON, into a msgpack call),
and an ordinary Python client's own (stdlib json and base64, against msgspec's msgpack).

Each figure is CPU time per operation (`time.process_time_ns`), the best of `--repeats`
runs of `--n` operations: the least disturbed by other processes on a shared machine.

    .venv/bin/python -m bench.frame_codec
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
from websockets.frames import Frame, Opcode

from bench.machine import machine
from models.echo import EchoModel
from services.frontend.calls import CallInput
from services.frontend.outbox import Outbox
from services.frontend.protocol import parse_frame
from services.frontend.relayed_call import RelayedCall
from shared.bus import wire

try:
    from websockets.speedups import apply_mask
except ImportError:  # websockets without its C extension
    from websockets.utils import apply_mask

SAMPLES = 1280  # 80 ms at 16 kHz
RID = "call-000123"


class NullOutlet:
    """A connection that takes every frame and does nothing with it."""

    on_room: Callable[[], None] | None = None

    def send_now(self, payload: bytes, binary: bool = False) -> None:
        pass

    def has_room(self) -> bool:
        return True


def per_op_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time_ns() - t0) / n)
    return best / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="operations per run")
    ap.add_argument("--repeats", type=int, default=7, help="runs; the best is reported")
    args = ap.parse_args()
    n, repeats = args.n, args.repeats

    pcm = np.random.default_rng(0).integers(-20000, 20000, SAMPLES).astype("<i2").tobytes()
    event = {"frame": 12, "audio": base64.b64encode(pcm).decode(), "rms": 2118.7643533805854}
    mask = os.urandom(4)
    fields = EchoModel.binary_fields

    def call(binary: bool) -> RelayedCall:
        inp = CallInput(EchoModel(), {"audio_in": None}, 1 << 30, 0.0)
        return RelayedCall("cid", RID, inp, Outbox(NullOutlet()), True, binary=binary, binary_fields=fields)

    rows: list[tuple[str, float, float]] = []  # stage, JSON µs, msgpack µs
    sizes: dict[str, tuple[int, int]] = {}

    def both(stage: str, json_fn: Callable[[], Any], packed_fn: Callable[[], Any]) -> None:
        rows.append((stage, per_op_us(json_fn, n, repeats), per_op_us(packed_fn, n, repeats)))

    # -- in: the append ----------------------------------------------------------------
    text = json.dumps({"request_id": RID, "append": [{"name": "mic.pcm", "data": event["audio"]}]}).encode()
    packed = msgspec.msgpack.encode({"request_id": RID, "append": [{"name": "mic.pcm", "data": pcm}]})
    sizes["append"] = (len(text), len(packed))
    masked_text, masked_packed = apply_mask(text, mask), apply_mask(packed, mask)
    both("unmask the frame", lambda: apply_mask(masked_text, mask), lambda: apply_mask(masked_packed, mask))
    text_str = text.decode()
    both("text frame to str (UTF-8)", lambda: text.decode(), lambda: None)
    both("parse the append", lambda: parse_frame(text_str), lambda: parse_frame(packed))

    # -- out: the echo output ------------------------------------------------------------
    json_out = wire.encode(wire.OutputMsg(partition="p", seq=0, json=msgspec.json.encode(event)))
    packed_out = wire.encode(wire.OutputMsg(partition="p", seq=0, json=wire.pack_event(event, fields), packed=True))
    json_call, packed_call = call(False), call(True)

    def relay(c: RelayedCall, body: bytes) -> None:
        c.relay_output(c.event_body(wire.decode_as(body, wire.OutputMsg)))

    both("relay the output", lambda: relay(json_call, json_out), lambda: relay(packed_call, packed_out))
    json_reply = b'{"request_id":"' + RID.encode() + b'","output":' + msgspec.json.encode(event) + b"}"
    packed_reply = msgspec.msgpack.encode({"request_id": RID, "output": {**event, "audio": pcm}})
    sizes["output"] = (len(json_reply), len(packed_reply))
    both(
        "frame the reply",
        lambda: Frame(Opcode.TEXT, json_reply).serialize(mask=False),
        lambda: Frame(Opcode.BINARY, packed_reply).serialize(mask=False),
    )
    frontend = [sum(r[1] for r in rows), sum(r[2] for r in rows)]

    # -- elsewhere -------------------------------------------------------------------------
    old_worker = wire.encode(wire.OutputMsg(partition="p", seq=0, json=msgspec.json.encode(event)))
    mixed = per_op_us(lambda: relay(packed_call, old_worker), n, repeats)
    worker = (
        per_op_us(lambda: msgspec.json.encode(event), n, repeats),
        per_op_us(lambda: wire.pack_event(event, fields), n, repeats),
    )

    def client_json() -> None:
        body = {"request_id": RID, "append": [{"name": "mic.pcm", "data": base64.b64encode(pcm).decode()}]}
        json.dumps(body)
        base64.b64decode(json.loads(json_reply)["output"]["audio"])

    def client_packed() -> None:
        msgspec.msgpack.encode({"request_id": RID, "append": [{"name": "mic.pcm", "data": pcm}]})
        msgspec.msgpack.decode(packed_reply)["output"]["audio"]

    client = (per_op_us(client_json, n, repeats), per_op_us(client_packed, n, repeats))

    print(f"machine: {machine()}")
    print(f"append of {SAMPLES} samples; best of {repeats} runs of {n}; CPU µs per operation\n")
    print("| stage | JSON µs | msgpack µs |\n|---|---|---|")
    for stage, j, p in rows:
        print(f"| {stage} | {j:.2f} | {p:.2f} |")
    print(f"| **frontend, these stages** | **{frontend[0]:.2f}** | **{frontend[1]:.2f}** |")
    print(f"| worker: encode the event | {worker[0]:.2f} | {worker[1]:.2f} |")
    print(f"| a Python client: append out, output in (json+base64; msgpack) | {client[0]:.2f} | {client[1]:.2f} |")
    print(
        f"\nframe bytes: append {sizes['append'][0]} JSON, {sizes['append'][1]} msgpack; "
        f"output {sizes['output'][0]} JSON, {sizes['output'][1]} msgpack"
    )
    print(f"an output of a worker before wire 1.3 relayed to a msgpack call (converted here): {mixed:.2f} µs")
    try:  # the msgpack package is no dependency: compared where it is installed
        unpackb = importlib.import_module("msgpack").unpackb
    except ImportError:
        return
    plain = per_op_us(lambda: unpackb(packed), n, repeats)
    typed = per_op_us(lambda: msgspec.msgpack.decode(packed), n, repeats)
    print(f"decoding the append alone: msgpack package {plain:.2f} µs, msgspec {typed:.2f} µs (no checks either)")


if __name__ == "__main__":
    main()
