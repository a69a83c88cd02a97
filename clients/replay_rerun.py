"""`duplexbus replay CALL --rerun URL`: the call's input sent again to a deployment, with the
pacing the stream recorded, through `duplexbus eval`'s runner (every wait bounded), and the
new outputs compared with the recorded ones. For `echo` they are identical."""

from __future__ import annotations

import numpy as np

from clients.eval.core import Event, Kind
from clients.eval.runner import Options, Sample, run_sample
from clients.stored_call import client_rate, input_items, output_events
from shared.bus import wire
from shared.bus.history import Stored

COMPARED = frozenset({Kind.REPLY_START, Kind.REPLY_TEXT, Kind.REPLY_END, Kind.LISTEN, Kind.TRANSCRIPT, Kind.OTHER})


def differences(before: list[Event], after: list[Event]) -> list[str]:
    """What differs between two calls' outputs: the reply audio byte for byte, then the other
    outputs (their names and texts) in order."""
    out = []
    a = b"".join(e.audio for e in before if e.kind is Kind.REPLY_AUDIO)
    b = b"".join(e.audio for e in after if e.kind is Kind.REPLY_AUDIO)
    if a != b:
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), n)
        out.append(f"reply audio differs from byte {first} (recorded {len(a)} bytes, rerun {len(b)})")
    ta = [(e.name, e.text) for e in before if e.kind in COMPARED]
    tb = [(e.name, e.text) for e in after if e.kind in COMPARED]
    for i, (x, y) in enumerate(zip(ta, tb, strict=False)):
        if x != y:
            out.append(f"output {i} differs: recorded {x[0]} {x[1]!r}, rerun {y[0]} {y[1]!r}")
            break
    if len(ta) != len(tb):
        out.append(f"{len(ta)} other outputs recorded, {len(tb)} in the rerun")
    return out


async def rerun(url: str, model: str, msgs: list[tuple[Stored, wire.AnyMsg | None]]) -> int:
    streams = input_items(msgs)
    if len(streams) != 1:
        print(f"--rerun sends one client stream; this call has {len(streams)}: {', '.join(streams) or 'none'}")
        return 2
    edge, items = next(iter(streams.items()))
    rate = client_rate(model, edge)
    opened = next((s.ts_ns for s, m in msgs if isinstance(m, wire.Open)), items[0][1])
    t0 = min(opened, items[0][1])
    plan = [((ts - t0) / 1e9, pcm) for _, ts, pcm in items]
    pcm = np.frombuffer(b"".join(p for _, p in plan), "<i2")
    o = await run_sample(Sample("rerun", pcm, rate, schedule=plan), Options(url=url, model=model))
    print(f"rerun of {len(items)} items ({len(pcm) / rate:.2f} s of {edge}, {plan[-1][0]:.2f} s as recorded) against {url}")
    if not o.ok:
        assert o.error is not None
        print(f"the rerun failed at {o.error.stage.value} ({o.error.failure.value}): {o.error.detail}")
        return 1
    after = [ev for _, ev in o.attempt.events if ev.kind is Kind.REPLY_AUDIO or ev.kind in COMPARED]
    before = output_events(msgs, rate)
    print(f"new call {o.attempt.proto.call_id}: {len(after)} outputs (recorded: {len(before)})")
    diff = differences(before, after)
    for line in diff:
        print(f"  {line}")
    print("identical" if not diff else "different")
    return 0 if not diff else 1
