"""The `duplexbus` command's own handling: bad arguments are one line and exit 2."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from duplexbus.cli import main
from shared.bus.embedded import free_port


@pytest.mark.parametrize("argv", [["up"], ["worker"], ["frontend"]])
def test_an_unknown_model_is_a_config_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main([*argv, "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model: unknown model 'nope' (built-in: echo, tiny_duplex, voice_assistant; installed")
    assert "Traceback" not in err and err.count("\n") == 1


# The suite turns warnings into errors; this test's own warning must reach logging instead.
@pytest.mark.filterwarnings("default:routed to logging:UserWarning")
def test_main_routes_warnings_to_logging(caplog: pytest.LogCaptureFixture) -> None:
    """The `duplexbus` console script calls main() directly: main itself captures warnings."""
    import logging
    import warnings

    logging.captureWarnings(False)
    try:
        main(["up", "--model", "nope"])
        with caplog.at_level(logging.WARNING, logger="py.warnings"):
            warnings.warn("routed to logging", UserWarning, stacklevel=1)
        assert "routed to logging" in caplog.text
    finally:
        logging.captureWarnings(False)


def test_nats_serves_monitoring_on_the_port_it_is_given_and_says_so(tmp_path: Path) -> None:
    port, monitor = free_port(), free_port()
    argv = ["nats", "--store", str(tmp_path / "nats"), "--port", str(port), "--monitor-port", str(monitor)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplexbus.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == f"nats://127.0.0.1:{port}"
        assert "credentials in " in proc.stderr.readline()
        assert f"monitoring on http://127.0.0.1:{monitor} " in proc.stderr.readline()
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_up_takes_the_monitoring_port_from_its_flag_else_the_config(tmp_path: Path) -> None:
    from duplexbus.cli import build_parser, up_options
    from shared.runtime.config import ServingConfig
    from shared.runtime.errors import ConfigError

    cfg = ServingConfig(nats_monitor_port=9222)
    assert up_options(build_parser().parse_args(["up"]), cfg).nats_monitor_port == 9222
    assert up_options(build_parser().parse_args(["up", "--nats-monitor-port", "9333"]), cfg).nats_monitor_port == 9333
    assert up_options(build_parser().parse_args(["up"]), ServingConfig()).nats_monitor_port is None  # a free one
    with pytest.raises(ConfigError, match="nats_monitor_port"):
        ServingConfig(nats_monitor_port=70000)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_nats_runs_until_sigterm_or_ctrl_c_and_stops_its_server(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplexbus.cli", "nats", "--store", str(tmp_path / "nats"), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"nats://127.0.0.1:{port}"
        proc.send_signal(sig)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    with socket.socket() as s:  # the server is gone with it: its port is free again
        s.bind(("127.0.0.1", port))


def test_every_command_says_what_each_option_does_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    from duplexbus.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: dict[str, argparse.ArgumentParser] = dict(subparsers.choices)
    assert {"up", "frontend", "conductor", "worker", "nats", "call", "eval", "replay"} <= set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"duplexbus {name} {action.option_strings or action.dest}: no help text"
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert out.startswith(f"usage: duplexbus {name}")
        flat = " ".join(out.split())  # help wraps anywhere
        if any(a.default not in (None, False) and a.option_strings for a in sub._actions if a.dest != "help"):
            assert "(default: " in flat, name
        # A help that names its default is not followed by argparse's "(default: None)" again.
        assert "(default: None)" not in flat and "(default: False)" not in flat, name
        said = sub._get_formatter()
        for a in sub._actions:
            assert (said._get_help_string(a) or "").count("default:") <= 1, (name, a.option_strings)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("duplexbus ")


HEALTH = """
import sys
from duplexbus.cli import main
code = main(["health", "--url", "http://127.0.0.1:1/healthz", "--timeout", "1"])
print(code, sorted(m for m in ("numpy", "nats", "clients.eval.command", "duplexbus.check_model") if m in sys.modules))
"""


def test_health_builds_no_parser_it_does_not_use() -> None:
    """A container's healthcheck runs it every 5 s: building every command's parser imported
    numpy, nats-py and the clients, 0.6 s of CPU each time (12 % of a core per container)."""
    out = subprocess.run([sys.executable, "-c", HEALTH], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[0] == "1 []", out.stdout + out.stderr  # unhealthy (nothing answers), nothing heavy
    assert "unhealthy: http://127.0.0.1:1/healthz" in out.stderr


def test_the_heavy_commands_are_there_for_their_own_command_line_and_for_help() -> None:
    from duplexbus.cli import LIGHT_COMMANDS, build_parser

    def commands(p: argparse.ArgumentParser) -> set[str]:
        (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return set(sub.choices)

    every = commands(build_parser())
    assert every - LIGHT_COMMANDS == {"check-model", "eval", "replay"}
    for named in (None, "--help", "eval", "replay", "check-model", "no-such-command"):
        assert commands(build_parser(named)) == every, named
    assert commands(build_parser("health")) == set(LIGHT_COMMANDS)
