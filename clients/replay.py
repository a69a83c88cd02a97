"""`duplexbus replay CALL`: every message a call put on the bus, read back from the stream (I-3).

CALL is a cid, or a request_id. The request_id index is the stream itself: every call's
`call.{cid}.open` carries its request_id, so a lookup reads the opens (`call.*.open`, one
small message per call in the retention period) and keeps those with that request_id,
oldest first. Nothing else is written on the call path for it, and the index can never
disagree with what the stream still holds: a call whose messages aged out is no longer
listed, and a restart of every process loses nothing (a KV index would be a second store,
with its own retention, written on every call). The live request_id bucket is asked first
by `--follow`, for the call that holds the request_id now.

Output: a timeline table by default (time since the open from the stream's own
timestamps, the gap since the message before, subject kind, partition or edge, seq, a short
summary), `--json` for the raw messages, `--audio DIR` for the input and reply as WAV
files, `--rerun URL` to send the input again with its original pacing and compare the
outputs, `--follow` to watch a live call.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from clients.eval.core import Kind
from clients.stored_call import client_rate, input_items, output_events
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.history import Stored
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError, DuplexError
from shared.sdk.audio import encode_wav

CONNECT_TIMEOUT_S = 5.0  # a CLI command says it cannot reach NATS rather than wait forever
STALL_MS = 500.0  # a gap this long between two messages of a call is marked in the table


@dataclass(frozen=True)
class CallRef:
    cid: str
    request_id: str
    model: str
    opened_ns: int


def decode(s: Stored) -> wire.AnyMsg | None:
    try:
        return wire.decode(s.body)
    except DuplexError:
        return None


async def find_calls(conn: BusConnection, key: str, since: float | None = None) -> list[CallRef]:
    """The calls CALL names: the one whose cid it is, else every call opened under it as a
    request_id (oldest first)."""
    if subjects.is_cid(key):
        async for s in conn.history([subjects.open_(key)]):
            m = decode(s)
            if isinstance(m, wire.Open):
                return [CallRef(m.cid, m.request_id, m.model, s.ts_ns)]
    found = []
    async for s in conn.history([subjects.all_opens()], since=since):
        m = decode(s)
        if isinstance(m, wire.Open) and m.request_id == key:
            found.append(CallRef(m.cid, m.request_id, m.model, s.ts_ns))
    return found


async def live_call(conn: BusConnection, request_id: str) -> str | None:
    """The cid of the live call that holds `request_id` now, if any."""
    try:
        bucket = await conn.bucket(subjects.KV_REQUEST_IDS, create=False)
        entry = await bucket.get(request_id)
    except BusError:
        return None
    return entry.value.decode() if entry is not None and not entry.removed else None


# -- the timeline table -------------------------------------------------------------------------


def _rms(t: wire.Tensor | None) -> float | None:
    if t is None or not t.data or np.dtype(t.dtype).kind not in "iu":
        return None
    x = np.frombuffer(t.data, dtype=np.dtype(t.dtype)).astype(np.float64)
    return float(np.sqrt(np.dot(x, x) / len(x))) if len(x) else 0.0


def _item(item: wire.WireItem) -> str:
    t = item.data
    parts = [f"{len(t.data)} B {'x'.join(map(str, t.shape))} {t.dtype}"] if t is not None else ["no data"]
    rms = item.meta.get("rms") if isinstance(item.meta.get("rms"), float | int) else _rms(t)
    if rms is not None:
        parts.append(f"rms {rms:.0f}")
    extra = {k: v for k, v in item.meta.items() if k != "rms"}
    if extra:
        parts.append(json.dumps(extra, default=str)[:80])
    return ", ".join(parts)


def _output(msg: wire.OutputMsg) -> str:
    try:
        o = json.loads(msg.event_json())  # a packed one (its client read msgpack) as JSON
    except (ValueError, DuplexError):
        return f"{len(msg.json)} B (not {'msgpack' if msg.packed else 'JSON'})"
    if not isinstance(o, dict):
        return str(o)[:80]
    parts = []
    if "type" in o:
        parts.append(str(o["type"]))
    if isinstance(o.get("audio"), str):
        b64: str = o["audio"]
        parts.append(f"audio {len(b64) * 3 // 4 - b64[-2:].count('=')} B")
    if isinstance(o.get("rms"), float | int):
        parts.append(f"rms {o['rms']:.0f}")
    if o.get("text"):
        parts.append(repr(str(o["text"])[:60]))
    rest = {k: v for k, v in o.items() if k not in ("type", "audio", "rms", "text")}
    if rest:
        parts.append(json.dumps(rest, default=str)[:80])
    return ", ".join(parts)


def describe(msg: wire.AnyMsg | None) -> tuple[str, str, str]:
    """(partition or edge, seq, summary) of one message."""
    match msg:
        case wire.InputItem(seq=seq, item=item) | wire.EdgeItemMsg(seq=seq, item=item):
            return "", str(seq), _item(item)
        case wire.EndOfInput(total=n) | wire.EdgeEnd(total=n):
            return "", "", f"total {n}"
        case wire.OutputMsg():
            return msg.partition, str(msg.seq), _output(msg)
        case wire.Open():
            streams = ",".join(msg.open_streams) or "-"
            return "", "", f"request_id {msg.request_id}, model {msg.model}, open streams {streams}, live {msg.live}"
        case wire.Done():
            return msg.partition, "", f"{msg.outputs} outputs, worker {msg.worker_id}, usage {json.dumps(msg.usage)}"
        case wire.Fin():
            err = f", error {msg.error}" if msg.error else ""
            return "", "", f"{msg.status} {msg.reason}{err}, outputs {json.dumps(msg.outputs)}"
        case wire.Abort():
            return "", "", f"{msg.status} {msg.reason}"
        case wire.Placed():
            return ",".join(msg.partitions), "", f"worker {msg.worker_id}"
        case None:
            return "", "", "(undecodable)"
    return "", "", type(msg).__name__


class Table:
    """Rows of the timeline, one per message, as they come (so --follow prints the same)."""

    HEADER = f"{'t ms':>10} {'gap ms':>8}  {'kind':<8} {'part/edge':<12} {'seq':>6}  summary"

    def __init__(self, t0_ns: int | None = None, stall_ms: float = STALL_MS) -> None:
        self.t0 = t0_ns
        self.prev: int | None = None
        self.stall_ms = stall_ms

    def row(self, s: Stored, msg: wire.AnyMsg | None) -> str:
        if self.t0 is None:
            self.t0 = s.ts_ns
        gap = (s.ts_ns - self.prev) / 1e6 if self.prev is not None else 0.0
        self.prev = s.ts_ns
        cs = subjects.parse(s.subject)
        part, seq, summary = describe(msg)
        mark = "  <-- stall" if gap >= self.stall_ms else ""
        t = (s.ts_ns - self.t0) / 1e6
        return f"{t:>10.1f} {gap:>8.1f}  {cs.kind:<8} {(part or cs.edge or ''):<12} {seq:>6}  {summary}{mark}"


def raw(s: Stored, msg: wire.AnyMsg | None) -> str:
    """`--json`: the message itself, with tensors and audio shortened."""
    if msg is None:
        return json.dumps({"subject": s.subject, "undecodable": len(s.body)})
    d: dict[str, Any] = msgspec.to_builtins(msg)
    item = d.get("item")
    if isinstance(item, dict) and isinstance(item.get("data"), dict):
        t = item["data"]
        item["data"] = {"dtype": t["dtype"], "shape": t["shape"]}
    if isinstance(msg, wire.OutputMsg):
        data = json.loads(msg.event_json())
        if isinstance(data, dict) and isinstance(data.get("audio"), str):
            data["audio"] = f"<{len(data['audio'])} b64 chars>"
        d["json"] = data
    return json.dumps({"subject": s.subject, **d}, default=str)


# -- audio ----------------------------------------------------------------------------------------


def write_audio(folder: Path, model: str, msgs: list[tuple[Stored, wire.AnyMsg | None]]) -> list[Path]:
    """input.{stream}.wav for each client stream, reply.wav of the reply audio."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    streams = input_items(msgs)
    for edge, items in streams.items():
        path = folder / f"input.{edge}.wav"
        path.write_bytes(encode_wav(np.frombuffer(b"".join(b for _, _, b in items), "<i2"), client_rate(model, edge)))
        written.append(path)
    audio = [ev for ev in output_events(msgs, client_rate(model, next(iter(streams), ""))) if ev.kind is Kind.REPLY_AUDIO]
    if audio:
        path = folder / "reply.wav"
        path.write_bytes(encode_wav(np.frombuffer(b"".join(ev.audio for ev in audio), "<i2"), audio[0].rate))
        written.append(path)
    return written


