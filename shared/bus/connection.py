"""One process's connection to the bus: `BusConnection`, opened once, typed, closed once.

Every service (and `duplexbus up`, and the CLI's bus commands) talks to NATS through it:
it connects, creates (idempotently) the stream and the buckets it is asked for, publishes
(with bodies over the server's max_payload through the Object Store), subscribes, reads
what the stream holds, and closes. nats-py's exceptions come out as `BusError`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from nats import micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NotJSMessageError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from nats.micro.request import Request  # nats.micro exports add_service alone

from shared.bus import subjects
from shared.bus.acks import Acks
from shared.bus.confirmed import Confirmer
from shared.bus.direct import DirectReads, supported
from shared.bus.durable import Durable
from shared.bus.failures import Denials, mapped
from shared.bus.history import Stored, read_history
from shared.bus.internals import GuardedClient, reading, subscribe_direct
from shared.bus.kv import Bucket
from shared.bus.link import Link, LinkSample, LinkWatch
from shared.bus.payloads import Payloads
from shared.runtime.config import ServingConfig
from shared.runtime.errors import BusDenied, BusError, BusLost, BusNotFound, BusRefused, BusTimeout, BusUnavailable, DuplexError
from shared.runtime.process import cancel_and_wait
from shared.runtime.retry import Backoff, Outage, retrying

log = logging.getLogger(__name__)


class BusMsg(Protocol):
    """A message as handlers get it. nats-py's own `Msg` is one, structurally: no object per
    message wraps it (the frontend and the workers take thousands a second). What would
    raise nats-py's errors is reached through the connection, which maps them to BusErrors:
    `BusConnection.ack`, `BusConnection.answer`, `BusConnection.body`."""

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, str] | None: ...

    @property
    def reply(self) -> str: ...


class BusSubscription(Protocol):
    """A subscription as services hold it: they end it with `BusConnection.unsubscribe_all`."""

    @property
    def subject(self) -> str: ...


def _nats_msg(msg: BusMsg) -> Msg:
    """Every BusMsg this package hands out is nats-py's Msg; the Protocol only hides from
    services what raises nats-py's errors."""
    return cast(Msg, msg)


# History and TTL per bucket: heartbeats expire so a dead process disappears by itself.
BUCKETS: dict[str, dict[str, Any]] = {
    subjects.KV_WORKERS: {"history": 1},
    subjects.KV_FRONTENDS: {"history": 1},
    subjects.KV_CALLS: {"history": 1},
    subjects.KV_REQUEST_IDS: {"history": 1},
}
HEARTBEAT_BUCKETS = (subjects.KV_WORKERS, subjects.KV_FRONTENDS)


def stream_config(config: ServingConfig) -> StreamConfig:
    """No byte limit: the server would drop the oldest messages, a live call's start among
    them. The conductor, which knows which calls are live, removes finished ones instead
    (services/conductor/retention.py); the age limit is one no live call reaches."""
    return StreamConfig(
        name=subjects.STREAM,
        subjects=subjects.STREAM_SUBJECTS,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=config.stream_max_age_s,
        max_bytes=-1,
        num_replicas=config.retention.replicas,
        discard=DiscardPolicy.OLD,
        duplicate_window=120.0,
        allow_direct=True,
    )


def conductor_consumer(after: int) -> ConsumerConfig:
    """The conductor's durable consumer, made to start after stream sequence `after` (the
    stream's last when it is made: BusConnection.durable). Opens of calls from before it
    existed are history, not work; frontends wait for this consumer before they accept calls,
    so every open they publish comes after `after`.

    Not DeliverPolicy.NEW: on a cluster the server picks NEW's first sequence once the
    consumer's leader is elected, which can be after the create was answered and frontends
    saw the consumer. Opens published in between were never delivered (tried as a new user
    would: a publisher on another node that waits for the consumer, then publishes at once,
    lost every message in 30 rounds of 30; tests/test_cluster.py)."""
    return ConsumerConfig(
        durable_name=subjects.CONDUCTOR_DURABLE,
        filter_subjects=subjects.CONDUCTOR_FILTERS,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
        ack_wait=30,
        max_ack_pending=10_000,
    )


