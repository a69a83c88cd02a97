"""For rolling-upgrade tests: a stack whose processes speak two adjacent wire minors, a tap
that records which minor wrote each call message, and live calls that stream until told
to end and then check every frame came back."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import msgspec
import nats
import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from models.echo import FRAME
from shared.bus import subjects, wire
from shared.runtime.errors import ProtocolError
from tests.support import bus
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS
from tests.support.stack import Proc, Stack
from tests.support.wire_next import ADDED_FIELD

LAUNCHER = "tests.support.wire_next"  # `python -m` it: duplexbus.cli on the wire's next minor


class MixedStack(Stack):
    """A Stack whose processes named in `next_minor` run the wire's next minor."""

    def __init__(self, nats_url: str, config: dict[str, Any] | None = None, next_minor: Iterable[str] = ()) -> None:
        super().__init__(nats_url, config)
        self.next_minor = set(next_minor)
        self.gone: dict[str, Proc] = {}

    def start_conductor(self, name: str = "conductor") -> Proc:
        """`name`: a second conductor, started once the first has gone (one runs at a time)."""
        return self._start(name, self._argv("conductor"))

    def _start(self, name: str, argv: list[str], *args: Any, **kwargs: Any) -> Proc:
        if name in self.next_minor:
            argv = [LAUNCHER if a == "duplexbus.cli" else a for a in argv]
        return super()._start(name, argv, *args, **kwargs)

    async def stopped(self, name: str, timeout: float = 40.0) -> int:
        """Once process `name` has exited (a drain takes its time): its exit status. It is
        then set aside, so that `wait_ready` does not take it for a process that died."""
        status = await asyncio.to_thread(self.procs[name].p.wait, timeout)
        self.gone[name] = self.procs.pop(name)
        return status

    async def draining(self, name: str, timeout: float = 10.0) -> None:
        """Until worker `name`'s heartbeat offers no capacity: what a worker announces first
        on SIGTERM, so the conductor places no new call there from then on."""
        pid = self.procs[name].p.pid
        async with bus.connected(self.nats_url) as nc:
            kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for key in await bus.bucket_keys(kv):
                    with contextlib.suppress(NatsError, ProtocolError):  # gone since listed; not a heartbeat
                        hb = wire.decode_as((await kv.get(key)).value or b"", wire.WorkerHeartbeat)
                        if int(hb.worker_id.split("-")[1]) == pid and hb.capacity == 0:
                            return
                await asyncio.sleep(0.05)
        raise TimeoutError(f"{name} did not announce its drain")

    async def placed_on(self, rids: Iterable[str]) -> set[str]:
        """The process names of the workers the conductor placed these calls on."""
        wanted = set(rids)
        name_of = {p.p.pid: name for name, p in self.procs.items()}
        records = (await bus.call_records(self.nats_url)).values()
        return {name_of[int(w.split("-")[1])] for r in records if r.request_id in wanted for w in r.placement.values()}

    def logs(self) -> str:
        return "\n".join(f"== {p.name} (gone)\n{p.tail()}" for p in self.gone.values()) + "\n" + super().logs()


class MinorTap:
    """Every call message on the bus: kind (its tag) -> the minors that wrote it. A message
    of the next minor must carry its added field, and one of this minor must not."""

    def __init__(self) -> None:
        self.minors: dict[str, set[int]] = defaultdict(set)
        self.bad: list[dict[str, Any]] = []
        self._nc: Client | None = None

    async def start(self, nats_url: str) -> MinorTap:
        self._nc = await nats.connect(nats_url)
        await self._nc.subscribe(subjects.STREAM_SUBJECTS[0], cb=self._seen)
        await self._nc.flush()
        return self

    async def _seen(self, m: Msg) -> None:
        raw = msgspec.msgpack.decode(m.data)  # as bytes went: no reader of either minor in between
        vm = raw.get("vm", 0)
        self.minors[raw["t"]].add(vm)
        if (ADDED_FIELD in raw) != (vm > wire.MINOR):
            self.bad.append(raw)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


class LiveCall:
    """A live `echo` call on its own socket: it streams a frame every `period` s from
    `start()` until `finish()`, which ends its input and checks that every frame came back
    once, in order, byte-exact."""

    def __init__(self, url: str, rid: str, period: float = 0.04) -> None:
        self.url = url
        self.rid = rid
        self.period = period
        self.sent: list[np.ndarray] = []
        self._rng = random.Random(rid)
        self._end = asyncio.Event()
        self._ws: WS | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def ws(self) -> WS:
        if self._ws is None:
            raise RuntimeError(f"{self.rid} has not started")
        return self._ws

    async def start(self) -> LiveCall:
        self._ws = await WS.connect(self.url)
        await self.ws.send({"request_id": self.rid})
        self._task = asyncio.create_task(self._stream())
        return self

    async def _stream(self) -> None:
        while not self._end.is_set():
            frame = np.array([self._rng.randint(-32768, 32767) for _ in range(FRAME)], dtype="<i2")
            self.sent.append(frame)
            await self.ws.send({"request_id": self.rid, "append": [pcm_file(frame)]})
            await asyncio.sleep(self.period)  # the pace of a live stream, not a wait on anything
        await self.ws.send({"request_id": self.rid, "end_input": True})

    async def echoed(self, frames: int = 1, timeout: float = 30.0) -> None:
        """Until its first `frames` frames have come back (it is placed and flowing)."""
        await self.ws.until(
            lambda m: m.get("request_id") == self.rid and m.get("output", {}).get("frame", -1) >= frames - 1,
            timeout=timeout,
            keep=True,
        )

    async def finish(self, timeout: float = 60.0) -> None:
        assert self._task is not None, f"{self.rid} has not started"
        self._end.set()
        await self._task
        final = await self.ws.final(self.rid, timeout=timeout)
        assert "finish" in final, (self.rid, final)
        outs = self.ws.outputs(self.rid)
        assert [o["frame"] for o in outs] == list(range(len(self.sent))), f"{self.rid}: frames lost or repeated"
        assert echo_bytes(outs) == b"".join(f.tobytes() for f in self.sent), f"{self.rid}: bytes differ"
        await self.ws.close()

    async def abandon(self) -> None:
        """On a failed test: stop streaming and close the socket."""
        self._end.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
