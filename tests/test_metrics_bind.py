"""The conductor's and workers' /livez, /readyz and /metrics listen on `health_host`, loopback
unless the config opens them: `duplexbus up --host 0.0.0.0` (or a config whose `host` is
0.0.0.0) opens the frontends to the network, not these.

What `up` plans without processes; then two workers on the test nats-server, each with a
health port the kernel picks (`--health-port 0`), and where each listens read from the
kernel's socket table (/proc/net/tcp): loopback by default, every interface once asked."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from duplexbus.cli import build_parser, up_options
from shared.runtime.config import parse_config
from tests.support.poll import until_sync
from tests.support.stack import Proc


def test_up_leaves_the_internal_ports_on_loopback_whatever_host_the_frontends_take() -> None:
    args = build_parser().parse_args(["up", "--host", "0.0.0.0"])
    opts = up_options(args, parse_config({}))
    assert (opts.host, opts.health_host) == ("0.0.0.0", "127.0.0.1")
    assert up_options(args, parse_config({"host": "0.0.0.0"})).health_host == "127.0.0.1"
    assert up_options(args, parse_config({"health_host": "0.0.0.0"})).health_host == "0.0.0.0"


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6}: little-endian 32-bit words of hex."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def listening(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                out.append((_address(addr), int(port, 16)))
    return out


@pytest.fixture
def workers(nats_url: str) -> Iterator[dict[str, Proc]]:
    """A worker of a config whose `host` is 0.0.0.0, and one whose `health_host` is."""
    folder = Path(tempfile.mkdtemp(prefix="duplexbus-bind-"))
    env = {**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name, cfg in (("default", {"host": "0.0.0.0"}), ("opened", {"health_host": "0.0.0.0"})):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"model": "echo", **cfg}))
        argv = [sys.executable, "-m", "duplexbus.cli", "worker", "--config", str(path), "--health-port", "0"]
        procs[name] = Proc(name, argv, env, folder)
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket table (Linux)")
def test_a_workers_health_port_is_on_loopback_unless_opened(workers: dict[str, Proc]) -> None:
    def bound_of(name: str) -> list[tuple[str, int]]:
        p = workers[name]
        return until_sync(lambda: p.alive() and listening(p.p.pid), 30, f"the {name} worker listening") or []

    bound = {name: bound_of(name) for name in workers}
    assert [a for a, _ in bound["default"]] == ["127.0.0.1"], bound
    assert [a for a, _ in bound["opened"]] in (["0.0.0.0"], ["::"]), bound
    port = bound["default"][0][1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # it is the health server, and answers
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200"), port