def redacted(urls: str | None) -> str:
    """NATS URL(s) without passwords, for messages and logs."""
    out = []
    for url in (urls or "").split(","):
        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
            url = parts._replace(netloc=netloc).geturl()
        out.append(url)
    return ",".join(out)


CLOSE_FAILED_S = 2.0
# A call's once-only messages (its open, ends of input, fin) are stored with an ack; an ack that
# a server slow under load does not send in JetStream's 5 s is asked for again (the stream drops
# the repeat) for this long (`store_once`) before the write fails (once: twenty 3-minute uploads
# at once on 2 cores).
STORE_PATIENCE_S = 30.0
LEADERLESS_WAIT_S = 5.0  # a read's consumer just made on a cluster may have no leader yet (_pull)
LEADERLESS_PAUSE_S = 0.05
# nats-py PINGs the server every PING_INTERVAL_S and reconnects once more than
# MAX_OUTSTANDING_PINGS are unanswered: a server that stopped answering (frozen, or a node
# cut off) is left within 4 to 5 s. nats-py's defaults (120 s, 2) took 4 to 6 minutes.
PING_INTERVAL_S = 1
MAX_OUTSTANDING_PINGS = 4
LINK_WATCH_S = 0.5  # how often the link is looked at (link.py): a dead read loop is found this soon
ANNOUNCE_TIMEOUT_S = 5.0  # the round trip that makes an announcement's endpoints answer
SET_UP_PAUSE_S = 0.5  # as often as a JetStream leader election is worth asking about


async def _close_quietly(nc: Client) -> None:
    """Close a client whose connect failed. Bounded: nats-py may wait on a transport that a
    failed TLS handshake left half open, and there is nothing to keep of it."""
    try:
        await asyncio.wait_for(nc.close(), CLOSE_FAILED_S)
    except Exception as e:  # broad on purpose: a client left half made fails in ways of its own (no transport)
        log.debug("closing a connection that failed: %r", e)


def _connect_options(config: ServingConfig, name: str) -> dict[str, Any]:
    if not config.nats_url:
        raise BusUnavailable("connecting", "no NATS URL: set NATS_URL or nats_url in the config")
    opts: dict[str, Any] = {
        "servers": config.nats_url.split(","),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "pending_size": 64 * 1024 * 1024,
        "ping_interval": PING_INTERVAL_S,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
    }
    if config.nats_creds:
        opts["user_credentials"] = config.nats_creds
    if config.nats_tls:
        ctx = ssl.create_default_context(cafile=config.nats_tls.ca_file)
        if config.nats_tls.cert_file:
            ctx.load_cert_chain(config.nats_tls.cert_file, config.nats_tls.key_file)
        opts["tls"] = ctx
    return opts


def _micro_handler(handler: Callable[[bytes], Awaitable[bytes]]) -> Callable[[Request], Awaitable[None]]:
    async def on_request(req: Request) -> None:
        try:
            await req.respond(await handler(req.data))
        except Exception as e:  # the handler's own failure, a bug included: answered as nats micro clients expect
            log.exception("answering %s failed", req.subject)
            # A DuplexError's message is written for whoever asked; a bug's text is internal, and
            # so is a BusError's (it names servers and subjects).
            public = e.message if isinstance(e, DuplexError) and not isinstance(e, BusError) else None
            await req.respond_error("500", public or "internal error (in the service's log)")

    return on_request


@dataclass(frozen=True)
class StreamState:
    """The calls stream as its info gives it: bytes held, first and last sequences."""

    bytes: int
    first_seq: int
    last_seq: int


class Announcement:
    """A process's entry in NATS service discovery; `stop()` takes it out."""

    def __init__(self, svc: Any) -> None:
        self._svc = svc

    async def stop(self) -> None:
        try:
            with mapped("stopping service discovery"):
                await self._svc.stop()
        except BusError as e:  # the connection may be closing: the entry goes with it
            log.debug("%s", e)


