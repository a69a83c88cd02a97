"""The `duplexbus` command: up, frontend, conductor, worker, call, eval, replay, nats, health, check-model."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared.runtime.config import ServingConfig, load_config
from shared.runtime.errors import BusError, BusUnavailable, ConfigError
from shared.runtime.process import LOG_FORMATS, STOP_GRACE_S, install_stop_signals, run_until_stopped, setup_logging, tune_gc

if TYPE_CHECKING:
    from duplexbus.supervisor import UpOptions


def _config(args: argparse.Namespace) -> ServingConfig:
    return load_config(args.config, model=getattr(args, "model", None))


def _cli_config(args: argparse.Namespace) -> ServingConfig:
    """A bus command's config: --nats-url, else the config and $NATS_URL, else the URL that
    `duplexbus up` left in its run directory (so `replay` works right after `make up`)."""
    cfg = load_config(getattr(args, "config", None), nats_url=getattr(args, "nats_url", None))
    if cfg.nats_url:
        return cfg
    from duplexbus.supervisor import saved_nats_url

    saved = saved_nats_url(Path(getattr(args, "run_dir", None) or ".run"))
    if saved is None:
        raise BusUnavailable("finding NATS", "no NATS URL: give --nats-url, set NATS_URL, or run `duplexbus up` here first")
    return msgspec.structs.replace(cfg, nats_url=saved)


def _serve(run: Callable[[asyncio.Event], Awaitable[None]], grace_s: float) -> int:
    """Run a service until SIGINT/SIGTERM, after freezing what start-up loaded out of the GC.

    A stop is bounded: a service that has not finished `grace_s` after the signal (NATS out of
    reach while it connects or drains, say) is cancelled, so SIGTERM always ends it."""

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await run_until_stopped(run, stop, grace_s)

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

    setup_logging("conductor", args.log_format)
    cfg = _config(args)
    return _serve(ConductorService(cfg, health_port(args)).run, cfg.shutdown_drain_s + STOP_GRACE_S)


HEALTH_PORT_ENV = "DUPLEXBUS_HEALTH_PORT"


def health_port(args: argparse.Namespace) -> int | None:
    """--health-port, else $DUPLEXBUS_HEALTH_PORT, else None (no /livez, /readyz, /metrics)."""
    if args.health_port is not None:
        return int(args.health_port)
    env = os.environ.get(HEALTH_PORT_ENV)
    return int(env) if env else None


def cmd_worker(args: argparse.Namespace) -> int:
    from services.worker.service import WorkerService

    setup_logging("worker", args.log_format)
    cfg = _config(args)
    worker = WorkerService(cfg, cfg.model, worker_partitions(args.partition), health_port=health_port(args))
    code = _serve(worker.run, cfg.shutdown_drain_s + STOP_GRACE_S)
    return 1 if worker.replaced else code  # stuck (worker_replace_s): its supervisor starts a new one


PARTITIONS_ENV = "DUPLEXBUS_PARTITIONS"


def worker_partitions(flags: list[str] | None) -> list[str] | None:
    """--partition, else $DUPLEXBUS_PARTITIONS (comma-separated), else None: every partition.
    A generic container runs any model's partitions without naming them in its command."""
    if flags:
        return flags
    named = [p.strip() for p in os.environ.get(PARTITIONS_ENV, "").split(",") if p.strip()]
    return named or None


def cmd_check_model(args: argparse.Namespace) -> int:
    from duplexbus.check_model import run_command

    return run_command(args)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when this container's service is healthy, 1 (saying why) when not."""
    if args.url:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(args.url, timeout=args.timeout) as r:
                return 0 if r.status == 200 else 1
        except (OSError, urllib.error.URLError) as e:
            print(f"unhealthy: {args.url}: {e}", file=sys.stderr)
            return 1
    from shared.runtime.healthfile import unhealthy

    why = unhealthy(args.max_age or _config(args).liveness_s)
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