# -- the command ----------------------------------------------------------------------------------


async def read_call(conn: BusConnection, cid: str, follow: bool = False) -> AsyncIterator[tuple[Stored, wire.AnyMsg | None]]:
    """Every stored message of the call, oldest first; with `follow`, until its fin or abort."""
    async for s in conn.history([subjects.call_all(cid)], follow=follow):
        m = decode(s)
        yield s, m
        if follow and isinstance(m, wire.Fin | wire.Abort):
            return


def _choose(refs: list[CallRef], key: str, out: Callable[[str], None]) -> tuple[CallRef | None, int]:
    """The one call named, or (None, exit status) after saying why there is none or listing them all."""
    if len(refs) == 1:
        return refs[0], 0
    if not refs:
        out(f"no call with cid or request_id {key!r} in {subjects.STREAM}")
        return None, 1
    out(f"{len(refs)} calls with request_id {key!r} (oldest first); replay one by its cid:")
    for r in refs:
        out(f"  {r.cid}  opened {_utc(r.opened_ns)}  model {r.model}")
    return None, 0


def _utc(ns: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


async def run_replay(args: argparse.Namespace, cfg: ServingConfig) -> int:
    conn = await BusConnection.open(cfg, "duplexbus-replay", stream=False, connect_timeout=CONNECT_TIMEOUT_S)
    try:
        return await _replay(conn, args)
    finally:
        await conn.close()


async def _replay(conn: BusConnection, args: argparse.Namespace) -> int:
    write = sys.stdout.write
    key: str = args.call
    cid = await live_call(conn, key) if args.follow and not subjects.is_cid(key) else None
    ref: CallRef | None = None
    if cid is None:
        ref, status = _choose(await find_calls(conn, key), key, print)
        if ref is None:
            return status
        cid = ref.cid
    if args.follow:
        # Times count from the call's open, as in the whole table (items published with the
        # opening are stored before it): the first row seen is not the open then.
        refs = [ref] if ref is not None else await find_calls(conn, cid)
        table = Table(refs[0].opened_ns if refs else None)
        if not args.json:
            write(f"call {cid} (following)\n{Table.HEADER}\n")
        async for s, m in read_call(conn, cid, follow=True):
            write((raw(s, m) if args.json else table.row(s, m)) + "\n")
            sys.stdout.flush()
        return 0
    msgs = [sm async for sm in read_call(conn, cid)]
    if not msgs:
        print(f"no messages for call {cid} in {subjects.STREAM}")
        return 1
    if args.json:
        write("".join(raw(s, m) + "\n" for s, m in msgs))
    elif not args.rerun:
        write(timeline(cid, msgs))
    model = next((m.model for _, m in msgs if isinstance(m, wire.Open)), "")
    if args.audio:
        for p in write_audio(Path(args.audio), model, msgs):
            print(f"wrote {p}", file=sys.stderr)
    if args.rerun:
        from clients.replay_rerun import rerun

        return await rerun(args.rerun, model, msgs)
    return 0


def timeline(cid: str, msgs: list[tuple[Stored, wire.AnyMsg | None]]) -> str:
    """The whole table: times count from the call's open (items published with the opening come before it)."""
    t0 = next((s.ts_ns for s, m in msgs if isinstance(m, wire.Open)), msgs[0][0].ts_ns)
    table = Table(t0)
    lines = [f"call {cid}: {len(msgs)} messages, opened {_utc(t0)}", Table.HEADER]
    lines += [table.row(s, m) for s, m in msgs]
    return "\n".join(lines) + "\n"


def add_arguments(rp: argparse.ArgumentParser) -> None:
    rp.add_argument("call", metavar="CALL", help="the call's id (the finish's call_id), or its request_id")
    rp.add_argument("--json", action="store_true", help="one JSON line per message (the raw form) instead of the timeline")
    rp.add_argument(
        "--audio", metavar="DIR", help="write the call's input (input.STREAM.wav) and reply audio (reply.wav) into DIR"
    )
    rp.add_argument(
        "--rerun",
        metavar="URL",
        help="send the call's input again to a deployment's /generate/ws with its original pacing; report how the outputs differ",
    )
    rp.add_argument("--follow", action="store_true", help="tail a live call as it happens, until it ends")