class BusConnection:
    """A process's one connection. `open()` it once; `close()` it once, last."""

    def __init__(self, nc: Client, config: ServingConfig, denials: Denials) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self.config = config
        self._denials = denials
        self.payloads = Payloads(self._js, config, int(nc.max_payload))
        self.kv: dict[str, Bucket] = {}
        self.confirmer: Confirmer | None = None  # publishes the stream confirms (confirmed.py)
        self.acks = Acks(nc)  # stored publishes and KV writes, their acks on one subscription (acks.py)
        # Bounded reads without a consumer (direct.py): exact only where one server holds the stream.
        self._direct = DirectReads(nc, subjects.STREAM) if config.retention.replicas == 1 and supported(nc) else None
        self.link = LinkWatch()
        self._closing = False
        self._link_task: asyncio.Task[None] | None = None
        self._deaf_at: float | None = None  # when it was last found deaf, until it reads again

    @classmethod
    async def open(
        cls,
        config: ServingConfig,
        name: str,
        *,
        buckets: Sequence[str] = (),
        stream: bool = True,
        reconnected: Callable[[], Awaitable[None]] | None = None,
        connect_timeout: float | None = None,
    ) -> BusConnection:
        """Connect, then create the stream (unless `stream=False`) and `buckets` where missing.

        The connect retries until NATS answers, or for `connect_timeout` seconds where one is
        given (a CLI command, which should say "cannot reach NATS" rather than wait forever).
        `reconnected` runs after each reconnect: core subscriptions missed what was published
        meanwhile, and the caller reads it from the stream."""
        denials = Denials()
        opts = _connect_options(config, name)
        if config.nats_creds and not os.path.isfile(config.nats_creds):
            # nats-py would read it only once a server answers, and say "no server answered"
            # while none does: the missing file is the one thing to tell.
            raise BusDenied("connecting", f"no credentials file at {config.nats_creds} (nats_creds, $NATS_CREDS)")

        async def on_error(e: Exception) -> None:
            if "permissions violation" in str(e).lower():
                denials.saw(str(e).removeprefix("nats: "))
                log.error("NATS refused an operation: %s", e)
            elif connect_timeout is None:  # a service: say so; a CLI command says it once, on failing
                log.warning("NATS: %s", e or type(e).__name__)

        opts["error_cb"] = on_error
        if reconnected is not None:
            opts["reconnected_cb"] = reconnected
        doing = f"connecting to {redacted(config.nats_url)}"
        nc = GuardedClient()
        try:
            with mapped(doing, denials):
                if connect_timeout is None:
                    await nc.connect(**opts)
                else:  # one try at each server
                    opts.update(allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=min(2.0, connect_timeout))
                    await asyncio.wait_for(nc.connect(**opts), connect_timeout)
        except BaseException as e:
            # A refused attempt (credentials, TLS) leaves its socket open in nats-py: close it.
            await asyncio.shield(_close_quietly(nc))
            if isinstance(e, ssl.SSLError):  # a certificate not trusted: one line, no traceback
                raise BusDenied(doing, f"TLS: {e.reason or e}") from e
            if isinstance(e, OSError):  # cut during the handshake (a server that wants our certificate, say)
                raise BusUnavailable(doing, f"{e.strerror or e}") from e
            raise
        conn = cls(nc, config, denials)
        conn._link_task = asyncio.get_running_loop().create_task(conn._watch_link())
        try:
            await conn._set_up(stream, buckets, connect_timeout)
            if stream and config.confirms_publishes:
                conn.confirmer = Confirmer(nc)
                await conn.confirmer.start()
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _set_up(self, stream: bool, buckets: Sequence[str], timeout: float | None) -> None:
        """The stream and buckets, tried again while the failure is recoverable (a cluster
        electing its JetStream leader answers nothing for a while), for up to `timeout`."""
        made = not stream

        async def set_up() -> None:
            nonlocal made
            if not made:
                await self.ensure_stream()
                made = True
            for b in buckets:
                if b not in self.kv:
                    self.kv[b] = await self.bucket(b)

        outage = Outage("setting up the stream and buckets", log)
        await retrying(set_up, outage, backoff=Backoff(SET_UP_PAUSE_S, SET_UP_PAUSE_S), give_up_s=timeout)

    # -- set-up ----------------------------------------------------------------
    async def ensure_stream(self) -> None:
        cfg = stream_config(self.config)
        with mapped("creating the stream", self._denials):
            try:
                await self._js.add_stream(cfg)
            except BadRequestError:
                # Exists with other settings (another service won the race, or the config changed).
                await self._js.update_stream(cfg)

    async def bucket(self, name: str, create: bool = True) -> Bucket:
        """The bucket `name`, created with its settings (BUCKETS) where missing and `create`."""
        with mapped(f"opening bucket {name}", self._denials):
            try:
                kv = await self._js.key_value(name)
                await self._allow_marker_ttl(name)
            except NotFoundError:
                if not create:
                    raise
                ttl = self.config.liveness_s if name in HEARTBEAT_BUCKETS else None
                cfg = KeyValueConfig(bucket=name, ttl=ttl, replicas=self.config.retention.replicas, **BUCKETS[name])
                try:
                    kv = await self._js.create_key_value(cfg)
                except BadRequestError:  # another process created it meanwhile
                    kv = await self._js.key_value(name)
        return Bucket(kv, name, self._denials, self.acks)

    async def _allow_marker_ttl(self, bucket: str) -> None:
        """A bucket made by an older version may refuse per-message TTLs, which removals use
        (kv.MARKER_TTL_S): allow them (a setting the server lets one turn on, never off)."""
        info = await self._js.stream_info(f"KV_{bucket}")
        if not info.config.allow_msg_ttl:
            info.config.allow_msg_ttl = True
            await self._js.update_stream(info.config)
            log.info("bucket %s now allows the marker TTL of removed keys", bucket)

    async def durable(self, config: Callable[[int], ConsumerConfig]) -> Durable:
        """The durable consumer `config(after)` describes, bound for pulling. Where missing it
        is made with `after` the stream's last sequence now: it starts with what is stored
        next. Where it exists, `config` updates it (an ack_wait changed by an upgrade, say) and
        it keeps the starting point it was made with (the server changes none)."""
        name = config(0).durable_name or ""
        with mapped(f"binding consumer {name}", self._denials):
            try:
                info = await self._js.consumer_info(subjects.STREAM, name)
                made = info.config
                cfg = dataclasses.replace(config(0), deliver_policy=made.deliver_policy, opt_start_seq=made.opt_start_seq)
                cfg.opt_start_time = made.opt_start_time
            except NotFoundError:
                cfg = config((await self._js.stream_info(subjects.STREAM)).state.last_seq)
            try:
                await self._js.add_consumer(subjects.STREAM, cfg)
            except BadRequestError as e:  # made or changed meanwhile by another conductor
                log.warning("consumer %s not updated: %s", name, e)
            sub = await self._js.pull_subscribe_bind(durable=name, stream=subjects.STREAM)
        return Durable(self._js, sub, name, self._denials)

    async def has_consumer(self, durable: str) -> bool:
        try:
            with mapped(f"looking up consumer {durable}", self._denials):
                await self._js.consumer_info(subjects.STREAM, durable)
        except BusNotFound:
            return False
        return True

    # -- publishing ------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        """Connected and reading: a client whose read loop has ended says it is connected, and
        hears nothing (link.py)."""
        return bool(self._nc.is_connected) and reading(self._nc)

    @property
    def lost(self) -> bool:
        """The connection cannot mend itself (link.py): the process is to be replaced."""
        return self.link.lost

    async def round_trip(self, timeout: float) -> None:
        """A PING the server answers within `timeout` (whole seconds, at least 1): it works now.
        (No denial memory: a PING needs no permission, so its timeout is only ever a timeout.)

        Not on a connection whose read loop has ended: nats-py's flush then returns at once
        without a round trip, which would be a false all-clear."""
        if self.link.lost:
            raise BusLost("a round trip to NATS", self.link.why)
        if not self.is_connected:
            raise BusUnavailable("a round trip to NATS", f"the connection is {self.link.state.value}, not reading")
        with mapped("a round trip to NATS"):
            await self._nc.flush(timeout=max(1, math.ceil(timeout)))

    async def _watch_link(self) -> None:
        """Until the close: a read loop that ended while nats-py says it is connected gets a
        reconnect forced (link.py); the link's changes are logged."""
        while not self._closing:
            try:
                await self._look_at_link()
            except Exception:  # a bug here must not end the watch: the next look may work
                log.exception("watching the NATS connection failed")
            await asyncio.sleep(LINK_WATCH_S)

    async def _look_at_link(self) -> None:
        before = self.link.state
        sample = LinkSample(bool(self._nc.is_connected), reading(self._nc), bool(self._nc.is_closed))
        force = self.link.observe(sample, asyncio.get_running_loop().time())
        if self.link.state is not before:
            self._link_changed(before)
        if force:
            await self._nc.force_reconnect()

    def _link_changed(self, before: Link) -> None:
        state = self.link.state
        if state is Link.DEAF:
            self._deaf_at = asyncio.get_running_loop().time()
            log.warning("NATS: connected but the read loop has ended (deaf): reconnecting")
        elif state is Link.LOST:
            log.error("NATS: %s; this process cannot mend it (its /livez fails)", self.link.why)
        elif state is Link.UP and self._deaf_at is not None:
            took = asyncio.get_running_loop().time() - self._deaf_at
            log.warning("NATS: the deaf connection reads again, %.1f s after it was found deaf", took)
            self._deaf_at = None

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """A core publish (the stream stores it all the same, with no round trip). Where the
        stream is replicated, one the stream confirms, sent again until it has stored it
        (confirmed.py); the caller does not wait for that either."""
        with mapped(f"publishing {subject}", self._denials):
            if len(body) > self.payloads.limit:  # (asked here: most bodies are small, and an await costs)
                headers, body = await self.payloads.outgoing(subject, body, headers)
            if self.confirmer is not None:
                await self.confirmer.publish(subject, body, headers)
            else:
                await self._nc.publish(subject, body, headers=headers)

    async def store(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> int:
        """A JetStream publish: returns once the stream has stored it, with its stream sequence."""
        with mapped(f"storing {subject}", self._denials):
            headers, body = await self.payloads.outgoing(subject, body, headers)
            return await self.acks.publish(subject, body, headers=headers)

    async def note_tail(self) -> None:
        """Read the stream's last sequence into `stored_to`: whatever is published from now on
        is stored after it (a process's first stores then need no ack of its own before)."""
        self.acks.saw(subjects.STREAM, (await self.stream_state()).last_seq)

    @property
    def reads_direct(self) -> bool:
        """A read bounded by a stored sequence (`read_stored(upto=)`) needs no consumer here."""
        return self._direct is not None

    def stored_to(self) -> int:
        """The highest sequence of the calls stream that a store on this connection was told
        it stored: anything published on it from now on is stored after it. (A stream made
        again starts over below it: wire.Open.read_after says how that is caught.)"""
        return self.acks.stored_to.get(subjects.STREAM, 0)

    async def store_once(self, subject: str, body: bytes, patience_s: float = 0.0) -> int:
        """A message a call has once (open, end of input, edge end, done, fin), stored with an
        ack. Its subject is unique in the call, so it is also its `Nats-Msg-Id`: a republish
        after a reconnect is deduplicated by the stream.

        An ack that does not come in time (a server slow under load answers after JetStream's
        5 s publish wait) is asked for again by publishing once more, until `patience_s` has
        passed: the repeat is dropped by the stream, so a slow server delays the call instead
        of failing it (so is one sent while the connection is down, BusUnavailable). Past
        `patience_s` the last failure is raised, at once one that is not recoverable. Its stream
        sequence (the first store's, where a repeat was dropped)."""
        return await retrying(
            lambda: self.store(subject, body, headers={"Nats-Msg-Id": subject}),
            Outage(f"storing {subject}", log),
            give_up_s=patience_s,
        )

    async def request(self, subject: str, body: bytes, timeout: float) -> bytes:
        with mapped(f"asking {subject}", self._denials):
            reply = await self.acks.request(subject, body, timeout)
        return bytes(reply.data)

    # -- subscribing -----------------------------------------------------------
    async def subscribe(self, subject: str, handler: Callable[[BusMsg], Awaitable[None]]) -> BusSubscription:
        """An ordinary subscription: each message awaits `handler` in the subscription's task."""
        with mapped(f"subscribing to {subject}", self._denials):
            return await self._nc.subscribe(subject, cb=handler)

    async def subscribe_direct(self, subject: str, handler: Callable[[BusMsg], None]) -> BusSubscription:
        """A subscription whose messages reach a plain function from the read loop (no task
        per message; see internals.py). The handler must not block."""
        with mapped(f"subscribing to {subject}", self._denials):
            return await subscribe_direct(self._nc, subject, handler)

    @staticmethod
    async def unsubscribe_all(subs: list[BusSubscription]) -> None:
        """Best effort: a subscription of a connection that is closing may already be gone."""
        for sub in subs:
            try:
                with mapped(f"unsubscribing {sub.subject}"):
                    await cast(Subscription, sub).unsubscribe()  # ours: nats-py's (subscribe)
            except BusError as e:  # closed, or gone already: nothing is left to undo
                log.debug("%s", e)

    async def ack(self, msg: BusMsg) -> None:
        """Acknowledge a message of a durable consumer (`Durable.fetch`)."""
        with mapped(f"acknowledging {msg.subject}", self._denials):
            await _nats_msg(msg).ack()

    async def answer(self, msg: BusMsg, body: bytes) -> None:
        """Reply to a request; nothing where the message asked for no reply."""
        if msg.reply:
            with mapped(f"answering {msg.subject}", self._denials):
                await _nats_msg(msg).respond(body)

    # -- reading the stream ----------------------------------------------------
    def is_stored(self, msg: BusMsg) -> bool:
        """The body is in the Object Store (it was over max_payload); `body()` fetches it."""
        return self.payloads.is_stored(msg.headers)

    async def body(self, msg: BusMsg) -> bytes:
        with mapped(f"reading the body of {msg.subject}", self._denials):
            return await self.payloads.body(msg.headers, msg.data)

    @staticmethod
    def stream_seq(msg: BusMsg) -> int:
        """The stream sequence of a message a consumer delivered (`Durable.fetch`), read from
        its reply subject; 0 for any other message."""
        try:
            return int(_nats_msg(msg).metadata.sequence.stream)
        except (NotJSMessageError, ValueError, IndexError):
            return 0

    async def last_stored(self, subject: str) -> bytes:
        """The body of the last message the stream holds on `subject` (BusNotFound: none)."""
        with mapped(f"reading the last {subject}", self._denials):
            m = await self._js.get_last_msg(subjects.STREAM, subject)
            return await self.payloads.body(m.headers, m.data or b"")

    async def read_stored(
        self, filters: list[str], after: int = 0, batch: int = 512, upto: int | None = None
    ) -> AsyncGenerator[tuple[str, bytes, int], None]:
        """Every message the stream holds on `filters`, oldest first: (subject, body, stream seq).
        With `after`, only those stored after that stream sequence: a reader that has read to
        some point reads again from there, not the whole call. At most `batch` messages are
        fetched at once (what a reader that stops early has fetched in vain).

        One ephemeral consumer, read to the end and deleted: the catch-up read of workers,
        the frontend's recovery of lost outputs and `duplexbus replay` all use it. With `upto`
        (a stream sequence already stored: a barrier the reader stored), only what was stored
        up to it; on a stream with one replica that is read without a consumer, by direct gets
        (direct.py: one request per filter and page, where a consumer costs three and the
        server's building it)."""
        if upto is not None and self._direct is not None:
            doing = f"reading {', '.join(filters)}"
            async with contextlib.aclosing(self._direct.read(filters, after, upto, batch)) as stored:
                while True:
                    with mapped(doing, self._denials):
                        s = await anext(stored, None)
                        if s is None:
                            return
                        body = await self.payloads.body(s.headers, s.data)
                    yield s.subject, body, s.seq
        async for m in self._stored_msgs(filters, after, batch):
            if upto is not None and m.metadata.sequence.stream > upto:
                return
            yield m.subject, await self.body(m), m.metadata.sequence.stream

    async def _stored_msgs(self, filters: list[str], after: int, batch: int) -> AsyncGenerator[Msg, None]:
        """As read_stored, nats-py's messages themselves (with `.metadata`: the stream's
        sequence and the time the stream stored each)."""
        cfg = ConsumerConfig(
            filter_subjects=filters,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after else DeliverPolicy.ALL,
            opt_start_seq=after + 1 if after else None,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        doing = f"reading {', '.join(filters)}"
        with mapped(doing, self._denials):
            info = await self._js.add_consumer(subjects.STREAM, cfg)
        pending = info.num_pending or 0
        try:
            if pending == 0:
                return
            with mapped(doing, self._denials):
                sub = await self._js.pull_subscribe_bind(consumer=info.name, stream=subjects.STREAM)
            try:
                led = False  # the consumer answered a pull once: it has its leader
                while pending > 0:
                    try:
                        msgs = await self._pull(sub, min(pending, batch), doing, leaderless_wait=not led)
                    except BusTimeout:
                        return
                    led = True
                    for m in msgs:
                        pending = m.metadata.num_pending
                        yield m
            finally:
                try:
                    with mapped(doing):
                        await sub.unsubscribe()
                except BusError as e:  # the consumer goes below either way
                    log.debug("unsubscribing a read: %s", e)
        finally:
            try:
                with mapped(doing, self._denials):
                    await self._js.delete_consumer(subjects.STREAM, info.name)
            except BusError as e:  # it is ephemeral: the server removes it after inactive_threshold
                log.debug("deleting a read's consumer: %s", e)

    async def _pull(self, sub: JetStreamContext.PullSubscription, n: int, doing: str, leaderless_wait: bool) -> list[Msg]:
        """A read's fetch. A consumer just made on a cluster takes no pull until its leader is
        elected: the server answers no responders (503) for a moment after the create was
        answered (1 read in 40 here, on an idle machine). With `leaderless_wait` (a consumer
        that has not answered yet) such a pull is asked again for up to LEADERLESS_WAIT_S while
        connected; without it, once."""
        deadline = time.monotonic() + (LEADERLESS_WAIT_S if leaderless_wait else 0.0)
        while True:
            try:
                with mapped(doing, self._denials):
                    return await sub.fetch(n, timeout=2.0)
            except BusUnavailable:
                if not self.is_connected or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(LEADERLESS_PAUSE_S)

    def history(self, filters: list[str], *, follow: bool = False, since: float | None = None) -> AsyncGenerator[Stored, None]:
        """What the stream holds on `filters` with its timestamps, oldest first, read fast (a
        push consumer: see history.py); with `follow`, then what it stores next."""
        return read_history(self._nc, self._js, self.payloads, self._denials, filters, follow, since)

    # -- readiness -------------------------------------------------------------
    async def has_stream(self) -> bool:
        try:
            with mapped("looking up the stream", self._denials):
                await self._js.stream_info(subjects.STREAM)
        except BusNotFound:
            return False
        return True

    async def service_alive(self, service: str, timeout: float) -> bool:
        """Whether an instance of `service` answers NATS service discovery's ping now."""
        try:
            await self.request(subjects.service_ping(service), b"", timeout)
        except BusError:
            return False
        return True

    # -- service discovery -----------------------------------------------------
    async def announce(
        self,
        name: str,
        version: str,
        description: str,
        metadata: dict[str, str],
        endpoints: Mapping[str, tuple[str, Callable[[bytes], Awaitable[bytes]]]],
    ) -> Announcement:
        """Answer NATS service discovery (`$SRV.PING/INFO/STATS`, so `nats micro ls` lists this
        process) with `endpoints`: endpoint name -> (subject, handler of a request's body).
        Once it returns, the endpoints answer: the round trip has the server take their
        subscriptions first (a request from another connection that reached the server before
        them found no responder, seen once in a full run)."""
        with mapped(f"announcing {name}", self._denials):
            svc = await micro.add_service(self._nc, name=name, version=version, description=description, metadata=metadata)
            for ep, (subject, handler) in endpoints.items():
                await svc.add_endpoint(name=ep, subject=subject, handler=_micro_handler(handler))
        await self.round_trip(ANNOUNCE_TIMEOUT_S)
        return Announcement(svc)

    # -- retention -------------------------------------------------------------
    async def stream_state(self) -> StreamState:
        """The bytes the stream holds now, and its first and last sequences."""
        with mapped("reading the stream's state", self._denials):
            info = await self._js.stream_info(subjects.STREAM)
        s = info.state
        return StreamState(int(s.bytes or 0), int(s.first_seq or 0), int(s.last_seq or 0))

    async def acked_to(self, durable: str, last_seq: int) -> int:
        """The stream sequence up to which `durable` has every message of its filter
        acknowledged: `last_seq` (the stream's last, read before this) where nothing is left
        to deliver or to acknowledge, else its ack floor (the last message of its filter it
        acknowledged, which lags the stream's last by the messages outside its filter)."""
        with mapped(f"asking about consumer {durable}", self._denials):
            info = await self._js.consumer_info(subjects.STREAM, durable)
        if not info.num_pending and not info.num_ack_pending:
            return last_seq
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

    async def purge_below(self, seq: int) -> None:
        """Remove every message the stream holds below sequence `seq` (its head: whole blocks)."""
        with mapped(f"removing the stream's messages below {seq}", self._denials):
            await self._js.purge_stream(subjects.STREAM, seq=seq)

    async def purge(self, subject: str) -> None:
        """Remove every message the stream holds on `subject` (a wildcard: a whole call)."""
        with mapped(f"purging {subject}", self._denials):
            await self._js.purge_stream(subjects.STREAM, subject=subject)

    async def stored_subjects(self, subject_filter: str) -> list[str]:
        """The subjects matching `subject_filter` that the stream holds messages on, page by
        page (the server gives up to 100,000 at a time; nats-py asks for the first page only)."""
        found: list[str] = []
        while True:
            request = json.dumps({"subjects_filter": subject_filter, "offset": len(found)}).encode()
            with mapped(f"listing {subject_filter}", self._denials):
                reply = await self._nc.request(subjects.js_api_stream_info(subjects.STREAM), request, timeout=30.0)
            info = json.loads(reply.data)
            if "error" in info:
                raise BusRefused(f"listing {subject_filter}", str(info["error"].get("description", info["error"])))
            page = list((info.get("state") or {}).get("subjects") or {})
            found += page
            if not page or len(found) >= int(info.get("total") or 0):
                return found

    # -- closing ---------------------------------------------------------------
    async def close(self, timeout: float = 2.0) -> None:
        """Flush what is written, then close. (nats-py's drain waits up to 30 s on the KV
        watchers' consumers; nothing here needs drain: unacked work is redelivered.)"""
        self._closing = True  # a close of ours is no lost link
        if self._link_task is not None:
            await cancel_and_wait(self._link_task)
        if self.confirmer is not None:
            await self.confirmer.close(timeout)
        try:
            with mapped("flushing before the close"):
                await asyncio.wait_for(self._nc.flush(), timeout)
        except BusError as e:  # a closed or unreachable server: what was not flushed is lost either way
            log.debug("%s", e)
        try:
            with mapped("closing"):
                await self._nc.close()
        except BusError as e:
            log.debug("%s", e)
        except RuntimeError as e:  # nats-py writes what is pending to a transport uvloop has closed (the server gone)
            log.debug("closing: %s", e)
