"""The `duplexbus` command: up, frontend, conductor, worker, call, eval, replay, nats."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from shared.runtime.config import ServingConfig, load_config
from shared.runtime.errors import ConfigError
from shared.runtime.process import install_stop_signals, setup_logging, tune_gc


def _config(args: argparse.Namespace) -> ServingConfig:
    return load_config(args.config, model=getattr(args, "model", None))


def _serve(run: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run a service until SIGINT/SIGTERM, after freezing what start-up loaded out of the GC."""

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await run(stop)

    tune_gc()
    try:
        import uvloop  # a C event loop: much less cost per message than asyncio's own
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    return 0


def cmd_conductor(args: argparse.Namespace) -> int:
    from services.conductor.service import ConductorService

    setup_logging("conductor")
    return _serve(ConductorService(_config(args)).run)


def cmd_worker(args: argparse.Namespace) -> int:
    from services.worker.service import WorkerService

    setup_logging("worker")
    cfg = _config(args)
    return _serve(WorkerService(cfg, cfg.model, args.partition or None).run)


def cmd_frontend(args: argparse.Namespace) -> int:
    import uvicorn

    from services.frontend.app import create_app
    from services.frontend.websocket import FrontendWebSocketProtocol

    setup_logging("frontend")
    cfg = _config(args)
    host = args.host or cfg.host
    port = args.port or cfg.port
    app = create_app(cfg)
    tune_gc()
    ws_max = 2 * cfg.max_message_bytes + 1024 * 1024  # the app answers oversize messages itself
    uvicorn.run(
        app,
        host=host,
        port=port,
        ws=FrontendWebSocketProtocol.with_send_buffer(cfg.max_send_buffer_bytes),
        ws_max_size=ws_max,
        ws_per_message_deflate=False,  # compressing base64 audio costs CPU and saves little
        log_level="warning",
        lifespan="on",
        ws_ping_interval=20,
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from duplexbus.supervisor import UpOptions, run_up
    from models.registry import served_model

    cfg = _config(args)
    partitions = served_model(cfg.model).topology.partitions
    opts = UpOptions(
        config=args.config,
        model=args.model,
        frontends=args.frontends,
        workers=args.workers,
        port=args.port or cfg.port,
        host=args.host or cfg.host,
        run_dir=Path(args.run_dir),
        colocate=args.colocate,
        stop_timeout=cfg.shutdown_drain_s + 5.0,  # children drain for shutdown_drain_s before they exit
    )
    return run_up(opts, partitions, cfg)


def cmd_nats(args: argparse.Namespace) -> int:
    import contextlib
    import signal
    import time

    from shared.bus.embedded import NatsServer

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    with NatsServer(args.store, port=args.port) as server, contextlib.suppress(KeyboardInterrupt):
        print(server.url, flush=True)
        while True:
            time.sleep(1)
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from clients.call import run_call

    return asyncio.run(run_call(args))


def cmd_eval(args: argparse.Namespace) -> int:
    from clients.eval.command import run

    return asyncio.run(run(args))


def cmd_replay(args: argparse.Namespace) -> int:
    from clients.replay import run_replay

    return asyncio.run(run_replay(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplexbus", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="serving config YAML (or $DUPLEXBUS_CONFIG)")
        sp.add_argument("--model", help="model to serve (overrides the config)")

    up = sub.add_parser("up", help="embedded NATS + conductor + workers + frontends, supervised")
    common(up)
    up.add_argument("--frontends", type=int, default=1)
    up.add_argument("--workers", type=int, default=1, help="workers per partition (with --colocate: worker processes)")
    up.add_argument(
        "--colocate",
        action="store_true",
        help="each worker process runs every partition; the edges between them stay in the process (small machines)",
    )
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--run-dir", default=".run")
    up.set_defaults(fn=cmd_up)

    fe = sub.add_parser("frontend", help="serve /generate/ws and POST /generate")
    common(fe)
    fe.add_argument("--host")
    fe.add_argument("--port", type=int)
    fe.set_defaults(fn=cmd_frontend)

    co = sub.add_parser("conductor", help="admission, placement, completion")
    common(co)
    co.set_defaults(fn=cmd_conductor)

    wo = sub.add_parser("worker", help="run partitions of the model")
    common(wo)
    wo.add_argument("--partition", action="append", help="partition to run (repeatable; default all)")
    wo.set_defaults(fn=cmd_worker)

    na = sub.add_parser("nats", help="run the embedded nats-server in the foreground")
    na.add_argument("--store", default=".run/nats")
    na.add_argument("--port", type=int, default=4222)
    na.set_defaults(fn=cmd_nats)

    ca = sub.add_parser("call", help="stream a WAV file as a live call and print what comes back")
    ca.add_argument("file")
    ca.add_argument("--url", default="ws://127.0.0.1:8000/generate/ws")
    ca.add_argument("--model")
    ca.add_argument("--fast", action="store_true", help="send as fast as possible, not in real time")
    ca.add_argument("--append-ms", type=int, default=80)
    ca.add_argument("--out", default="reply.wav", help="where to write the reply audio")
    ca.add_argument("--request-id")
    ca.add_argument("--quiet", action="store_true")
    ca.set_defaults(fn=cmd_call)

    from clients.eval.command import add_parser as add_eval

    add_eval(sub).set_defaults(fn=cmd_eval)

    rp = sub.add_parser("replay", help="print every message of a call from the stream")
    rp.add_argument("cid")
    rp.add_argument("--nats-url")
    rp.set_defaults(fn=cmd_replay)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.captureWarnings(True)  # here, not under __main__: the `duplexbus` console script calls main()
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
