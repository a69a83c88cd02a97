"""`duplexbus up` leaves nothing behind and refuses what would collide, and every service
stops on SIGTERM, NATS reachable or not. Real processes throughout.

- a SIGKILLed supervisor takes every child with it, the embedded nats-server included;
- a second `up` on a taken port, or on a NATS store another server holds, refuses at once
  with one clear line and starts nothing;
- the embedded nats-server has credentials: a client without them is refused; a SIGKILLed
  nats-server is restarted and calls go on;
- the CLI finds the embedded server's URL in the run directory (replay right after up) and
  says in one line, quickly, when it cannot reach NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import numpy as np
import pytest
import yaml
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoServersError

from duplexbus.supervisor import saved_nats_url
from models.echo import FRAME
from shared.bus import subjects
from shared.bus.embedded import NatsServer, StoreInUse, free_port
from shared.runtime.process import stop_bound_s
from tests.support.audio import echo_bytes, pcm_file
from tests.support.bus import bucket_keys, connected, own_nats_server
from tests.support.client import WS
from tests.support.poll import until_sync
from tests.support.stack import UpStack, listening, procs_mentioning, running_stack

PY = [sys.executable, "-m", "duplexbus.cli"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}  # the embedded server, as on a fresh machine
    env["PYTHONUNBUFFERED"] = "1"
    return env


# shutdown_unlist_s 0: no gateway here waits for a stopping frontend's 503, and each stop of `up`
# would take 3 s more for it.
UP_CONFIG = {"shutdown_drain_s": 1.0, "heartbeat_s": 0.5, "shutdown_unlist_s": 0.0}


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpStack]:
    """`duplexbus up --model echo` in its own run directory, serving: for a test that ends it."""
    with UpStack("echo", config=UP_CONFIG, folder=tmp_path, log_level=None) as u:
        yield u


@pytest.fixture(scope="module")
def shared_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    """One `up` for the tests that leave it serving (a second `up` refused beside it, replay
    through its run directory, its nats-server killed and restarted): a boot and a stop less
    for each."""
    with UpStack("echo", config=UP_CONFIG, folder=tmp_path_factory.mktemp("up"), log_level=None) as u:
        yield u


def wait_until(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


async def echo_call(port: int, rid: str) -> None:
    ws = await WS.connect(f"ws://127.0.0.1:{port}/generate/ws")
    try:
        samples = (np.arange(5 * FRAME) % 7000).astype("<i2")
        await ws.send({"request_id": rid, "files": [pcm_file(samples)], "end_input": True})
        final = await ws.final(rid, timeout=60)
        assert "finish" in final, final
        assert echo_bytes(ws.outputs(rid)) == samples.tobytes()
    finally:
        await ws.close()


def _started(pid: int) -> int | None:
    """When the process `pid` started (in clock ticks since boot), or None where there is no
    such process, or only its zombie. A pid the kernel gave to a new process since reads as
    another start time: that process is not the one recorded."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def test_a_killed_supervisor_takes_every_child_with_it(up: UpStack) -> None:
    """Every child `up` started (the conductor, the frontend, the workers, the nats-server),
    recorded by pid before the kill, is gone within its stop bound after it."""
    nats_port = int(up.lines[0].split(" on ")[1].split(",")[0].rsplit(":", 1)[1])
    children = {pid: role for pid, role in up.processes().items() if pid != up.proc.pid}
    roles = sorted(set(children.values()))
    assert {"conductor", "frontend", "nats-server"} <= set(roles) and any(r.startswith("worker") for r in roles), roles
    started = {pid: _started(pid) for pid in children}
    os.kill(up.proc.pid, signal.SIGKILL)  # the supervisor alone, not its group
    up.proc.wait(10)
    killed = time.monotonic()
    # Each child gets SIGTERM from the kernel and stops within its bound (stop_bound_s), NATS
    # gone as well (it got one too); 5 s more for a loaded machine.
    bound = stop_bound_s(1.0) + 5

    def left() -> dict[int, str]:
        return {pid: role for pid, role in children.items() if started[pid] is not None and _started(pid) == started[pid]}

    try:
        wait_until(lambda: not left(), bound, "")
    except TimeoutError:
        pytest.fail(f"left behind {bound:.0f} s after the supervisor was killed: {left()}")
    finally:
        for pid in left():  # leave nothing to the next test
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    print(f"{len(children)} children ({', '.join(roles)}) gone {time.monotonic() - killed:.1f} s after the kill")
    assert not listening(up.port) and not listening(nats_port)


