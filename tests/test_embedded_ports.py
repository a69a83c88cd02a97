"""An embedded nats-server is ready only once it listens on its own ports, and those are
picked by the server as it binds them, never handed over from a port found free earlier.

Before: a port found free by `free_port` and then given to nats-server could be taken by
another process in between (two suites on one machine start dozens of servers). nats-server
opens its monitor first and its client port last, so `/healthz` answered for a server that
was about to die on the taken port, and the test's client reached the other process's
server: a test that froze "its" server saw its publish acknowledged all the same."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from shared.bus import embedded
from shared.bus.embedded import NatsServer
from tests.support.bus import connected

# A stand-in for a nats-server that opens its monitor (answering 200 to everything), then
# never listens for clients: the moment of a real one that is about to fail on its port.
MONITOR_ONLY = """\
import http.server, sys
args = sys.argv[1:]
port = int(args[args.index("-m") + 1])

class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", max(port, 0)), Ok).serve_forever()
"""


def _server_id(monitor_url: str) -> str:
    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as r:
        return str(json.loads(r.read())["server_id"])


def test_a_monitor_that_answers_is_not_a_ready_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = tmp_path / "nats-server"
    stub.write_text(f"#!{sys.executable}\n{MONITOR_ONLY}")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(embedded, "find_nats_server", lambda: str(stub))
    server = NatsServer(tmp_path / "store")
    try:
        with pytest.raises(TimeoutError, match="not listening"):
            server.start(timeout=2.0)
    finally:
        server.kill()


def test_a_client_port_another_server_holds_fails_the_start(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "other") as other:
        with pytest.raises(RuntimeError, match="exited"):
            NatsServer(tmp_path / "mine", port=other.port).start(timeout=10.0)
        assert other.exited() is None


async def test_servers_started_together_are_each_reached_at_their_own_ports(tmp_path: Path) -> None:
    servers = [NatsServer(tmp_path / f"s{i}") for i in range(4)]
    try:
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
        assert len({s.port for s in servers} | {s.monitor_port for s in servers}) == 8
        for s in servers:
            async with connected(s.url) as nc:
                assert nc._server_info["server_id"] == _server_id(s.monitor_url)
    finally:
        for s in servers:
            s.stop()


async def test_a_restart_listens_on_the_ports_it_had(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "store").start()
    try:
        port, monitor = server.port, server.monitor_port
        server.stop()
        server.start()
        assert (server.port, server.monitor_port) == (port, monitor)
        async with connected(server.url) as nc:
            assert nc._server_info["server_id"] == _server_id(server.monitor_url)  # nats-py keeps INFO there
    finally:
        server.stop()


async def test_a_cluster_whose_route_port_another_process_took_starts_on_other_ones(tmp_path: Path) -> None:
    """A cluster's route ports are found free and then given to its nodes (the nodes must know
    each other's): another process may take one in between, and that node exited at once
    (seen once in a fresh clone: "nats-server exited with 1"). The nodes are made again on
    other ports, and the cluster starts."""
    cluster = embedded.NatsCluster(tmp_path)
    taken = int(cluster.nodes[1].args[cluster.nodes[1].args.index("--cluster") + 1].rsplit(":", 1)[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        with cluster:
            assert all(n.exited() is None for n in cluster.nodes)
            assert str(taken) not in " ".join(a for n in cluster.nodes for a in n.args)
            async with connected(cluster.url) as nc:
                assert (await nc.jetstream().account_info()).limits is not None
