"""The serving config (YAML), validated at start-up with errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from shared.runtime.errors import ConfigError


class StreamConfig(msgspec.Struct, forbid_unknown_fields=True):
    max_items: int | None = None


class RetentionConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What the stream keeps. Live calls are never cut: the conductor removes finished calls
    (oldest first) past max_age_s or max_bytes, and refuses new calls past hard_max_bytes."""

    max_age_s: float = 24 * 3600
    max_bytes: int = 2 * 1024**3
    hard_max_bytes: int | None = None  # None: twice max_bytes
    replicas: int = 1
    confirm_publishes: bool | None = None  # None: where replicas > 1 (ServingConfig.confirms_publishes)

    @property
    def refuse_above_bytes(self) -> int:
        return self.hard_max_bytes if self.hard_max_bytes is not None else 2 * self.max_bytes


class RealtimeConfig(msgspec.Struct, forbid_unknown_fields=True):
    resume_grace_s: float = 30.0  # a dropped /v1/realtime socket may resume its session this long
    response_wait_s: float = 10.0  # a response made by response.create waits this long for the model's reply
    # A session lives while its socket does (a waiting client is no idle one), up to this: OpenAI's 60 minutes.
    max_session_s: float = 3600.0


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[str] = []  # bearer tokens a client must give (none: no token needed); also $DUPLEXBUS_TOKENS
    allowed_origins: list[str] = []  # browser origins allowed besides the frontend's own
    # Host names a frontend answers besides loopback names and addresses (`name`, `.domain`
    # for it and its subdomains, `*` for any): checked on a loopback connection without
    # tokens (a DNS-rebinding page names its own host), and everywhere once any is listed.
    allowed_hosts: list[str] = []


