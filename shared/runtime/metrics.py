"""Prometheus metrics of each service, on a registry of its own (prometheus-client).

A frontend serves them at `/metrics` on its HTTP port; a worker and the conductor on their
health port (shared.runtime.health). Names are `duplexbus_<role>_...`; every metric a
role has is created at start, so a scrape sees it (at zero) before the first call.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from sub-millisecond (a data path on one machine) to a stalled call.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A spoken turn's stages: finer where the targets are (350 ms to first audio at one caller).
TURN_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FrontendMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.calls = Counter(
            "duplexbus_frontend_calls", "Calls that ended, by outcome and status", ["outcome", "status"], registry=r
        )
        self.live_calls = Gauge("duplexbus_frontend_live_calls", "Calls open on this frontend now", registry=r)
        self.refusals = Counter(
            "duplexbus_frontend_admission_refusals", "Openings refused before a call started, by status", ["status"], registry=r
        )
        self.appends = Counter("duplexbus_frontend_appends", "Client stream items published", registry=r)
        self.loop_lag = Histogram(
            "duplexbus_frontend_loop_lag_seconds",
            "How late the event loop ran a 0.1 s timer: work that holds the loop delays every call",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.input_holds = Counter(
            "duplexbus_frontend_input_holds",
            "Times client input was held because the bus connection was backed up (services/frontend/pressure.py)",
            registry=r,
        )
        self.reply_lag = Histogram(
            "duplexbus_frontend_reply_lag_seconds",
            "A model output's time from the worker publishing it to the frontend handing it to the client",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "duplexbus_frontend_turn_seconds",
            "A spoken turn over /v1/realtime, by stage: end_of_turn (end of speech to the turn decided, the model's "
            "figure), transcript (decided to the final transcript), first_audio (end of speech to the reply's first audio)",
            ["stage"],
            buckets=TURN_BUCKETS,
            registry=r,
        )
        self.sockets = Gauge("duplexbus_frontend_sockets", "Client connections open now", registry=r)
        self.socket_queue = Gauge(
            "duplexbus_frontend_output_buffered_bytes",
            "Server-to-client bytes waiting for clients to read them, over all connections (the sockets' queues)",
            registry=r,
        )


class WorkerMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.batch_size = Histogram(
            "duplexbus_worker_batch_size",
            "Calls in one step, per partition",
            ["partition"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.step_seconds = Histogram(
            "duplexbus_worker_step_seconds", "Time of one step, per partition", ["partition"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.live_calls = Gauge("duplexbus_worker_live_calls", "Calls this worker holds now", registry=r)
        self.catch_up_reads = Counter(
            "duplexbus_worker_catch_up_reads", "Reads of a call's input from the stream, by why", ["reason"], registry=r
        )


class ConductorMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.placements = Counter("duplexbus_conductor_placements", "Partitions placed on a worker", registry=r)
        self.placement_wait = Histogram(
            "duplexbus_conductor_placement_wait_seconds",
            "From a call's open to every partition placed",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.live_calls = Gauge("duplexbus_conductor_live_calls", "Calls admitted and not finished", registry=r)
        self.workers_alive = Gauge("duplexbus_conductor_workers_alive", "Workers heartbeating now", registry=r)
        self.liveness_asks = Counter(
            "duplexbus_conductor_liveness_asks",
            "Workers and frontends asked directly after their heartbeats stopped, by how it ended (answered, absent, expired)",
            ["outcome"],
            registry=r,
        )
