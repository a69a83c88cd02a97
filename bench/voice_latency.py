"""`voice_assistant` through the real services: end of a turn to the first reply audio.

Starts `duplexbus up --model voice_assistant` (embedded NATS, the conductor, one
frontend, one worker process per partition: Listener, Recognizer, Talker) and runs
live calls against `WS /generate/ws`, one socket per call, as a browser would. Each
call streams a spoken dialogue in real time, one 80 ms append (1280 samples) every
80 ms: 0.5 s of silence, then `--turns` piper-synthesized sentences, each followed
by `--gap` seconds of silence (long enough for the reply to be spoken, so no turn
barges in), then the input ends.

The latency of a turn is measured at the client: from the moment it has sent the
frame holding the last speech sample of the utterance (the last sample above 5 % of
the clip's peak) to the arrival of the first `audio` output of the reply to that
turn. It includes, by design, the Listener's end-of-turn rule (0.5 s of silence
below the VAD threshold), then the final transcript (pocketsphinx `end_utt`), the
reply's first synthesized piece (piper) and the trips over NATS. The components are
reported too: the `speak` event (the turn's end decided) and the final transcript.

The calls of one level start at seeded random offsets spread over one turn period
(independent callers, not in lockstep). Before the levels, a warm-up round of
`max(--calls)` concurrent one-turn calls runs on the fresh workers and is reported
apart: the Recognizer then builds a decoder (~0.5 s, inside its step) for each call
beyond its pool; later calls take pooled decoders (up to 8 are kept).

    .venv/bin/python bench/voice_latency.py                         # 1, 4 and 8 calls; writes docs/performance.md
    .venv/bin/python bench/voice_latency.py --calls 1 2 --no-doc --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/voice_latency.py` finds `bench`

from bench.machine import machine
from models.voice_assistant import FRAME, SAMPLE_RATE
from models.voice_assistant.audio import silence
from models.voice_assistant.clips import piper_clips
from models.voice_assistant.text import SAMPLE_SENTENCES
from shared.runtime.stats import percentile
from shared.sdk.audio import b64_pcm16
from tests.support.client import is_final
from tests.support.stack import UpStack

SENTENCES = [SAMPLE_SENTENCES[i] for i in (1, 2, 4, 3, 6, 7, 0, 5)]
SEED = 20_240_601
DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
HEADING = "## voice_assistant: end of turn to first reply audio"


class CpuWatch:
    """The share of the machine's CPU time used by processes outside this benchmark (others' jobs).

    Busy time of the whole machine (/proc/stat) minus that of this process and of the
    `duplexbus up` process tree (UpStack.cpu_seconds), over a level's run.
    """

    def __init__(self, stack: UpStack) -> None:
        self.stack = stack
        self.tick = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these
        self.start = self._sample()

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4], sum(v)  # busy, total (idle and iowait are not busy)

    def _sample(self) -> tuple[int, int, float]:
        return (*self._machine(), sum(self.stack.cpu_seconds().values()) * self.tick)

    def others(self) -> float:
        """Others' share of all cores since the last call (0..1); starts a new interval."""
        busy0, total0, mine0 = self.start
        self.start = busy1, total1, mine1 = self._sample()
        return max(0.0, ((busy1 - busy0) - (mine1 - mine0)) / max(1, total1 - total0))


def clips() -> list[np.ndarray]:
    """16 kHz PCM16 of each sentence, from a piper session seeded before it is built (the same every run)."""
    return piper_clips(SENTENCES, SAMPLE_RATE, SEED)


def last_speech_sample(pcm: np.ndarray) -> int:
    a = np.abs(pcm.astype(np.int32))
    return int(np.flatnonzero(a > 0.05 * a.max())[-1])


def dialogue(speech: list[np.ndarray], first: int, turns: int, gap: float) -> tuple[np.ndarray, list[int]]:
    """The call's audio and, per turn, the index of its last speech sample."""
    parts = [silence(0.5, SAMPLE_RATE)]
    pos = len(parts[0])
    ends = []
    for k in range(turns):
        clip = speech[(first + k) % len(speech)]
        ends.append(pos + last_speech_sample(clip))
        parts += [clip, silence(gap if k < turns - 1 else 1.0, SAMPLE_RATE)]
        pos += len(clip) + len(parts[-1])
    return np.concatenate(parts), ends


