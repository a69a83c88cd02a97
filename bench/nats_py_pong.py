"""A minimal reproduction, without duplexbus, of nats-py's deaf connection after a server pause.

nats-py's `flush(timeout)` sends a PING and waits for its PONG; on a timeout it cancels its
future but leaves it in the client's list of futures awaiting a PONG. When the server wakes
and answers, the read loop pops that cancelled future and sets its result: InvalidStateError,
which the read loop logs ("nats: encountered error") and dies of. The client still says it
is connected and still writes, but reads nothing more (no message, no reply, no PONG) until
its stale-connection check reconnects it: `max_outstanding_pings` (2) + 1 pings of
`ping_interval` (120 s) later, about 6 minutes by default.

    .venv/bin/python -m bench.nats_py_pong              # nats-py as it is: deaf
    .venv/bin/python -m bench.nats_py_pong --patched    # with the guard proposed upstream

It prints what it sees and exits 1 when the connection is deaf after the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from shared.bus.embedded import NatsServer

PAUSE_S = 2.0


class PatchedClient(Client):
    """nats-py's client with the patch proposed for `Client._process_pong`: a PONG whose
    waiter gave up (its future cancelled by a flush timeout) is consumed, not set."""

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


async def reproduce(client: type[Client] = Client) -> bool:
    """Whether a connection made with `client` still hears after the pause."""
    with tempfile.TemporaryDirectory(prefix="nats-py-pong-") as store, NatsServer(store) as server:
        assert server.proc is not None
        listener = client()
        await listener.connect(server.url)
        talker = await nats.connect(server.url)
        heard: list[bytes] = []

        async def on_msg(msg: Msg) -> None:
            heard.append(msg.data)

        await listener.subscribe("probe", cb=on_msg)
        await listener.flush()

        os.kill(server.proc.pid, signal.SIGSTOP)  # a GC pause, a disk stall, a VM hiccup
        start = time.monotonic()
        try:
            await listener.flush(timeout=1)
        except NatsTimeout:
            print(f"flush(timeout=1) timed out after {time.monotonic() - start:.1f} s during the pause, as it should")
        await asyncio.sleep(PAUSE_S - (time.monotonic() - start))
        os.kill(server.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.5)  # the server answers the late PONG

        reading = listener._reading_task is not None and not listener._reading_task.done()
        print(f"after the pause: is_connected={listener.is_connected}, read loop running={reading}")
        t = time.monotonic()
        await listener.flush(timeout=1)  # with a dead read loop, nats-py returns at once: no round trip
        print(f"flush() answered in {1000 * (time.monotonic() - t):.1f} ms (without a round trip where the read loop is dead)")
        await talker.publish("probe", b"hello")
        await talker.flush()
        for _ in range(20):
            if heard:
                break
            await asyncio.sleep(0.1)
        print(f"a message published after the pause: {'heard' if heard else 'NOT heard (the connection is deaf)'}")
        await talker.close()
        await listener.close()
        return bool(heard)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patched", action="store_true", help="with the patch proposed for _process_pong")
    args = parser.parse_args()
    return 0 if asyncio.run(reproduce(PatchedClient if args.patched else Client)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
