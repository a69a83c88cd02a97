"""Every subject, stream and bucket name. Nothing else builds subject strings."""

from __future__ import annotations

import functools
import os
import secrets
import time
from dataclasses import dataclass

STREAM = "DUPLEX_CALLS"
STREAM_SUBJECTS = ["call.>"]

KV_WORKERS = "duplex_workers"
KV_FRONTENDS = "duplex_frontends"
KV_CALLS = "duplex_calls"
KV_REQUEST_IDS = "duplex_request_ids"
OBJ_PAYLOADS = "duplex_payloads"  # bodies over the server's max_payload

CONDUCTOR_DURABLE = "conductor"


def js_api_stream_info(stream: str) -> str:
    """JetStream's API subject for a stream's info (with a subjects_filter: the subjects it holds)."""
    return f"$JS.API.STREAM.INFO.{stream}"


def js_api_direct_get(stream: str) -> str:
    """JetStream's API subject for direct gets of a stream's messages (allow_direct)."""
    return f"$JS.API.DIRECT.GET.{stream}"


# Kinds of call subjects.
OPEN = "open"
IN = "in"
EOI = "eoi"
EDGE = "edge"
EDGE_END = "edge_end"
OUT = "out"
DONE = "done"
FIN = "fin"
ABORT = "abort"
PLACED = "placed"
REALTIME = "rt"

_PREFIX = "call"


def new_cid() -> str:
    """Unique, time-sortable call id: 12 hex digits of milliseconds, then 12 random hex digits.

    Never the client's request_id, which can be reused and may contain anything.
    """
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def is_cid(text: str) -> bool:
    """Whether `text` has the form of a cid (new_cid's 24 hex digits)."""
    return len(text) == 24 and all(c in "0123456789abcdef" for c in text)


def new_process_id(kind: str) -> str:
    return f"{kind}-{os.getpid()}-{secrets.token_hex(3)}"


def open_(cid: str) -> str:
    return f"{_PREFIX}.{cid}.{OPEN}"


def input_(cid: str, edge: str) -> str:
    return f"{_PREFIX}.{cid}.{IN}.{edge}"


def eoi(cid: str, edge: str) -> str:
    return f"{_PREFIX}.{cid}.{EOI}.{edge}"


def edge(cid: str, edge_name: str) -> str:
    return f"{_PREFIX}.{cid}.{EDGE}.{edge_name}"


def edge_end(cid: str, edge_name: str) -> str:
    return f"{_PREFIX}.{cid}.{EDGE_END}.{edge_name}"


def out(cid: str) -> str:
    return f"{_PREFIX}.{cid}.{OUT}"


def done(cid: str, partition: str) -> str:
    return f"{_PREFIX}.{cid}.{DONE}.{partition}"


def fin(cid: str) -> str:
    return f"{_PREFIX}.{cid}.{FIN}"


def abort(cid: str) -> str:
    return f"{_PREFIX}.{cid}.{ABORT}"


def consumed(cid: str, edge_name: str) -> str:
    """Everything a consumer of the edge reads: its items and its end (in+eoi for a client
    stream, edge+edge_end between partitions; `*` spans both kinds)."""
    return f"{_PREFIX}.{cid}.*.{edge_name}"


def placed(cid: str, worker_id: str) -> str:
    """A worker took partitions of the call (stored before its catch-up read: see wire.Placed)."""
    return f"{_PREFIX}.{cid}.{PLACED}.{worker_id}"


def realtime(cid: str) -> str:
    """The realtime events a `/v1/realtime` session sent its client, in order: what a
    resuming client missed is read back from here (and a replay shows them)."""
    return f"{_PREFIX}.{cid}.{REALTIME}"


def call_all(cid: str) -> str:
    """Every subject of one call (replay)."""
    return f"{_PREFIX}.{cid}.>"


def all_opens() -> str:
    """The open of every call: each carries its request_id (replay's request_id lookup)."""
    return f"{_PREFIX}.*.{OPEN}"


def assign(worker_id: str) -> str:
    return f"ctl.worker.{worker_id}.assign"


SERVICE_CONDUCTOR = "duplexbus-conductor"  # names in NATS service discovery (`nats micro ls`)
SERVICE_WORKER = "duplexbus-worker"


def service_ping(service: str) -> str:
    """NATS service discovery's ping of every instance of `service` (any answer: one is alive)."""
    return f"$SRV.PING.{service}"


def alive(process_id: str) -> str:
    """Request/reply: the conductor asks a worker or frontend whose heartbeats stopped coming
    whether it lives; any answer says it does (conductor/liveness.py)."""
    return f"ctl.alive.{process_id}"


def realtime_take(cid: str) -> str:
    """Request/reply: a frontend a client resumed a `/v1/realtime` session on asks for it; the
    frontend holding the session (attached or waiting for its client) is the one subscribed."""
    return f"ctl.realtime.{cid}.take"


def realtime_taken(cid: str) -> str:
    """The frontend that took a session says it holds its call now (its heartbeat listing it
    stored): the one that let it go stops listing it."""
    return f"ctl.realtime.{cid}.taken"


def conductor_status() -> str:
    """Request/reply: the conductor's live calls, workers and placements."""
    return "ctl.conductor.status"


def worker_stats(worker_id: str) -> str:
    """Request/reply: the worker's load, steps, batch sizes and data-path latency."""
    return f"ctl.worker.{worker_id}.stats"


# What the conductor consumes: O(1) messages per call, never data subjects (I-1).
CONDUCTOR_FILTERS = [
    all_opens(),
    f"{_PREFIX}.*.{EOI}.*",
    f"{_PREFIX}.*.{DONE}.*",
    f"{_PREFIX}.*.{ABORT}",
]


@dataclass(frozen=True)
class CallSubject:
    cid: str
    kind: str
    edge: str | None  # edge name, or partition name for `done`


@functools.lru_cache(maxsize=8192)  # every message of a live call is parsed; its few subjects repeat
def parse(subject: str) -> CallSubject:
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != _PREFIX:
        raise ValueError(f"not a call subject: {subject!r}")
    return CallSubject(parts[1], parts[2], parts[3] if len(parts) > 3 else None)