async def one_call(url: str, rid: str, audio: np.ndarray, ends: list[int], delay: float) -> dict[str, Any]:
    """Stream one call in real time; per turn: seconds from its last speech frame to speak / final / first audio."""
    await asyncio.sleep(delay)
    end_frames = {e // FRAME: k + 1 for k, e in enumerate(ends)}  # frame index -> turn
    sent_end: dict[int, float] = {}
    first: dict[str, dict[int, float]] = {"speak": {}, "final": {}, "audio": {}}
    result: dict[str, Any] = {"rid": rid, "final": None, "texts": {}}
    async with websockets.connect(url, max_size=None) as ws:

        async def send() -> None:
            await ws.send(json.dumps({"request_id": rid}))
            t0 = time.monotonic()
            for k, i in enumerate(range(0, len(audio), FRAME)):
                data = b64_pcm16(audio[i : i + FRAME])
                await ws.send(json.dumps({"request_id": rid, "append": [{"name": "mic.pcm", "data": data}]}))
                if k in end_frames:
                    sent_end[end_frames[k]] = time.monotonic()
                await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME / SAMPLE_RATE - time.monotonic()))
            await ws.send(json.dumps({"request_id": rid, "end_input": True}))

        sender = asyncio.create_task(send())
        try:
            async for raw in ws:
                now = time.monotonic()
                m = json.loads(raw)
                o = m.get("output")
                if o is not None:
                    kind = o.get("type")
                    if kind == "transcript" and o.get("final"):
                        kind = "final"
                        result["texts"][o["turn"]] = o["text"]
                    if kind in first:
                        first[kind].setdefault(o["turn"], now)
                elif is_final(m):
                    result["final"] = m
                    break
        finally:
            sender.cancel()
    turns = []
    for k, t_end in sorted(sent_end.items()):
        turns.append({kind: (first[kind][k] - t_end if k in first[kind] else None) for kind in first})
    result["turns"] = turns
    return result


async def level(
    stack: UpStack,
    speech: list[np.ndarray],
    calls: int,
    turns: int,
    gap: float,
    rounds: int,
    rng: random.Random,
    spread: bool = True,
) -> dict[str, Any]:
    period = 1.5 + gap  # about one turn
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        jobs = []
        for i in range(calls):
            audio, ends = dialogue(speech, first=rng.randrange(len(speech)), turns=turns, gap=gap)
            delay = (rng.random() * period if spread else 0.1 * i) if calls > 1 else 0.0
            jobs.append(one_call(stack.ws_url(), f"lat-{'s' if spread else 'a'}{calls}-{r}-{i}", audio, ends, delay))
        out += await asyncio.gather(*jobs)
    return summarize(calls, out)


