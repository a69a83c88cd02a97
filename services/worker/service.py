"""The worker's shell: its lifecycle (start, heartbeats, drain, stop), wiring its parts.

A worker runs one or more partitions of one model. Its parts, each with the tasks it owns:
`assignment.Assignment` answers the conductor's assignments; `intake.Intake` takes each
assigned call's input, live and by catch-up reads of the stream (when to read, and how much
to hold, are the pure `repair.InputReads` and `flow.Bounds`); `stepper.Stepper` steps the
engines (`engine.Engine`, pure) and publishes what they make.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from models.registry import served_model
from services.worker import engine as eng
from services.worker.assignment import Assignment
from services.worker.calls import AssignedCall, Context, Runner
from services.worker.flow import Bounds
from services.worker.intake import Intake
from services.worker.stepper import Stepper
from services.worker.stuck import Health, Sample, StuckWatch
from shared.bus import subjects, wire
from shared.bus.connection import BusConnection
from shared.bus.life import SignsOfLife
from shared.bus.readiness import Readiness
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusError, ConfigError
from shared.runtime.health import HealthServer
from shared.runtime.metrics import WorkerMetrics
from shared.runtime.process import cancel_and_wait, exit_after, stop_bound_s
from shared.runtime.version import VERSION

log = logging.getLogger(__name__)


class WorkerService:
    def __init__(
        self,
        config: ServingConfig,
        model: str,
        partitions: list[str] | None = None,
        worker_id: str | None = None,
        health_port: int | None = None,
    ) -> None:
        self.config = config
        self.metrics = WorkerMetrics()
        self.metrics.live_calls.set_function(lambda: len(self.calls))
        self.readiness = Readiness(config.heartbeat_s)
        self.health_port = health_port  # /livez, /readyz, /metrics on it (None: not served)
        self.model = served_model(model)
        self.model_name = self.model.name  # on the wire: the name a frontend opens calls of it by
        topo = self.model.topology
        self.partitions = partitions or list(topo.partitions)
        for p in self.partitions:
            if p not in topo.partitions:
                raise ConfigError("partition", f"model {model!r} has no partition {p!r}; it has {', '.join(topo.partitions)}")
        self.worker_id = worker_id or subjects.new_process_id("worker")
        self.runners: dict[str, Runner] = {}
        for p in self.partitions:
            part = self.model.create_partition(p)
            self.runners[p] = Runner(
                eng.Engine(p, topo, part, max_batch=config.max_batch, tick_s=eng.TICK_S),
                blocking=getattr(part, "blocking", True),
            )
        self._bus: BusConnection | None = None
        self._accepting = True
        bounds = Bounds(config.worker_call_buffer_bytes, config.worker_buffer_bytes)  # flow control
        # The intake hands what it takes to the stepper, which hands edges within this
        # process back to it: the one is built first, with the other's carry_out behind a method.
        ctx = Context(self.worker_id, lambda: self.bus, self.runners, self.metrics, self.model.binary_fields)
        self.intake = Intake(ctx, topo, bounds, self._carry_out)
        self.stepper = Stepper(ctx, self.intake, config.step_window_ms / 1000)
        self.assignment = Assignment(ctx, self.intake, lambda: self._accepting, lambda: self.capacity)
        self.watch = StuckWatch(config.worker_stuck_s, config.worker_replace_s)
        self.replaced = False  # it stopped to be replaced (stuck): the process exits with status 1

    @property
    def bus(self) -> BusConnection:
        if self._bus is None:
            raise RuntimeError("the worker has not started")
        return self._bus

    @property
    def calls(self) -> dict[str, AssignedCall]:
        return self.intake.calls

    @property
    def load(self) -> int:
        return len(self.calls)

    @property
    def capacity(self) -> int:
        """worker_slots, or less where a partition holds fewer calls (its KV cache pool);
        0 while stopping or stuck, so the conductor places no new call here."""
        if not self._accepting or not self.watch.ready:
            return 0
        return self._slots

    @property
    def _slots(self) -> int:
        bounds = [self.config.worker_slots]
        bounds += [c for r in self.runners.values() if (c := r.engine.partition.capacity()) is not None]
        return min(bounds)

    async def run(self, stop: asyncio.Event) -> None:
        self._bus = await BusConnection.open(
            self.config, f"duplexbus-{self.worker_id}", buckets=[subjects.KV_WORKERS], reconnected=self.intake.reconnected
        )
        kv = self.bus.kv[subjects.KV_WORKERS]
        self.life = SignsOfLife(self.config, subjects.KV_WORKERS, self.worker_id, self._heartbeat, self.config.heartbeat_s)
        await self.intake.start()  # before any assignment: a call's ends are heard from its placement on
        await self.bus.subscribe(subjects.assign(self.worker_id), self.assignment.on_assign)
        self.readiness.conn = self.bus
        health = None
        if self.health_port is not None:  # loopback unless the config opens it (health_host)
            health = HealthServer(
                self.metrics, self.checks, host=self.config.health_host, port=self.health_port, live=self.readiness.live
            )
            await health.start()
        # In NATS service discovery (`nats micro ls`), with its figures at ctl.worker.{id}.stats.
        meta = {"worker_id": self.worker_id, "model": self.model_name, "partitions": ",".join(self.partitions)}
        stats = {"stats": (subjects.worker_stats(self.worker_id), self._stats)}
        announced = await self.bus.announce(subjects.SERVICE_WORKER, VERSION, "runs partitions of a model", meta, stats)
        log.info("worker %s serving %s %s", self.worker_id, self.model_name, self.partitions)
        async with asyncio.TaskGroup() as tg:
            ready = tg.create_task(self.readiness.run())
            steps = tg.create_task(self.stepper.run())
            hb = tg.create_task(self.life.run())
            repairs = tg.create_task(self.intake.run())
            watch = tg.create_task(self._watch(stop))
            await stop.wait()
            # Graceful: stop intake (a heartbeat with no capacity left), let running calls
            # finish, and only then leave: a deleted key is a lost worker to the conductor,
            # which would place these calls again elsewhere while they still run here.
            self._accepting = False
            try:
                await kv.put(self.worker_id, self._heartbeat())
            except BusError as e:  # (a cluster electing a leader, say) the drain goes on all the same
                log.warning("could not announce that this worker stops taking calls: %s", e)
            await self._drain(timeout=self.config.shutdown_drain_s)
            await cancel_and_wait(hb)  # its connection flushed and closed: no heartbeat lands after the delete
            await kv.delete_if_there(self.worker_id)
            await cancel_and_wait(repairs, steps, ready, watch)
        await announced.stop()
        if health is not None:
            await health.close()
        await self.intake.close()
        await self.bus.close()

    def checks(self) -> dict[str, bool]:
        """/readyz: the bus's checks, and `serving`: not stuck (services/worker/stuck.py)."""
        return {**self.readiness(), "serving": self.watch.ready}

    def sample(self) -> Sample:
        engines = [r.engine for r in self.runners.values()]
        since = [e.in_step_since for e in engines if e.in_step_since is not None]
        return Sample(
            moved=sum(e.stats.opened + e.stats.ended for e in engines),
            steps=sum(e.stats.steps for e in engines),
            refusals=self.assignment.refusals,
            full=self.load >= self._slots,
            step_since=min(since, default=None),
        )

    def observe(self, now: float, stop: asyncio.Event) -> None:
        """One look of the stuck watch; stuck past worker_replace_s, the worker stops to be
        replaced."""
        before = self.watch.state
        state = self.watch.observe(now, self.sample())
        if state is before:
            return
        if state is Health.STUCK:
            log.error("worker %s is stuck, not ready: %s", self.worker_id, self.watch.why)
        elif state is Health.SERVING:
            log.warning("worker %s is ready again", self.worker_id)
        elif state is Health.REPLACING:
            log.error("worker %s stuck for worker_replace_s more (%s): stopping, to be replaced", self.worker_id, self.watch.why)
            self.replaced = True
            stop.set()

    async def _watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.observe(time.monotonic(), stop)
            if self.replaced:
                # A step stuck in a thread would hold the process's exit for ever (the thread
                # is joined at exit): past the stop's own bound, it exits all the same.
                exit_after(stop_bound_s(self.config.shutdown_drain_s), f"worker {self.worker_id}, stopping to be replaced,")
                return
            await asyncio.sleep(self.config.heartbeat_s)

    def _heartbeat(self) -> bytes:
        return wire.encode(
            wire.WorkerHeartbeat(
                worker_id=self.worker_id,
                model=self.model_name,
                partitions=self.partitions,
                model_partitions=list(self.model.topology.partitions),
                capacity=self.capacity,
                load=self.load,
                ts=time.time(),
            )
        )

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (self.calls or len(self.stepper.ends)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.calls or len(self.stepper.ends):
            log.warning("stopping with %d calls unfinished, %d messages not stored", len(self.calls), len(self.stepper.ends))

    async def _stats(self, request: bytes) -> bytes:
        """Live figures for operators and benchmarks; a request body of b"reset" clears them after."""
        parts = {}
        for name, r in self.runners.items():
            st = r.engine.stats
            sizes = st.batch_sizes
            parts[name] = {
                "calls": len(r.engine),
                "steps": st.steps,
                "chunks": st.chunks,
                "mean_batch": (sum(sizes) / len(sizes)) if sizes else 0.0,
                "max_batch": max(sizes) if sizes else 0,
            }
        lat = self.intake.data_path_ms
        body = {
            "worker_id": self.worker_id,
            "model": self.model_name,
            "load": self.load,
            "repairs": self.intake.repairs,
            "pauses": self.intake.pauses,
            "held_bytes": sum(r.engine.held_bytes for r in self.runners.values()),
            "store_retries": self.stepper.ends.retries,
            "partitions": parts,
            "data_path_ms": {"n": lat.count, "p50": lat.percentile(50), "p99": lat.percentile(99)},
        }
        if request == b"reset":
            lat.clear()
            for r in self.runners.values():
                r.engine.stats.batch_sizes.clear()
        return json.dumps(body).encode()

    async def _carry_out(self, actions: list[eng.Action], partition: str) -> None:
        await self.stepper.carry_out(actions, partition)
