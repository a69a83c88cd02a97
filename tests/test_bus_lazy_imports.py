"""aiohttp is imported by nats-py for its WebSocket transport only: a service process imports
it on first use (`shared.bus.defer_aiohttp`), not as it starts, and a `ws://` server, or a
later import of aiohttp's own, still works."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.bus.embedded import find_nats_server
from tests.support.poll import until_sync

# `duplexbus conductor` with the service's run replaced by the imports of all three services.
STARTS = """
import sys
from duplexbus import cli
def imports(args):
    import services.conductor.service, services.frontend.app, services.worker.service
    print(sorted(m for m in sys.modules if m.startswith("aiohttp.")))
    return 0
cli.cmd_conductor = imports
sys.exit(cli.main(["conductor"]))
"""


def test_no_service_imports_aiohttp_as_it_starts() -> None:
    """Its import made TLS contexts and took 0.3 s of a service's 1.2 s of imports."""
    out = subprocess.run([sys.executable, "-c", STARTS], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def ws_url(folder: Path) -> str | None:
    for ports in folder.glob("*.ports"):
        with contextlib.suppress(ValueError):  # written as we read it
            return str(json.loads(ports.read_text())["websocket"][0])
    return None


@pytest.fixture
def ws_server(tmp_path: Path) -> Iterator[str]:
    """A nats-server that also serves NATS over WebSocket, on ports of its own choosing."""
    conf = tmp_path / "ws.conf"
    conf.write_text(
        f'listen: "127.0.0.1:-1"\nwebsocket {{ listen: "127.0.0.1:-1", no_tls: true }}\nports_file_dir: "{tmp_path}"\n'
    )
    proc = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = until_sync(lambda: ws_url(tmp_path), 10, "the server's WebSocket port in its ports file")
        assert url is not None  # (until_sync returns a true value or raises)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def test_a_ws_server_is_reached_with_aiohttp_imported_on_first_use(ws_server: str) -> None:
    """In a process of its own: this one may have imported aiohttp already (a client test)."""
    reach = f"""
import asyncio, sys
from shared.bus import defer_aiohttp
defer_aiohttp()
import importlib.util, shared.bus.connection, nats
assert importlib.util.find_spec("aiohttp") is not None and "aiohttp.connector" not in sys.modules
async def main():
    nc = await nats.connect({ws_server!r}, connect_timeout=5, max_reconnect_attempts=0)
    sub = await nc.subscribe("lazy")
    await nc.publish("lazy", b"over ws")
    print((await sub.next_msg(5)).data.decode())
    await nc.close()
asyncio.run(main())
import aiohttp, aiohttp.web  # the real one, submodules and all
assert sys.modules["aiohttp"].ClientSession is aiohttp.client.ClientSession and aiohttp.web.Application
"""
    out = subprocess.run([sys.executable, "-c", reach], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "over ws", out.stdout + out.stderr