def cmd_frontend(args: argparse.Namespace) -> int:
    from services.frontend.server import serve

    setup_logging("frontend", args.log_format)
    cfg = _config(args)
    serve(cfg, args.host or cfg.host, args.port or cfg.port, fd=args.fd, health_port=args.health_port)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    if args.log_format:  # the children read it from their environment
        os.environ["DUPLEXBUS_LOG_FORMAT"] = args.log_format
    from duplexbus.supervisor import run_up
    from models.registry import served_model

    cfg = _config(args)
    partitions = served_model(cfg.model).topology.partitions
    return run_up(up_options(args, cfg), partitions, cfg)


def up_options(args: argparse.Namespace, cfg: ServingConfig) -> UpOptions:
    """What `duplexbus up` runs: its flags, else the config's keys."""
    from duplexbus.supervisor import UpOptions

    if args.nats_procs is not None and args.nats_procs < 0:
        raise ConfigError("--nats-procs", f"must be >= 0, got {args.nats_procs}")
    return UpOptions(
        config=args.config,
        model=args.model,
        frontends=args.frontends,
        workers=args.workers,
        port=args.port or cfg.port,
        host=args.host or cfg.host,
        run_dir=Path(args.run_dir),
        colocate=args.colocate,
        stop_timeout=cfg.shutdown_drain_s + 5.0,  # children drain for shutdown_drain_s before they exit
        nats_monitor_port=args.nats_monitor_port or cfg.nats_monitor_port,
        nats_procs=args.nats_procs if args.nats_procs is not None else cfg.nats_procs,
        health_host=cfg.health_host,  # not --host: a frontend open to the network leaves these on loopback
    )


def cmd_nats(args: argparse.Namespace) -> int:
    """The server(s) want generated credentials, as `duplexbus up`'s embedded one does: the URL
    with them goes to a file beside the store, readable by this user alone (the terminal gets
    the URL without the password)."""
    import contextlib
    import secrets
    import signal
    import time

    from duplexbus.supervisor import save_nats_url
    from shared.bus.embedded import NatsCluster, NatsServer, StoreInUse

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    credentials = ("duplexbus", secrets.token_urlsafe(24))
    server: NatsServer | NatsCluster
    monitor = args.monitor_port
    if args.cluster:
        monitors = [monitor + i for i in range(3)] if monitor else None
        ports = [args.port + i for i in range(3)]
        server = NatsCluster(args.store, ports=ports, monitor_ports=monitors, credentials=credentials)
    else:
        server = NatsServer(args.store, port=args.port, monitor_port=monitor, credentials=credentials)
    saved = nats_url_file(Path(args.store))
    try:
        server.start()  # the store's lock first: the file beside it may be another live server's
    except StoreInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with contextlib.suppress(KeyboardInterrupt):  # a stop at any point from here on is a clean one
            save_nats_url(saved, server.client_url)
            print(server.url, flush=True)
            hint = " and retention.replicas: 3" if args.cluster else ""
            print(f"credentials in {saved} (yours alone): give the services NATS_URL=$(cat {saved}){hint}",
                  file=sys.stderr, flush=True)  # fmt: skip
            monitoring = server.monitor_urls if isinstance(server, NatsCluster) else [server.monitor_url]
            print(f"monitoring on {', '.join(monitoring)} (/healthz, /varz, /jsz)", file=sys.stderr, flush=True)
            while True:
                time.sleep(1)
    finally:
        server.stop()
        saved.unlink(missing_ok=True)  # the credentials go with the server
    return 0


def nats_url_file(store: Path) -> Path:
    """Where `duplexbus nats` leaves its URL: beside its store, named after it (`.run/nats.url`
    by default, where `duplexbus up` leaves its own, so `replay` finds it the same way). Two
    live servers never share a store, so they never share this file either."""
    return store.parent / f"{store.name}.url"


def cmd_call(args: argparse.Namespace) -> int:
    from clients.call import run_call

    return asyncio.run(run_call(args))


def cmd_eval(args: argparse.Namespace) -> int:
    from clients.eval.command import run

    return asyncio.run(run(args))