def summarize(calls: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    ms = {k: [t[k] * 1000 for r in results for t in r["turns"] if t[k] is not None] for k in ("speak", "final", "audio")}
    n_turns = sum(len(r["turns"]) for r in results)
    failed = [r["final"] for r in results if not (r["final"] and "finish" in r["final"])]

    return {
        "calls": calls,
        "turns": n_turns,
        "replies": len(ms["audio"]),
        "failed_calls": len(failed),
        "errors": failed[:3],
        "audio_p50_ms": percentile(ms["audio"], 50),
        "audio_p95_ms": percentile(ms["audio"], 95),
        "audio_max_ms": max(ms["audio"]) if ms["audio"] else None,
        "speak_p50_ms": percentile(ms["speak"], 50),
        "final_p50_ms": percentile(ms["final"], 50),
        "final_p95_ms": percentile(ms["final"], 95),
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def row(r: dict[str, Any], label: str | None = None) -> str:
    return (
        f"| {label or r['calls']} | {r['turns']} | {r['replies']} | {fmt(r['audio_p50_ms'])} | {fmt(r['audio_p95_ms'])} "
        f"| {fmt(r['audio_max_ms'])} | {fmt(r['speak_p50_ms'])} | {fmt(r['final_p50_ms'])} | {fmt(r['final_p95_ms'])} "
        f"| {fmt(r.get('others_cpu_pct'))} |"
    )


TABLE_HEAD = (
    "| concurrent calls | turns | replies | first audio p50 ms | p95 ms | max ms "
    "| speak p50 ms | final transcript p50 ms | p95 ms | others' CPU % |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)

WHERE_THE_TIME_GOES = """\
Where the time goes:

- `speak` (about 0.65 s at any load) is mostly the Listener's end-of-turn rule: 0.5 s of
  silence below the VAD threshold. The rest is the VAD's probability falling after the last
  word, the rest of the last frame and a trip over NATS. Every figure includes it: it is
  the price of not cutting the caller off mid-sentence.
- `final transcript` follows about 0.1 s later when the Recognizer keeps up
  (pocketsphinx's `end_utt` search over the turn, two trips over NATS).
- The first audio follows about 0.2 s after that: piper synthesizes the reply's first
  piece (the whole "You said: ..." sentence, up to 10 words) before its first chunk goes out.
- With 8 calls the Recognizer is what falls behind. It is one process decoding call
  after call (pocketsphinx has no batched API; about 0.7 of a core for 8 live calls in the
  table below), and it shares these 2 cores with the other services and the load client,
  so turns that end together wait for each other's decoding (the `aligned` row). The
  Talker's single synthesis thread likewise queues the first pieces of replies that start
  together.
- Fresh workers are no slower than warm ones for the same load: the cold row (8 one-turn
  calls at once, so their turns end together) is close to the warm `aligned` row. Before
  the Recognizer filled its decoder pool at start, it built each missing decoder (about
  0.5 s) inside its step, holding up every call in it, and the cold row's first audio was
  8.3 s at p50 instead of 4.3 s.
"""

RTF_NOTE = """\
Per-partition real-time factors, measured in-process (`bench/voice_assistant_rtf.py`, the
worker's engine cores on a simulated clock, decoders built beforehand; from
[voice_assistant.md](voice_assistant.md#measured)): `load` is the share of one core a
partition needs to keep up with that many live calls.

| calls | Listener load | Recognizer load | Talker load | Talker RTF per second of reply audio |
|---|---|---|---|---|
| 1 | 0.022 | 0.085 | 0.033 | 0.067 |
| 4 | 0.034 | 0.398 | 0.115 | 0.060 |
| 8 | 0.037 | 0.724 | 0.249 | 0.065 |
"""


def section(args: argparse.Namespace, command: str, warm: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        HEADING,
        "",
        f"Machine: {machine()}.",
        "",
        "Other people's jobs share this machine: `others' CPU %` is their share of all cores while a row ran (busy CPU",
        "time outside this benchmark and its services). Rows run under more of it are slower.",
        "",
        "```",
        command,
        "```",
        "",
        "`duplexbus up --model voice_assistant`: one frontend, one worker process per partition, the load client on the",
        f"same machine. Each call streams {args.turns} spoken turns in real time (80 ms appends every 80 ms), {args.gap} s",
        "of silence after each, one socket per call. The calls of a level start at random offsets spread over one turn;",
        "in the `aligned` row they start 0.1 s apart, so their turns end at about the same time. Latency: from sending",
        "the frame that holds the last speech sample of a turn to receiving the first reply audio chunk. `speak` (the",
        "Listener decided the turn ended) and `final transcript` are measured from the same moment.",
        "",
    ]
    lines += [
        TABLE_HEAD,
        *[row(r, r.get("label")) for r in results],
        "",
        f"Cold start (first round on fresh workers, {warm['calls']} one-turn calls at once; the Recognizer has filled its",
        "pool of 8 decoders in the background at start, so no decoder is built inside a step, but the first onnxruntime,",
        "pocketsphinx and piper runs of each process are slower than later ones):",
        "",
        TABLE_HEAD,
        row(warm, f"{warm['calls']} (cold)"),
        "",
        WHERE_THE_TIME_GOES,
        RTF_NOTE,
    ]
    return "\n".join(lines)


def write_doc(text: str) -> None:
    """Replace this section in docs/performance.md, or append it; other sections stay as they are."""
    old = DOC.read_text() if DOC.exists() else "# Performance\n"
    pat = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(old):
        new = pat.sub(lambda _: text.rstrip() + "\n\n", old).rstrip() + "\n"
    else:
        new = old.rstrip() + "\n\n" + text.rstrip() + "\n"
    DOC.write_text(new)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--turns", type=int, default=3, help="turns per call")
    ap.add_argument("--gap", type=float, default=6.0, help="silence after each turn (s): the reply is spoken in it")
    ap.add_argument("--min-turns", type=int, default=12, help="rounds of calls per level until this many turns are measured")
    ap.add_argument(
        "--aligned", type=int, default=8, help="then this many calls started 0.1 s apart, turns ending together (0: skip)"
    )
    ap.add_argument("--workers", type=int, default=1, help="worker processes per partition (`duplexbus up --workers`)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-doc", action="store_true", help=f"do not write {DOC.name}")
    args = ap.parse_args()
    command = ".venv/bin/python " + " ".join(shlex.quote(a) for a in ["bench/voice_latency.py", *sys.argv[1:]])
    rng = random.Random(SEED)
    print(f"machine: {machine()}")
    speech = clips()
    results = []
    with UpStack("voice_assistant", workers=args.workers, config={"max_concurrent_requests": max(args.calls) + 8}) as stack:
        watch = CpuWatch(stack)
        n = max(args.calls)
        warm_jobs = []
        for i in range(n):
            audio, ends = dialogue(speech, first=i, turns=1, gap=1.0)
            warm_jobs.append(one_call(stack.ws_url(), f"warm-{i}", audio, ends, 0.1 * i))
        warm = summarize(n, list(await asyncio.gather(*warm_jobs)))
        warm["others_cpu_pct"] = 100 * watch.others()
        print(TABLE_HEAD)
        print(row(warm, f"{n} (cold)"), flush=True)
        for calls in args.calls:
            rounds = max(1, math.ceil(args.min_turns / (calls * args.turns)))
            watch.others()
            r = await level(stack, speech, calls, args.turns, args.gap, rounds, rng)
            r["others_cpu_pct"] = 100 * watch.others()
            results.append(r)
            print(row(r), flush=True)
            if r["failed_calls"]:
                print(f"  failed calls: {r['errors']}", flush=True)
        if args.aligned:
            watch.others()
            r = await level(stack, speech, args.aligned, args.turns, args.gap, 1, rng, spread=False)
            r["others_cpu_pct"] = 100 * watch.others()
            r["label"] = f"{args.aligned} (aligned)"
            results.append(r)
            print(row(r, r["label"]), flush=True)
    text = section(args, command, warm, results)
    if not args.no_doc:
        write_doc(text)
        print(f"written to {DOC}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine(), "command": command, "cold": warm, "results": results}, indent=2)
        )


if __name__ == "__main__":
    asyncio.run(main())
