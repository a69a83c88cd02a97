"""What an eval leaves behind: one JSONL record per sample (written as it ends), its reply
audio, the summary (JSON and a table) and PNG plots."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from clients.eval.core import Stage, figures
from clients.eval.extra import needed
from clients.eval.metrics import echo_exact, word_error_rate
from clients.eval.runner import Outcome
from shared.runtime.stats import percentile
from shared.sdk.audio import encode_wav


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def record(o: Outcome, expect_echo: bool = False) -> dict[str, Any]:
    """The JSONL record of a sample: failures too, with their stage, reason and retries."""
    att, t = o.attempt, o.attempt.timeline
    f = figures(t)
    reply, rate = att.reply_audio()
    hyp_source = "transcript" if att.transcript() else "reply_text"
    hyp = att.transcript() or att.reply_text()
    rec: dict[str, Any] = {
        "sample": o.sample.name,
        "ok": o.ok,
        "stage": Stage.DONE.value if o.ok else (o.error.stage.value if o.error else None),
        "reason": None if o.ok else (o.error.failure.value if o.error else None),
        "detail": o.error.detail if o.error else None,
        "retries": o.retries,
        "retried": o.earlier,
        "call_id": att.proto.call_id or getattr(att.proto, "request_id", ""),
        "clip_s": _r(o.sample.duration_s),
        "stage_s": {k: _r(v) for k, v in t.stage_took.items()},
        "ttfa_s": _r(f.ttfa_s),
        "reply_latency_s": _r(f.reply_latency_s),
        "reply_audio_s": _r(f.reply_audio_s),
        "reply_rate": rate if len(reply) else None,
        "rtf": _r(f.rtf),
        "gap_p95_s": _r(percentile(f.gaps_s, 95)),
        "gap_max_s": _r(max(f.gaps_s) if f.gaps_s else None),
        "end_of_turn_s": _r(f.end_of_turn_s),
        "transcript_s": _r(f.transcript_s),
        "first_audio_s": _r(f.first_audio_s),
        "padding_appends": t.padding_appends,
        "replied": t.first_reply_at is not None,
        "listen_acks": t.listen_acks,
        "reference": o.sample.reference,
        "hypothesis": hyp,
        "hypothesis_source": hyp_source,
        "reply_text": att.reply_text(),
        "wer": None,
        "timeline": _timeline(o),
    }
    if o.ok and o.error is not None:
        rec["note"] = f"published as completed: {o.error.detail} after a completed reply"
    if o.error is not None and o.error.trace:
        rec["traceback"] = o.error.trace
    if o.sample.reference is not None and o.ok and not expect_echo:  # echo's quality is byte-exactness
        rec["wer"] = _r(word_error_rate([o.sample.reference], [hyp])[0])
    if expect_echo:
        rec["echo_exact"] = o.ok and echo_exact(o.sample.pcm, reply)
    return rec


def _timeline(o: Outcome) -> dict[str, Any]:
    """Seconds since the sample's connection opened: stage starts, reply audio arrivals (for the plots)."""
    t = o.attempt.timeline
    return {
        "stages": {k: _r(v - t.opened) for k, v in t.stage_started.items()},
        "input_ended": _r(t.input_ended - t.opened) if t.input_ended is not None else None,
        "audio_at": [_r(a - t.opened) for a in t.audio_at],
    }


def write_sample(out: Path, o: Outcome, rec: dict[str, Any]) -> None:
    """Append the record to results.jsonl (flushed: a completed sample is never lost) and write its reply audio."""
    reply, rate = o.attempt.reply_audio()
    if len(reply):
        audio_dir = out / "audio"
        audio_dir.mkdir(parents=True, exist_ok=True)
        path = audio_dir / f"{_safe(o.sample.name)}.reply.wav"
        path.write_bytes(encode_wav(reply, rate))
        rec["reply_wav"] = str(path.relative_to(out))
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    failed = Counter(f"{r['stage']}: {r['reason']}" for r in records if not r["ok"])

    def pct(key: str, p: float) -> float | None:
        return _r(percentile([r[key] for r in ok if r.get(key) is not None], p))

    gaps = [r["gap_p95_s"] for r in ok if r["gap_p95_s"] is not None]
    scored = [r for r in ok if r["wer"] is not None]  # a reference, and not an echo check
    wer, errors, words = word_error_rate([r["reference"] for r in scored], [r["hypothesis"] for r in scored])
    out: dict[str, Any] = {
        "samples": len(records),
        "ok": len(ok),
        "failed": sum(failed.values()),
        "failed_by_reason": dict(failed),
        "retried": sum(1 for r in records if r["retries"]),
        "no_reply": sum(1 for r in ok if not r["replied"]),
        "ttfa_p50_s": pct("ttfa_s", 50),
        "ttfa_p95_s": pct("ttfa_s", 95),
        "reply_latency_p50_s": pct("reply_latency_s", 50),
        "reply_latency_p95_s": pct("reply_latency_s", 95),
        "end_of_turn_p50_s": pct("end_of_turn_s", 50),
        "transcript_p50_s": pct("transcript_s", 50),
        "first_audio_p50_s": pct("first_audio_s", 50),
        "first_audio_p95_s": pct("first_audio_s", 95),
        "rtf_p50": pct("rtf", 50),
        "rtf_p95": pct("rtf", 95),
        "gap_p95_s": _r(percentile(gaps, 95)),
        "wer": _r(wer) if words else None,
        "wer_words": words,
        "wer_errors": errors,
    }
    if any("echo_exact" in r for r in records):
        out["echo_exact"] = sum(1 for r in records if r.get("echo_exact"))
    return out