def test_a_second_up_on_a_taken_port_refuses_at_once_and_starts_nothing(shared_up: UpStack, tmp_path: Path) -> None:
    other = tmp_path / "other"
    start = time.monotonic()
    second = subprocess.run(
        [*PY, "up", "--model", "echo", "--port", str(shared_up.port), "--run-dir", str(other)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second
    assert time.monotonic() - start < 20
    assert f"cannot serve on 127.0.0.1:{shared_up.port}" in second.stderr and "--port" in second.stderr
    assert "serving" not in second.stdout
    assert not procs_mentioning(str(other))
    assert not (other / "nats").exists()  # no nats-server was started


def test_a_second_up_on_a_held_nats_store_refuses(shared_up: UpStack) -> None:
    second = subprocess.run(
        [*PY, "up", "--model", "echo", "--port", str(free_port()), "--run-dir", str(shared_up.run_dir)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second
    assert "is in use by another nats-server (pid" in second.stderr
    assert second.stderr.count("\n") == 1  # one line, no traceback


def test_an_embedded_store_is_held_by_one_server_at_a_time(tmp_path: Path) -> None:
    with NatsServer(tmp_path) as first:
        assert first.proc is not None
        with pytest.raises(StoreInUse) as e:
            NatsServer(tmp_path).start()
        assert f"pid {first.proc.pid}" in str(e.value)
        first.kill()
        with NatsServer(tmp_path, port=first.port):  # free again once its server is gone
            pass


def test_replay_finds_the_embedded_server_after_up_and_fails_fast_without_one(shared_up: UpStack, tmp_path: Path) -> None:
    asyncio.run(echo_call(shared_up.port, "for-replay"))
    listing = subprocess.run(
        [*PY, "replay", "nosuchcall", "--run-dir", str(shared_up.run_dir)], env=_env(), capture_output=True, text=True, timeout=60
    )
    # It reached the bus with the saved URL: the answer is about the call, not about NATS.
    assert "no call with cid or request_id 'nosuchcall'" in listing.stdout, listing
    start = time.monotonic()
    down = subprocess.run(
        [*PY, "replay", "x", "--nats-url", "nats://127.0.0.1:1"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert down.returncode == 1 and time.monotonic() - start < 10
    assert down.stderr.strip().splitlines() == ["error: connecting to nats://127.0.0.1:1: no server answered"]
    nowhere = subprocess.run(
        [*PY, "replay", "x", "--run-dir", str(tmp_path / "none")], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert nowhere.returncode == 1 and "no NATS URL" in nowhere.stderr and "Traceback" not in nowhere.stderr


async def _on_the_bus(nats_url: str, role: str) -> bool:
    """The service is up on the bus: its durable consumer is there (conductor), or its
    heartbeat is stored (worker, frontend)."""
    async with connected(nats_url) as nc:
        js = nc.jetstream()
        try:
            if role == "conductor":
                await js.consumer_info(subjects.STREAM, subjects.CONDUCTOR_DURABLE)
                return True
            kv = await js.key_value(subjects.KV_WORKERS if role == "worker" else subjects.KV_FRONTENDS)
            return bool(await bucket_keys(kv, tries=1))
        except NatsError:  # not made yet
            return False


async def test_the_embedded_server_wants_credentials_and_comes_back_when_killed(shared_up: UpStack) -> None:
    nats_url = shared_up.lines[0].split(" on ")[1].split(",")[0]  # as printed: no credentials
    third_party = Client()  # its own object: nats-py leaves a refused first attempt's socket open
    with pytest.raises((nats.errors.Error, NoServersError, OSError)):  # a third party: refused
        await third_party.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=2)
    await third_party.close()
    saved = saved_nats_url(shared_up.run_dir)
    assert saved is not None and "@" in saved
    assert (shared_up.run_dir / "nats.url").stat().st_mode & 0o077 == 0  # readable by this user alone
    nc = await nats.connect(saved)  # with them: in
    await nc.close()
    nats_pid = next(int(p.split(":")[0]) for p in procs_mentioning(str(shared_up.run_dir / "nats")) if "nats-server" in p)
    os.kill(nats_pid, signal.SIGKILL)
    line = await asyncio.to_thread(shared_up.wait_for, "nats-server exited")
    assert "restarting" in line
    await echo_call(shared_up.port, "after-restart")  # the services reconnected to the restarted server


def _on_the_bus_sync(nats_url: str, role: str) -> bool:
    return asyncio.run(_on_the_bus(nats_url, role))


ROLES = ("conductor", "worker", "frontend")


def test_every_service_stops_on_sigterm_with_nats_out_of_reach(tmp_path: Path) -> None:
    """NATS gone before the service could connect, and gone while it ran: SIGTERM ends it
    within its drain and grace (1 + 5 s here), never waiting on the bus. Each role in both
    cases, the six processes at once (one after another, each case's waits were the test's
    time three times over)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "echo", "shutdown_drain_s": 1.0}))
    with own_nats_server("duplexbus-sigterm-") as server:
        cases = {"never there": f"nats://127.0.0.1:{free_port()}", "gone meanwhile": server.url}
        procs = {}
        for role in ROLES:
            for case, url in cases.items():
                extra = ["--port", str(free_port())] if role == "frontend" else []
                procs[role, case] = subprocess.Popen(
                    [*PY, role, "--config", str(cfg), *extra],
                    env={**_env(), "NATS_URL": url},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
        # The ones started on the live server are connected and serving; the others have been
        # trying for at least as long.
        for role in ROLES:
            until_sync(functools.partial(_on_the_bus_sync, server.url, role), 30, f"the {role} up on the bus")
        server.kill()
    time.sleep(1)  # a moment without the server: none exits of it (what is checked next)
    for (role, case), p in procs.items():
        assert p.poll() is None, f"{role} ({case}) exited before the signal"
    start = time.monotonic()
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    late, failed = [], []
    for (role, case), p in procs.items():
        try:
            # (The frontend ends as uvicorn does: the signal raised again once it has stopped.)
            if p.wait(max(0.1, start + 15 - time.monotonic())) not in (0, -signal.SIGTERM if role == "frontend" else 0):
                failed.append(f"{role} ({case}): {p.returncode}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            late.append(f"{role} ({case})")
    assert not late, f"not stopped within 15 s of SIGTERM: {late}"
    # Cleanly: a worker whose server was gone crashed on its way out (nats-py closed its
    # connection onto a transport already closed) and exited 1.
    assert not failed, f"stopped with an error: {failed}"


LIVE_CALLS = 8


async def test_a_frontend_with_live_calls_stops_within_its_bound_on_sigterm_with_nats_frozen() -> None:
    """NATS frozen (SIGSTOP: connected, answering nothing) under 8 live calls. Each call's
    abort waits on round trips that time out after seconds; one call after another that was
    over a minute. SIGTERM ends the frontend within its bound (stop_bound_s: shutdown_drain_s
    + 10 s), and every client is told that the frontend is stopping."""
    drain_s = 1.0
    bound = stop_bound_s(drain_s)
    with own_nats_server("duplexbus-stop-live-") as server:
        async with running_stack(server.url, {"shutdown_drain_s": drain_s}) as stack:
            sockets = [await WS.connect(stack.ws_url()) for _ in range(2)]
            rids = [f"live-{i}" for i in range(LIVE_CALLS)]
            samples = (np.arange(FRAME) % 7000).astype("<i2")
            for i, rid in enumerate(rids):  # live: their input stays open
                await sockets[i % 2].send({"request_id": rid, "files": [pcm_file(samples)]})
            for i, rid in enumerate(rids):
                await sockets[i % 2].until(lambda m, rid=rid: m.get("request_id") == rid and "output" in m, timeout=30)
            assert server.proc is not None
            frontend = stack.procs["frontend-0"]
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                frontend.p.terminate()
                start = time.monotonic()
                try:
                    await asyncio.to_thread(frontend.p.wait, bound + 10)
                except subprocess.TimeoutExpired:
                    frontend.kill()
                    pytest.fail(f"the frontend did not stop within {bound + 10:.0f} s of SIGTERM:\n{frontend.tail()}")
                took = time.monotonic() - start
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)  # the rest of the stack stops as usual
            assert took < bound + 1.0, f"{took:.1f} s, bound {bound:.0f} s:\n{frontend.tail()}"
            for i, rid in enumerate(rids):
                m = await sockets[i % 2].final(rid, timeout=1)
                assert m.get("status") == 503 and "stopping" in m["error"], m
            for ws in sockets:
                with contextlib.suppress(Exception):
                    await ws.close()
            print(f"stopped in {took:.1f} s (bound {bound:.0f} s), exit {frontend.p.returncode}\n{frontend.tail(8)}")
