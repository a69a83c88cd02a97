"""`make up` as a person runs it: starts in seconds when installed, serves, and Ctrl-C leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from shared.bus.embedded import free_port
from shared.sdk.audio import encode_wav
from tests.support import REPO
from tests.support.poll import until_sync
from tests.support.realtime import sdk_echo_is_byte_exact
from tests.support.stack import listening, procs_mentioning


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_make_test_says_why_a_test_was_skipped(tmp_path: Path, target: str) -> None:
    """A skip (the compose test with no engine, say) shows its reason in one line, not only a count."""
    skipped = tmp_path / "test_skipped.py"
    skipped.write_text('import pytest\n\n\ndef test_it() -> None:\n    pytest.skip("no engine here: the reason")\n')
    # The pytest line `make` would run, with the suite swapped for the one skipping file. `make
    # test` runs scripts/test.sh, whose every pytest run takes the options of its `pytest` function.
    plan = subprocess.run(["make", "-n", "-s", target, f"ARGS={skipped}"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert plan.returncode == 0, plan.stderr
    if target == "test":
        assert any(x.endswith(f"bash scripts/test.sh {skipped}") for x in plan.stdout.splitlines()), plan.stdout
        script = (REPO / "scripts" / "test.sh").read_text().splitlines()
        body = next(x for x in script if x.startswith("pytest() {")).removeprefix("pytest() {").removesuffix("; }")
        argv = [sys.executable if a == "$PY" else a for a in shlex.split(body) if a != "$@"] + [str(skipped)]
    else:
        argv = shlex.split(next(x for x in plan.stdout.splitlines() if " -m pytest " in x))
        argv[0] = sys.executable
    ran = subprocess.run(
        [*argv, "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "SKIPPED" in ran.stdout and "no engine here: the reason" in ran.stdout, ran.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_up_serves_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    env = {**os.environ}
    env.pop("NATS_URL", None)  # the embedded server, as on a fresh machine
    args = f"--model echo --port {port} --run-dir {run_dir}"
    start = time.monotonic()
    make = subprocess.Popen(
        ["make", "-s", "up", f"ARGS={args}"], cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = start + 120
        ready = False
        while time.monotonic() < deadline and make.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    ready = r.status == 200
            except OSError:
                pass
            if ready:
                break
            time.sleep(0.1)
        startup = time.monotonic() - start
        assert ready, f"not ready; make exited {make.poll()}"
        # Already installed: no pip run, so start-up takes seconds.
        assert startup < 30, f"make up took {startup:.1f}s to serve"

        samples = (np.sin(np.arange(16000 * 2) / 7) * 9000).astype("<i2")
        wav = tmp_path / "in.wav"
        wav.write_bytes(encode_wav(samples, 16000))
        reply = tmp_path / "reply.wav"
        call = subprocess.run(
            [sys.executable, "-m", "duplexbus.cli", "call", str(wav), "--fast", "--quiet", "--out", str(reply),
             "--url", f"ws://127.0.0.1:{port}/generate/ws"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert call.returncode == 0, call.stderr
        import wave

        with wave.open(str(reply)) as w:
            got = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        assert np.array_equal(got[: len(samples)], samples)
        assert not got[len(samples) :].any()
        # A client nobody here wrote: the official SDK over /v1/realtime, on the same stack.
        asyncio.run(sdk_echo_is_byte_exact(port))
    finally:
        os.killpg(make.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            out, _ = make.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            out, _ = make.communicate()
            pytest.fail(f"make up did not stop on Ctrl-C:\n{out}")
    assert "stopped" in out
    nats_url = next(line.split(" on ")[1].split(",")[0] for line in out.splitlines() if "nats-server (embedded)" in line)
    nats_at = nats_url.removeprefix("nats://")  # host:port; the children's NATS_URL has credentials before it

    def all_gone() -> bool:  # a child may be reaped a moment after make itself exits
        return not (procs_mentioning(str(run_dir)) or procs_mentioning(f"@{nats_at}") or listening(port))

    with contextlib.suppress(TimeoutError):  # what is left is named by the asserts below
        until_sync(all_gone, 10, "make up's processes gone")
    assert not procs_mentioning(str(run_dir)), procs_mentioning(str(run_dir))
    # every child had NATS_URL set to the embedded server: none of them is left
    assert not procs_mentioning(f"@{nats_at}"), procs_mentioning(nats_at)
    assert not listening(port)
    assert not listening(int(nats_url.rsplit(":", 1)[1]))
    assert not (run_dir / "nats.url").exists()  # the credentials go with the server