class TLSConfig(msgspec.Struct, forbid_unknown_fields=True):
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class ServingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = "voice_assistant"
    nats_url: str | None = None
    nats_creds: str | None = None
    nats_tls: TLSConfig | None = None
    nats_monitor_port: int | None = None  # the embedded nats-server's monitoring port (`duplexbus up`); None: a free one
    nats_procs: int | None = None  # the embedded nats-server's GOMAXPROCS (`duplexbus up`); None: half the cores
    max_concurrent_requests: int = 512
    max_queued_requests: int = 64
    # Calls one client may hold on a frontend at once (live, queued or opening), so that one
    # cannot take every slot; None: a quarter (a socket) or half (a token) of max_concurrent_requests.
    max_calls_per_socket: int | None = None
    max_calls_per_token: int | None = None
    max_call_input_mb: float = 64.0
    client_streams: dict[str, StreamConfig] = {}
    request_timeout_s: float = 30.0
    max_call_duration_s: float = 3600.0
    retention: RetentionConfig = msgspec.field(default_factory=RetentionConfig)
    host: str = "127.0.0.1"
    # Where the conductor's and workers' /livez, /readyz and /metrics listen: loopback unless
    # opened here (a container's, scraped over its network), whatever `host` the frontends take.
    health_host: str = "127.0.0.1"
    port: int = 8000
    max_message_mb: float = 16.0  # one WebSocket message
    max_send_buffer_mb: float = 16.0  # output waiting for one client; past it its calls' outputs wait in the stream
    send_timeout_s: float = 30.0  # output waiting and none of it read this long: the client is dropped
    max_connections: int = 1024  # HTTP and WebSocket connections one frontend holds; past it 503
    header_timeout_s: float = 10.0  # an HTTP request's headers (a WebSocket handshake too) must arrive within this
    message_timeout_s: float = 30.0  # a WebSocket message or POST /generate body must be complete within this
    socket_idle_timeout_s: float = 120.0  # a WebSocket with no call and no message this long is closed
    frontend_memory_mb: float = 512.0  # input and output one frontend buffers, all connections together
    worker_slots: int = 512  # calls one worker takes at once
    max_batch: int = 64  # calls in one step
    step_window_ms: float = 2.0  # pause between a worker's steps: input gathers into bigger batches
    worker_call_buffer_mb: float = 2.0  # input one partition of a call may hold in a worker; past it the rest waits in the stream
    worker_buffer_mb: float = 64.0  # input all of a worker's calls may hold; past it their input waits in the stream
    # A worker that refuses calls for want of room while nothing moves (no call taken or let
    # go, no step), or whose step runs, this long is stuck: not ready, no free slots.
    worker_stuck_s: float = 60.0
    worker_replace_s: float = 120.0  # stuck this long more, a worker exits for its supervisor to replace it; 0: never
    heartbeat_s: float = 1.0
    liveness_s: float = 5.0  # a worker or frontend silent this long is dead
    placement_timeout_s: float = 10.0  # how long a call waits for a worker when none serves a partition
    shutdown_drain_s: float = 10.0  # a stopping frontend or worker lets live calls end this long
    # A stopping frontend keeps listening this long (within its drain), answering 503 to
    # /healthz and to new calls before their handshake, so a gateway takes it out and
    # retries those elsewhere; 0 closes its listener at once.
    shutdown_unlist_s: float = 3.0
    realtime: RealtimeConfig = msgspec.field(default_factory=RealtimeConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)

    def __post_init__(self) -> None:
        positive = {
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_call_input_mb": self.max_call_input_mb,
            "request_timeout_s": self.request_timeout_s,
            "max_call_duration_s": self.max_call_duration_s,
            "max_message_mb": self.max_message_mb,
            "max_send_buffer_mb": self.max_send_buffer_mb,
            "send_timeout_s": self.send_timeout_s,
            "max_connections": self.max_connections,
            "header_timeout_s": self.header_timeout_s,
            "message_timeout_s": self.message_timeout_s,
            "socket_idle_timeout_s": self.socket_idle_timeout_s,
            "frontend_memory_mb": self.frontend_memory_mb,
            "worker_slots": self.worker_slots,
            "max_batch": self.max_batch,
            "worker_call_buffer_mb": self.worker_call_buffer_mb,
            "worker_buffer_mb": self.worker_buffer_mb,
            "worker_stuck_s": self.worker_stuck_s,
            "heartbeat_s": self.heartbeat_s,
            "liveness_s": self.liveness_s,
            "placement_timeout_s": self.placement_timeout_s,
            "shutdown_drain_s": self.shutdown_drain_s,
            "retention.max_age_s": self.retention.max_age_s,
            "retention.max_bytes": self.retention.max_bytes,
            "retention.replicas": self.retention.replicas,
            "realtime.response_wait_s": self.realtime.response_wait_s,
            "realtime.max_session_s": self.realtime.max_session_s,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(key, f"must be > 0, got {value}")
        if self.shutdown_unlist_s < 0:
            raise ConfigError("shutdown_unlist_s", f"must be >= 0, got {self.shutdown_unlist_s}")
        hard, soft = self.retention.hard_max_bytes, self.retention.max_bytes
        if hard is not None and hard < soft:
            raise ConfigError("retention.hard_max_bytes", f"must be >= retention.max_bytes ({soft}), got {hard}")
        if self.realtime.resume_grace_s < 0:
            raise ConfigError("realtime.resume_grace_s", "must be >= 0")
        if self.worker_replace_s < 0:
            raise ConfigError("worker_replace_s", f"must be >= 0, got {self.worker_replace_s}")
        if self.step_window_ms < 0:
            raise ConfigError("step_window_ms", "must be >= 0")
        if self.nats_monitor_port is not None and not 0 < self.nats_monitor_port < 65536:
            raise ConfigError("nats_monitor_port", f"must be a port, 1 to 65535, got {self.nats_monitor_port}")
        if self.nats_procs is not None and self.nats_procs < 0:
            raise ConfigError("nats_procs", f"must be >= 0, got {self.nats_procs}")
        for key, cap in (("max_calls_per_socket", self.max_calls_per_socket), ("max_calls_per_token", self.max_calls_per_token)):
            if cap is not None and cap < 1:
                raise ConfigError(key, f"must be >= 1, got {cap}")
        if self.max_queued_requests < 0:
            raise ConfigError("max_queued_requests", "must be >= 0")
        for edge, s in self.client_streams.items():
            if s.max_items is not None and s.max_items < 1:
                raise ConfigError(f"client_streams.{edge}.max_items", f"must be >= 1, got {s.max_items}")

    @property
    def max_items_overrides(self) -> dict[str, int | None]:
        """client_streams as edge -> max_items (None: the key is there and says "no bound").
        The model's topology applies them (`PartitionTopology.stream_limits`), which may lower
        a model's bound, never raise or remove it."""
        return {edge: s.max_items for edge, s in self.client_streams.items()}

    @property
    def confirms_publishes(self) -> bool:
        """Items and outputs are published so that the stream confirms them, and sent again
        until it has (shared/bus/confirmed.py): where the stream is replicated, its leader can
        die, and until another is elected what is published is stored nowhere."""
        confirm = self.retention.confirm_publishes
        return confirm if confirm is not None else self.retention.replicas > 1

    @property
    def stream_max_age_s(self) -> float:
        """The stream's own age limit: no call lives longer than max_call_duration_s, so one
        that long past retention.max_age_s never cuts a live call. The conductor removes
        finished calls at max_age_s; this only takes what it could not (a call whose open
        never reached it)."""
        return self.retention.max_age_s + self.max_call_duration_s

    @property
    def calls_per_socket(self) -> int:
        """max_calls_per_socket, its default resolved: a quarter of the slots (128 of 512)."""
        if self.max_calls_per_socket is not None:
            return self.max_calls_per_socket
        return max(1, self.max_concurrent_requests // 4)

    @property
    def calls_per_token(self) -> int:
        """max_calls_per_token, its default resolved: half of the slots (256 of 512)."""
        if self.max_calls_per_token is not None:
            return self.max_calls_per_token
        return max(1, self.max_concurrent_requests // 2)

    @property
    def max_call_input_bytes(self) -> int:
        return _mib(self.max_call_input_mb)

    @property
    def max_message_bytes(self) -> int:
        return _mib(self.max_message_mb)

    @property
    def max_send_buffer_bytes(self) -> int:
        return _mib(self.max_send_buffer_mb)

    @property
    def worker_call_buffer_bytes(self) -> int:
        return _mib(self.worker_call_buffer_mb)

    @property
    def worker_buffer_bytes(self) -> int:
        return _mib(self.worker_buffer_mb)

    @property
    def frontend_memory_bytes(self) -> int:
        return _mib(self.frontend_memory_mb)

    @property
    def ws_max_frame_bytes(self) -> int:
        """The largest WebSocket frame read at all: a message over max_message_mb up to this
        is answered (400 naming the key); a frame past it closes the socket (1009)."""
        return 2 * self.max_message_bytes + 1024 * 1024


def _mib(mb: float) -> int:
    return int(mb * 1024 * 1024)


def _key_of(err: msgspec.ValidationError, prefix: str = "") -> str:
    """The dotted config key a msgspec error is about (`retention.max_age_s`)."""
    text = str(err)
    path = text.split("`$.", 1)[1].split("`", 1)[0] if "`$." in text else ""
    if "unknown field `" in text:
        field = text.split("unknown field `", 1)[1].split("`", 1)[0]
        path = f"{path}.{field}" if path else field
    key = ".".join(p for p in (prefix, path) if p)
    return key or "config"


def _reason(err: msgspec.ValidationError) -> str:
    """msgspec's message without its `- at $.path` (the ConfigError names the key)."""
    return str(err).split(" - at `$", 1)[0]


def parse_config(data: dict[str, Any] | None) -> ServingConfig:
    data = data or {}
    streams = data.get("client_streams") if isinstance(data, dict) else None
    if isinstance(streams, dict):
        # Converted one by one, so an error names the stream (msgspec would say `[...]`).
        for edge, body in streams.items():
            try:
                msgspec.convert(body, StreamConfig, strict=False)
            except msgspec.ValidationError as e:
                raise ConfigError(_key_of(e, f"client_streams.{edge}"), _reason(e)) from None
    try:
        return msgspec.convert(data, ServingConfig, strict=False)
    except ConfigError:
        raise
    except msgspec.ValidationError as e:
        raise ConfigError(_key_of(e), _reason(e)) from None


# Keys the environment sets over the config file (a container changes them without a new file).
ENV_OVERRIDES = {"nats_url": "NATS_URL", "nats_creds": "NATS_CREDS", "model": "DUPLEXBUS_MODEL"}
# nats_tls's keys, from the variables the `nats` command line tool reads for the same files.
TLS_ENV = {"ca_file": "NATS_CA", "cert_file": "NATS_CERT", "key_file": "NATS_KEY"}


def load_config(path: str | Path | None = None, **overrides: Any) -> ServingConfig:
    """Config from `path` (or $DUPLEXBUS_CONFIG), then the environment (ENV_OVERRIDES, TLS_ENV,
    $DUPLEXBUS_TOKENS), then explicit overrides."""
    path = path or os.environ.get("DUPLEXBUS_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError("config", f"cannot read {path}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("config", f"{path} must hold a mapping")
        data = loaded or {}
    for key, env in ENV_OVERRIDES.items():
        if os.environ.get(env):
            data[key] = os.environ[env]
    tls = {key: os.environ[env] for key, env in TLS_ENV.items() if os.environ.get(env)}
    file_tls = data.get("nats_tls") or {}
    if tls and isinstance(file_tls, dict):  # over the file's nats_tls, key by key (not a mapping: its error says so)
        data["nats_tls"] = {**file_tls, **tls}
    if os.environ.get("DUPLEXBUS_TOKENS"):  # added to the file's: a deployment keeps secrets out of files
        tokens = [t.strip() for t in os.environ["DUPLEXBUS_TOKENS"].split(",") if t.strip()]
        auth = data.setdefault("auth", {})
        if isinstance(auth, dict):
            auth["tokens"] = [*(auth.get("tokens") or []), *tokens]
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_config(data)