_LABELS = [
    ("samples", "samples"),
    ("ok", "ok"),
    ("failed", "failed"),
    ("retried", "retried once"),
    ("no_reply", "ok with no reply (listening only)"),
    ("ttfa_p50_s", "time to first audio after end of input p50 (s)"),
    ("ttfa_p95_s", "time to first audio after end of input p95 (s)"),
    ("reply_latency_p50_s", "reply latency p50 (s)"),
    ("reply_latency_p95_s", "reply latency p95 (s)"),
    ("end_of_turn_p50_s", "end of speech to the turn decided p50 (s)"),
    ("transcript_p50_s", "turn decided to final transcript p50 (s)"),
    ("first_audio_p50_s", "end of speech to first reply audio p50 (s)"),
    ("first_audio_p95_s", "end of speech to first reply audio p95 (s)"),
    ("rtf_p50", "real-time factor p50"),
    ("rtf_p95", "real-time factor p95"),
    ("gap_p95_s", "gap between reply chunks p95 (s)"),
    ("wer", "word error rate"),
    ("echo_exact", "echo byte-exact"),
]


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label in _LABELS:
        if key not in summary:
            continue
        v = summary[key]
        if key == "wer" and v is not None:
            v = f"{v:.3f} ({summary['wer_errors']}/{summary['wer_words']} words)"
        if key == "echo_exact":
            v = f"{v}/{summary['samples']}"
        rows.append((label, "-" if v is None else str(v)))
    for reason, n in sorted(summary["failed_by_reason"].items()):
        rows.append((f"failed at {reason}", str(n)))
    return rows


def print_summary(summary: dict[str, Any], console: Any) -> None:
    with needed():
        from rich.table import Table

    table = Table(title="duplexbus eval", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    console.print(table)


def plot(out: Path, records: list[dict[str, Any]], max_timelines: int = 40) -> list[Path]:
    """latency.png (distributions of time to first audio and reply latency) and timelines.png
    (per sample: its stages and each reply audio arrival)."""
    with needed():
        import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in records if r["ok"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "ttfa_s", "time to first audio after end of input"),
        (axes[1], "reply_latency_s", "reply latency"),
    ):
        xs = [r[key] for r in ok if r[key] is not None]
        if xs:
            ax.hist(xs, bins=min(30, max(5, len(xs))))
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("samples")
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    shown = records[:max_timelines]
    fig, ax = plt.subplots(figsize=(10, 1 + 0.3 * max(1, len(shown))))
    colors = {
        "connect": "#bbbbbb",
        "handshake": "#999999",
        "input": "#4c72b0",
        "commit": "#dd8452",
        "drain": "#55a868",
        "close": "#c44e52",
    }
    for y, r in enumerate(shown):
        stages = r["timeline"]["stages"]
        names = [s for s in colors if s in stages]
        for i, s in enumerate(names):
            start = stages[s]
            end = stages[names[i + 1]] if i + 1 < len(names) else stages.get("done", start + (r["stage_s"].get(s) or 0))
            ax.barh(y, (end or start) - start, left=start, color=colors[s], height=0.6)
        audio = r["timeline"]["audio_at"]
        ax.plot(audio, [y] * len(audio), "|", color="black", markersize=6)
    ax.set_yticks(range(len(shown)), [r["sample"] for r in shown], fontsize=7)
    ax.set_xlabel(
        "seconds since the connection opened (bars: connect, handshake, input, commit, drain, close; ticks: reply audio)"
    )
    ax.invert_yaxis()
    fig.tight_layout()
    paths.append(out / "timelines.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
