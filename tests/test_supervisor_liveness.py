"""`duplexbus up` replaces a child that stops answering its /livez (frozen) or says it cannot
recover (503): the decision pure (LivenessJudge), its wiring with scripted probes (Prober,
no process), and once with a real child frozen by SIGSTOP (a few seconds). A frontend that
dies while others share the port leaves the port's group until the next one serves."""

from __future__ import annotations

import http.server
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, cast

import pytest

from duplexbus.liveness import Life, LivenessJudge, Probe
from duplexbus.supervisor import POLL_S, PROBE_S, PROBE_TIMEOUT_S, Child, Prober, listen, probe_livez, renew, tend
from shared.bus.embedded import free_port
from tests.support.freeze import frozen
from tests.support.poll import until_sync


def test_a_new_child_has_its_grace_then_is_judged_by_silence() -> None:
    j = LivenessJudge(5.0)
    j.started(0.0, grace_s=120.0)
    assert {j.heard(Probe.SILENT, float(t)) for t in range(125)} == {Life.STARTING}  # a model loading for 2 minutes
    assert j.heard(Probe.LIVE, 124.5) is Life.LIVE
    j.started(200.0, grace_s=120.0)
    assert j.heard(Probe.SILENT, 324.9) is Life.STARTING
    assert j.heard(Probe.SILENT, 325.0) is Life.REPLACING  # never answered: frozen, or stuck starting
    assert "not once since it started" in j.why


def test_silent_for_its_bound_after_an_answer_it_is_replaced() -> None:
    j = LivenessJudge(5.0)
    j.started(0.0)
    j.heard(Probe.LIVE, 1.0)
    assert [j.heard(Probe.SILENT, t) for t in (2.0, 4.0, 5.9)] == [Life.SILENT] * 3
    assert j.heard(Probe.SILENT, 6.0) is Life.REPLACING
    assert "not answered for 5.0 s" in j.why


def test_an_answer_within_the_bound_keeps_it() -> None:
    j = LivenessJudge(5.0)
    j.started(0.0)
    states = [j.heard(Probe.LIVE if t % 4 == 0 else Probe.SILENT, float(t)) for t in range(1, 60)]
    assert Life.REPLACING not in states and Life.SILENT in states


@pytest.mark.parametrize("before", [None, Probe.LIVE, Probe.SILENT], ids=["starting", "live", "silent"])
def test_a_503_replaces_it_at_once(before: Probe | None) -> None:
    j = LivenessJudge(5.0)
    j.started(0.0)
    if before is not None:
        j.heard(Probe.LIVE, 0.5)
        j.heard(before, 1.0)
    assert j.heard(Probe.FAILING, 1.5) is Life.REPLACING
    assert "cannot recover" in j.why


def test_the_one_being_killed_adds_nothing_and_its_successor_starts_over() -> None:
    j = LivenessJudge(5.0)
    j.started(0.0)
    j.heard(Probe.FAILING, 1.0)
    assert j.heard(Probe.LIVE, 1.1) is Life.REPLACING  # the old process's last word
    j.started(2.0, grace_s=120.0)
    assert j.heard(Probe.SILENT, 60.0) is Life.STARTING


class FakeProc:
    """What the supervisor uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


class AtOnce(Executor):
    """Runs each probe as it is submitted: the test's time is the only clock."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(fn(*args, **kwargs))
        return f


def fake_child(name: str, pid: int, port: int) -> tuple[Child, FakeProc]:
    proc = FakeProc(pid)
    return Child(name, ["duplexbus", "frontend", "--health-port", str(port)], order=0, proc=cast(Any, proc)), proc


def test_the_prober_kills_a_child_silent_past_its_bound_and_judges_the_new_one_afresh(
    capsys: pytest.CaptureFixture[str],
) -> None:
    child, first = fake_child("frontend-1", 100, 9101)
    other, _ = fake_child("frontend-0", 99, 9100)
    answers = {9100: Probe.LIVE, 9101: Probe.LIVE}
    asked: list[str] = []

    def probe(url: str) -> Probe:
        asked.append(url)
        return answers[int(url.split(":")[2].split("/")[0])]

    prober = Prober([other, child], "0.0.0.0", bound_s=3.0, start_grace_s=120.0, probe=probe, pool=AtOnce())
    t = 0.0

    def run_until(end: float) -> None:
        nonlocal t
        while t < end:
            prober.tend([other, child], t)
            t = round(t + POLL_S, 3)

    run_until(1.0)
    assert prober.state("frontend-1") is Life.LIVE and asked[0] == "http://127.0.0.1:9100/livez"  # loopback for 0.0.0.0
    answers[9101] = Probe.SILENT  # frozen from here
    run_until(3.2)  # its last answer heard at 0.2
    assert prober.state("frontend-1") is Life.SILENT and first.returncode is None
    run_until(3.4)
    assert first.returncode == -9  # killed, the bound after its last answer
    assert prober.state("frontend-0") is Life.LIVE  # the other one left alone
    assert "frontend-1 (pid 100): its /livez has not answered for 3.0 s; killing it (SIGKILL)" in capsys.readouterr().out
    second = FakeProc(101)  # the restart loop started it again
    child.proc = cast(Any, second)
    run_until(100.0)
    assert prober.state("frontend-1") is Life.STARTING and second.returncode is None  # silent, within its start grace
    answers[9101] = Probe.LIVE
    run_until(101.0)
    answers[9101] = Probe.FAILING  # its connection lost for good: it says so
    run_until(102.0)
    assert second.returncode == -9