def cmd_replay(args: argparse.Namespace) -> int:
    from clients.replay import run_replay

    return asyncio.run(run_replay(args, _cli_config(args)))


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """An option's default, where its help does not say it already and there is one to say
    (not "(default: None)" after a help that names where the value comes from)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


# Commands whose parsers import little. The others' parsers import much (the model checker
# numpy and the engine, the replay client the bus): they are built only for a command line that
# names one of them, or none of these (`duplexbus --help` lists every command). A container's
# healthcheck runs `duplexbus health` every 5 s: it spent 0.6 s of CPU each time, 12 % of a core
# per container, building parsers it never used.
LIGHT_COMMANDS = frozenset({"up", "frontend", "conductor", "worker", "health", "nats", "call"})


def build_parser(named: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or for a command line that `named` one of LIGHT_COMMANDS, one
    without the heavy commands."""
    from duplexbus import __version__

    every = named not in LIGHT_COMMANDS

    fmt = _Defaults
    p = argparse.ArgumentParser(prog="duplexbus", description=__doc__, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"duplexbus {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=fmt)

    def observed(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--health-port",
            type=int,
            help=f"serve /livez, /readyz and /metrics on this port (default: ${HEALTH_PORT_ENV}, else none)",
        )

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--log-format",
            choices=LOG_FORMATS,
            help="log lines as text or one JSON object each (default: $DUPLEXBUS_LOG_FORMAT, else text)",
        )
        sp.add_argument("--config", help="serving config YAML (default: $DUPLEXBUS_CONFIG, else every default)")
        sp.add_argument("--model", help="model to serve (default: $DUPLEXBUS_MODEL, else the config's `model`)")

    up = command("up", "embedded NATS + conductor + workers + frontends, supervised (Ctrl-C stops all)")
    common(up)
    up.add_argument("--frontends", type=int, default=1, help="frontend processes, all serving on the one --port")
    up.add_argument("--workers", type=int, default=1, help="workers per partition (with --colocate: worker processes)")
    up.add_argument(
        "--colocate",
        action="store_true",
        help="each worker process runs every partition; the edges between them stay in the process (small machines)",
    )
    up.add_argument("--host", help="address the frontends listen on (default: the config's `host`, 127.0.0.1)")
    up.add_argument("--port", type=int, help="port the frontends listen on (default: the config's `port`, 8000)")
    up.add_argument("--run-dir", default=".run", help="logs, the embedded NATS store and its URL go here")
    up.add_argument(
        "--nats-monitor-port",
        type=int,
        help="the embedded nats-server's monitoring port, /healthz /varz /jsz (default: the config's "
        "`nats_monitor_port`, else a free one; printed at start)",
    )
    up.add_argument(
        "--nats-procs",
        type=int,
        help="the embedded nats-server's GOMAXPROCS, 0 for Go's own (default: the config's `nats_procs`, "
        "else half the cores, at least 1; $GOMAXPROCS where set)",
    )
    up.set_defaults(fn=cmd_up)

    fe = command("frontend", "serve /generate/ws and POST /generate")
    common(fe)
    fe.add_argument("--host", help="address to listen on (default: the config's `host`)")
    fe.add_argument("--port", type=int, help="port to listen on (default: the config's `port`)")
    fe.add_argument("--fd", type=int, help="accept on this inherited listening socket instead (as `duplexbus up` does)")
    fe.add_argument(
        "--health-port",
        type=int,
        help="answer /livez and /readyz on this port too (as `duplexbus up` does, to probe each of its frontends)",
    )
    fe.set_defaults(fn=cmd_frontend)

    co = command("conductor", "admission, placement, completion")
    common(co)
    observed(co)
    co.set_defaults(fn=cmd_conductor)

    wo = command("worker", "run partitions of the model")
    common(wo)
    observed(wo)
    wo.add_argument(
        "--partition",
        action="append",
        help=f"partition to run (repeatable; default: ${PARTITIONS_ENV}, comma-separated, else every partition)",
    )
    wo.set_defaults(fn=cmd_worker)

    if every:
        from duplexbus.check_model import add_arguments as add_check_model

        cm = command(
            "check-model", "run a model's partitions on generated calls in this process, and check the rules it must keep"
        )
        add_check_model(cm)
        cm.set_defaults(fn=cmd_check_model)

    he = command("health", "container healthcheck: exit 0 when this container's service works")
    he.add_argument("--config", help="serving config YAML (or $DUPLEXBUS_CONFIG): its liveness_s is the default --max-age")
    he.add_argument("--url", help="healthy when this URL answers 200 (a frontend's /healthz)")
    he.add_argument("--max-age", type=float, help="the service's last beat may be this old, in seconds")
    he.add_argument("--timeout", type=float, default=3.0, help="for --url, in seconds")
    he.set_defaults(fn=cmd_health)

    na = command("nats", "run the embedded nats-server in the foreground")
    na.add_argument("--store", default=".run/nats", help="JetStream store directory")
    na.add_argument("--port", type=int, default=4222, help="client port (with --cluster: the first node's; the others follow)")
    na.add_argument(
        "--monitor-port",
        type=int,
        help="monitoring port, /healthz /varz /jsz (with --cluster: the first node's; the others follow; "
        "default: a free one; printed at start)",
    )
    na.add_argument(
        "--cluster",
        action="store_true",
        help="three nodes in one JetStream cluster (routes on loopback, a store each under --store), for trying replicas: 3",
    )
    na.set_defaults(fn=cmd_nats)

    ca = command("call", "stream a WAV file as a live call, print what comes back, write the reply audio")
    ca.add_argument("file", help="a WAV file (PCM16; other rates and stereo are converted)")
    ca.add_argument("--url", default="ws://127.0.0.1:8000/generate/ws", help="the frontend's socket")
    ca.add_argument("--model", help="model to call (default: the one the frontend serves)")
    ca.add_argument(
        "--fast",
        action="store_true",
        help="send as fast as the server takes it, not in real time (the server is judged by progress: "
        "nothing taken and nothing sent back for 60 s ends the call with an error)",
    )
    ca.add_argument("--append-ms", type=int, default=80, help="audio per append")
    ca.add_argument("--out", default="reply.wav", help="where to write the reply audio")
    ca.add_argument("--request-id", help="the call's request_id (default: a random one)")
    ca.add_argument("--quiet", action="store_true", help="print only the finish")
    ca.add_argument(
        "--json",
        action="store_true",
        help="send JSON text frames with base64 audio (default: msgpack binary frames with raw audio, cheaper at both ends)",
    )
    ca.set_defaults(fn=cmd_call)
    if every:
        _add_clients(sub)
    return p


