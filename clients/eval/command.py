"""`duplexbus eval`: the command around the runner (corpus, progress bar, outputs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from clients import DefaultsHelp
from clients.eval import corpus, extra, report
from clients.eval.core import Bounds
from clients.eval.protocols import DEFAULT_URLS
from clients.eval.runner import Options, Outcome, Sample, run_eval

APPEND_MS = (80, 100)  # what a microphone client sends per append, and what the eval measures with


def append_ms(text: str) -> int:
    """`--append-ms`: whole milliseconds within APPEND_MS (argparse says what was wrong)."""
    try:
        ms = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of milliseconds: {text!r}") from None
    lo, hi = APPEND_MS
    if not lo <= ms <= hi:
        raise argparse.ArgumentTypeError(f"{ms} ms is outside {lo}-{hi} ms, the append size of a live microphone")
    return ms


def options(args: argparse.Namespace) -> Options:
    bounds = Bounds(
        connect_s=args.connect_timeout,
        handshake_s=args.handshake_timeout,
        input_slack_s=args.input_slack,
        commit_s=args.commit_timeout,
        drain_s=args.drain_timeout,
        quiet_s=args.quiet,
        close_s=args.close_timeout,
        close_grace_s=args.close_grace,
    )
    headers = dict(h.split(":", 1) for h in args.header or [])
    return Options(
        url=args.url or DEFAULT_URLS[args.protocol],
        protocol=args.protocol,
        model=args.model,
        pace=args.pace,
        append_ms=args.append_ms,
        bounds=bounds,
        turn_detection=None if args.turn_detection == "none" else args.turn_detection,
        response_create=args.response_create,
        transcription_model=args.transcription_model,
        headers={k.strip(): v.strip() for k, v in headers.items()},
    )


def samples(args: argparse.Namespace, out: Path) -> list[Sample]:
    # generate-ws sends raw PCM, which the model reads at its own rate; a realtime session
    # declares each clip's rate.
    rate = args.rate if args.protocol == "generate-ws" else None
    if args.synthesize:
        return corpus.synthesize(args.synthesize, args.rate, keep_in=out / "corpus")
    if not args.corpus:
        raise SystemExit("give a CORPUS folder or --synthesize N")
    return corpus.load_folder(Path(args.corpus), rate)


async def run(args: argparse.Namespace) -> int:
    extra.require()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").unlink(missing_ok=True)
    todo = samples(args, out)
    opts = options(args)
    err = Console(stderr=True)
    records: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("eval", total=len(todo))

        def done(o: Outcome) -> None:
            rec = report.record(o, args.expect_echo)
            report.write_sample(out, o, rec)
            records.append(rec)
            if not o.ok:
                bar.console.print(f"[red]{rec['sample']}: failed at {rec['stage']} ({rec['reason']}): {rec['detail']}")
                if rec.get("traceback"):
                    bar.console.print(rec["traceback"], markup=False, highlight=False)
            failed = sum(1 for r in records if not r["ok"])
            bar.update(task, advance=1, description=f"eval: {len(records) - failed} ok, {failed} failed")

        await run_eval(todo, opts, args.concurrency, done)
    records.sort(key=lambda r: str(r["sample"]))
    summary = report.summarize(records)
    summary["protocol"], summary["url"], summary["pace"] = opts.protocol, opts.url, opts.pace
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report.print_summary(summary, Console())
    for p in report.plot(out, records):
        err.print(f"wrote {p}")
    err.print(f"records: {out / 'results.jsonl'}; summary: {out / 'summary.json'}")
    return 0 if summary["failed"] == 0 else 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ev: argparse.ArgumentParser = sub.add_parser(
        "eval",
        help="measure a deployment over a corpus of clips: latency, quality, failures",
        description="Stream each clip of a corpus to a deployment as a live call (or a realtime session), "
        "with every wait bounded, and report time to first audio, reply latency, real-time factor, gaps, "
        "WER and failures. Writes results.jsonl (one record per sample), audio/, summary.json and PNG plots "
        "to --out. Exits 1 if any sample failed.",
        formatter_class=DefaultsHelp,
    )
    ev.add_argument("corpus", nargs="?", help="folder of mono 16-bit WAV files, each with an optional NAME.txt reference")
    ev.add_argument(
        "--synthesize", type=int, metavar="N", help="instead of a folder: N sentences said by the bundled piper voice"
    )
    ev.add_argument("--url", help="the deployment's endpoint (default: ws://127.0.0.1:8000/generate/ws or /v1/realtime)")
    ev.add_argument("--protocol", choices=["generate-ws", "realtime"], default="generate-ws", help="the wire protocol")
    ev.add_argument("--model", help="model to ask for (generate-ws opening `model`; realtime `?model=`)")
    ev.add_argument("--concurrency", type=int, default=1, help="samples at once, each on its own connection")
    ev.add_argument(
        "--pace",
        choices=["realtime", "fast"],
        default="realtime",
        help="send appends in real time, or as fast as the socket takes them",
    )
    ev.add_argument("--append-ms", type=append_ms, default=80, help="audio per append, 80 to 100 ms (as a microphone sends)")
    ev.add_argument(
        "--rate", type=int, default=16000, help="sample rate of the clips on generate-ws (the model's) and of synthesized clips"
    )
    ev.add_argument(
        "--out", default="eval-out", help="folder for results.jsonl, audio/, summary.json, latency.png, timelines.png"
    )
    ev.add_argument(
        "--expect-echo", action="store_true", help="the deployment serves echo: check each reply is the sent audio byte for byte"
    )
    rt = ev.add_argument_group("realtime")
    rt.add_argument(
        "--turn-detection",
        choices=["none", "server_vad"],
        default="none",
        help="none: the eval commits at the end of each clip; server_vad: the server's turn-taking ends it (no commit)",
    )
    rt.add_argument(
        "--response-create",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send response.create after each commit, as OpenAI's manual turns need (and duplexbus's):"
        " --no-response-create for a server that answers a commit by itself",
    )
    rt.add_argument("--transcription-model", help="ask for input transcription with this model (its transcript is scored)")
    rt.add_argument("--header", action="append", metavar="NAME: VALUE", help="extra HTTP header for the connection (repeatable)")
    w = ev.add_argument_group("bounds (seconds): every wait of a sample")
    w.add_argument("--connect-timeout", type=float, default=10.0, help="opening the connection")
    w.add_argument(
        "--handshake-timeout", type=float, default=10.0, help="the session handshake (realtime: session.created, session.updated)"
    )
    w.add_argument("--input-slack", type=float, default=10.0, help="the input stream may take the clip's duration plus this")
    w.add_argument("--commit-timeout", type=float, default=10.0, help="sending the end of input and its acknowledgement")
    w.add_argument("--drain-timeout", type=float, default=60.0, help="from the end of input until the reply has drained")
    w.add_argument(
        "--quiet",
        type=float,
        default=5.0,
        help="the reply has drained after this long without reply activity (and no response open); "
        "it must outlast the slowest wait for a reply",
    )
    w.add_argument(
        "--close-timeout", type=float, default=5.0, help="the close: the call's finish (generate-ws) and the close handshake"
    )
    w.add_argument("--close-grace", type=float, default=2.0, help="the outer close wait is --close-timeout plus this")
    return ev
