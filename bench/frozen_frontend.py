"""A frontend of `duplexbus up --frontends 2` frozen (SIGSTOP) while new calls come in.

Both frontends accept on the one port (SO_REUSEPORT): the kernel hands each new socket to
one of them, the frozen one included. `up` probes each frontend's /livez on a port of its own
and, past `liveness_s` (5 s by default) without an answer, kills it (SIGKILL) and starts a
new one on the same listening socket, which accepts what waited there. Measured: each new
call's time from its connect to its finish, calls started one every `--every` seconds from
the freeze on; and when `up` killed the frozen frontend.

    .venv/bin/python -m bench.frozen_frontend --freeze 10 --calls 12
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time

from websockets.exceptions import WebSocketException

from bench.machine import machine
from tests.support.calls import EchoCall
from tests.support.stack import UpStack


async def one_try(stack: UpStack, rid: str, timeout: float) -> str:
    """How one try of a short call ended: "exact", or why not."""
    try:
        call = await EchoCall.open(stack.ws_url(), rid, frames=3)
        final = await call.end(timeout=timeout)
        await call.ws.close()
    except (TimeoutError, OSError, WebSocketException) as e:  # reset, refused, no answer
        return type(e).__name__
    if "finish" in final:
        call.check(final)
        return "exact"
    return f"error {final.get('status', final)}"


async def timed_call(stack: UpStack, rid: str, timeout: float) -> tuple[float, list[str]]:
    """(seconds from the first connect to the call served exact, how each try ended), trying
    again at once as a client does after a reset, a refusal or a 503."""
    start = time.monotonic()
    tries: list[str] = []
    while time.monotonic() - start < timeout:
        tries.append(await one_try(stack, f"{rid}-{len(tries)}", timeout))
        if tries[-1] == "exact":
            break
    return time.monotonic() - start, tries


async def thaw_after(pid: int, seconds: float) -> None:
    await asyncio.sleep(seconds)
    try:
        os.kill(pid, signal.SIGCONT)
        print(f"the frozen frontend (pid {pid}) was still there after {seconds:.0f} s: thawed")
    except ProcessLookupError:
        pass


async def run(args: argparse.Namespace) -> None:
    killed_at: list[float] = []
    with UpStack("echo", frontends=2, workers=1, log_level="WARNING") as stack:
        frontends = sorted(pid for pid, role in stack.processes().items() if role == "frontend")
        frozen = frontends[0]
        os.kill(frozen, signal.SIGSTOP)
        start = time.monotonic()
        said = asyncio.ensure_future(asyncio.to_thread(stack.wait_for, "killing it"))
        said.add_done_callback(
            lambda f: killed_at.append(time.monotonic() - start) if not f.cancelled() and not f.exception() else None
        )
        thaw = asyncio.create_task(thaw_after(frozen, args.freeze))
        calls = []
        for i in range(args.calls):
            calls.append(asyncio.create_task(timed_call(stack, f"new-{i}", args.freeze + 20)))
            await asyncio.sleep(args.every)
        results = await asyncio.gather(*calls)
        await thaw
        killed = [line.strip() for line in stack.lines if "killing it" in line]
    waits = [w for w, _ in results]
    slow = [w for w in waits if w > 1.0]
    served = sum(1 for _, tries in results if tries[-1] == "exact")
    retried = [tries for _, tries in results if len(tries) > 1]
    print(f"machine: {machine()}")
    print(f"frontend {frozen} frozen {args.freeze:.0f} s; {args.calls} new calls, one every {args.every} s from the freeze")
    print(f"served exact: {served} of {len(results)}; tried again: {len(retried)} {retried}")
    print(f"time to served (s): {', '.join(f'{w:.1f}' for w in waits)}")
    print(f"over 1 s: {len(slow)} of {len(waits)} (longest {max(waits):.1f} s); median {statistics.median(waits):.2f} s")
    when = f", {killed_at[0]:.1f} s after the freeze" if killed_at else ""
    print(f"up said: {killed or 'nothing'}{when}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--freeze", type=float, default=10.0)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--every", type=float, default=0.5)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