def _add_clients(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`eval` and `replay`, whose parsers import their clients."""
    from clients.eval.command import add_parser as add_eval

    add_eval(sub).set_defaults(fn=cmd_eval)

    from clients import DefaultsHelp
    from clients.replay import add_arguments as add_replay

    rp = sub.add_parser(
        "replay",
        help="a call's messages from the stream: a timeline, its audio, a rerun, or live",
        description="Read one call back from the stream (by cid or request_id): a timeline of every message by default.",
        formatter_class=DefaultsHelp,
    )
    add_replay(rp)
    rp.add_argument(
        "--nats-url",
        help="NATS URL(s), comma-separated for a cluster (default: $NATS_URL, else the one `duplexbus up` left in --run-dir)",
    )
    rp.add_argument("--run-dir", default=".run", help="where `duplexbus up` keeps its run files")
    rp.set_defaults(fn=cmd_replay)


def main(argv: list[str] | None = None) -> int:
    logging.captureWarnings(True)  # here, not under __main__: the `duplexbus` console script calls main()
    from shared.bus import defer_aiohttp

    defer_aiohttp()  # 0.3 s of each process's start, for a transport it never uses (the parser imports nats-py)
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(words[0] if words else None).parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except BusError as e:  # cannot reach NATS, refused: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