def test_a_child_silent_from_the_prober_s_first_pass_is_replaced_after_the_bound() -> None:
    """The children there at the first pass have been seen ready: no grace (frozen right after
    `up` said it serves, a frontend would otherwise keep its share of the port for good)."""
    child, proc = fake_child("frontend-0", 100, 9100)
    prober = Prober([child], "127.0.0.1", bound_s=3.0, start_grace_s=120.0, probe=lambda url: Probe.SILENT, pool=AtOnce())
    t = 0.0
    while proc.returncode is None and t < 10.0:
        prober.tend([child], t)
        t = round(t + POLL_S, 3)
    assert proc.returncode == -9 and 3.0 <= t <= 3.0 + PROBE_S + POLL_S


HTTP_CHILD = """
import http.server, sys
class Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Live).serve_forever()
"""


def test_a_frozen_child_is_killed_and_a_new_one_answers_within_its_bound(tmp_path: Path) -> None:
    child = Child("frontend-0", [sys.executable, "-c", HTTP_CHILD, "--health-port", str(free_port())], order=0)
    child.start({}, tmp_path)
    url = f"http://127.0.0.1:{child.health_port}/livez"
    until_sync(lambda: probe_livez(url) is Probe.LIVE, 10.0, "the child answering", POLL_S)
    prober = Prober([child], "127.0.0.1", bound_s=2.0, start_grace_s=10.0)

    def supervised(done: Callable[[], bool]) -> Callable[[], bool]:
        def step() -> bool:
            now = time.monotonic()
            prober.tend([child], now)
            tend([child], {}, tmp_path, now)
            return done()

        return step

    try:
        until_sync(supervised(lambda: prober.state("frontend-0") is Life.LIVE), 10.0, "the child answering", POLL_S)
        assert child.proc is not None
        pid = child.proc.pid
        with frozen(pid):
            start = time.monotonic()
            until_sync(supervised(lambda: child.proc is not None and child.proc.pid != pid), 10.0, "a new child", POLL_S)
            replaced = time.monotonic() - start
        until_sync(supervised(lambda: prober.state("frontend-0") is Life.LIVE), 10.0, "the new child answering", POLL_S)
        answering = time.monotonic() - start
        print(f"frozen child replaced after {replaced:.1f} s, the new one answering after {answering:.1f} s")
        assert probe_livez(url) is Probe.LIVE
        # The bound, then up to a probe's period and timeout until it is heard silent, and the restart's backoff.
        assert replaced < 2.0 + PROBE_S + PROBE_TIMEOUT_S + 0.5 + 1.0
    finally:
        prober.close()
        if child.proc is not None:
            child.proc.kill()
            child.proc.wait()


class Answers(http.server.BaseHTTPRequestHandler):
    """/livez answers 200, /lost 503, /other 404."""

    def do_GET(self) -> None:
        self.send_response({"/livez": 200, "/lost": 503}.get(self.path, 404))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_probe_livez_tells_an_answer_a_503_and_silence_apart() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe_livez(f"{base}/livez") is Probe.LIVE
        assert probe_livez(f"{base}/lost") is Probe.FAILING  # its word that it cannot recover
        assert probe_livez(f"{base}/other") is Probe.LIVE  # it answers: alive, whatever it says of that path
    finally:
        server.shutdown()
        server.server_close()
    assert probe_livez(f"{base}/livez", timeout=0.5) is Probe.SILENT  # nothing listens any more


def was_reset(c: socket.socket) -> bool:
    try:
        return c.recv(1) == b""  # (once told of its reset, it reads as closed)
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


def test_a_renewed_socket_keeps_its_descriptor_takes_no_connection_and_resets_what_waited() -> None:
    """`up --frontends N`: a dead frontend's socket leaves the group (renew), so that new
    connections go to the others until the next frontend listens on the new one."""
    group = listen("127.0.0.1", free_port(), 2)
    port = group[0].getsockname()[1]
    waiting: list[socket.socket] = []
    try:
        while len(waiting) < 40:  # some land on each socket of the group (the kernel hashes them)
            waiting.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        dead, live = group
        fd = dead.fileno()
        renew(dead)
        assert dead.fileno() == fd and dead.getsockname()[1] == port
        assert dead.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0  # bound, not listening
        for c in waiting:
            c.setblocking(False)
        # Those queued on the old socket are reset; the others wait to be accepted.
        reset = until_sync(lambda: sum(was_reset(c) for c in waiting), 2.0, "connections reset")
        assert reset < len(waiting)
        live.settimeout(2)
        for _ in range(len(waiting) - reset):  # what the live socket held
            live.accept()[0].close()
        late = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        for _ in late:  # every new connection goes to the live socket
            live.accept()[0].close()
        waiting += late
        dead.listen()  # as the next frontend does when it starts serving: in the group again
        assert dead.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    finally:
        for s in [*waiting, *group]:
            s.close()


def test_the_loop_tells_of_each_exit_once_as_it_is_noticed(tmp_path: Path) -> None:
    child = Child("frontend-0", [sys.executable, "-c", "pass"], order=0)
    child.start({}, tmp_path)
    assert child.proc is not None
    child.proc.wait(10)
    told: list[str] = []
    now = time.monotonic()
    for t in (now, now + 0.1, now + 0.2):  # within the restart's backoff: noticed once
        tend([child], {}, tmp_path, t, exited=lambda c: told.append(c.name))
    assert told == ["frontend-0"]
