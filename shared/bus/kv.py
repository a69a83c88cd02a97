"""KV buckets as the services use them: heartbeats, call records, request_ids.

`Bucket` wraps a nats-py KeyValue so that no service imports nats-py: its failures come
out as `BusError`s (shared.runtime.errors), a create that finds the key as `KeyTaken`,
and entries as plain `KvEntry` values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import api
from nats.js.errors import APIError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KV_OP, KV_PURGE, MSG_ROLLUP_SUBJECT, KeyValue

from shared.bus.acks import Acks, check_key
from shared.bus.failures import Denials, mapped
from shared.runtime import healthfile
from shared.runtime.errors import BusError, BusNotFound, KeyTaken
from shared.runtime.process import every

log = logging.getLogger(__name__)

PUT, DELETE, PURGE = "PUT", "DEL", "PURGE"

# How long the marker a removed key leaves stays (whole seconds, the server's least is 1). A
# plain KV delete leaves its marker forever: one per call in duplex_calls and
# duplex_request_ids, which every listing of keys (the conductor's restore) read again.
# Watches see the marker as it is written; nothing reads it later.
MARKER_TTL_S = 2
WRONG_LAST_SEQUENCE = 10071  # the server's code for a conditional write that lost
CREATE_TRIES = 3  # a create racing a removal's marker as it expires tries again
PROBE_KEY = "_probe"  # never stored: writes to it are conditional on a revision no key reaches


@dataclass(frozen=True)
class KvEntry:
    key: str
    value: bytes
    revision: int
    operation: str  # PUT, DEL or PURGE

    @property
    def removed(self) -> bool:
        return self.operation in (DELETE, PURGE)


def _entry(e: Any) -> KvEntry:
    return KvEntry(e.key, bytes(e.value or b""), int(e.revision or 0), e.operation or PUT)


class Watch:
    """Every change of a bucket, as it happens (after the entries it holds now)."""

    def __init__(self, watcher: Any, bucket: str, denials: Denials) -> None:
        self._w = watcher
        self._what = f"watching {bucket}"
        self._denials = denials

    async def next(self, timeout: float) -> KvEntry | None:
        """The next change; None marks the end of the entries that were there at the start.
        Raises BusTimeout when none comes within `timeout`."""
        with mapped(self._what, self._denials):
            e = await self._w.updates(timeout=timeout)
        return None if e is None else _entry(e)

    async def stop(self) -> None:
        try:
            with mapped(self._what, self._denials):
                await self._w.stop()
        except BusError as e:  # the watch is left either way; its consumer expires on the server
            log.debug("stopping a watch: %s", e)


class Bucket:
    """Reads and watches through nats-py's KeyValue; writes (a put, a create, a removal) are
    the stored publishes nats-py's KeyValue makes, through the connection's `Acks`, which
    awaits them at less than half the CPU (acks.py)."""

    def __init__(self, kv: KeyValue, name: str, denials: Denials, acks: Acks) -> None:
        self._kv = kv
        self.name = name
        self._denials = denials
        self._acks = acks

    async def _write(
        self, key: str, value: bytes, headers: dict[str, str] | None = None, timeout: float | None = None, ttl: int | None = None
    ) -> int:
        """A write to `key` with `headers`, as nats-py's KeyValue writes (its purge takes no
        expected revision): the entry's revision."""
        check_key(key)
        return await self._acks.publish(f"{self._kv._pre}{key}", value, headers=headers, timeout=timeout, msg_ttl=ttl)

    def _doing(self, what: str, key: str | None = None) -> contextlib.AbstractContextManager[None]:
        return mapped(f"{what} {self.name}" + (f"/{key}" if key else ""), self._denials)

    async def create(self, key: str, value: bytes) -> int:
        """Store `value` under a key that must not exist yet (KeyTaken if it does): its revision.

        A removed key holds a marker for MARKER_TTL_S, and a create over it names the marker's
        revision; the marker may expire between reading it and writing, and nats-py's create
        then fails ("key not found", or the key taken). So: write on the condition that the
        key holds nothing, else what its last entry is a marker of, read afresh each try."""
        last = 0
        for _ in range(CREATE_TRIES):
            try:
                with self._doing("create", key):  # nats-py's KeyValue.update, as written
                    return await self._write(key, value, {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)})
            except KeyTaken:
                pass
            try:
                with self._doing("create", key):
                    await self._kv.get(key)
            except BusNotFound as e:  # nothing there, or a marker (nats-py gives its entry)
                marker = getattr(e.__cause__, "entry", None)
                last = int(marker.revision) if marker is not None and marker.revision else 0
                continue
            break  # a value is there
        raise KeyTaken(f"create {self.name}/{key}", "the key exists")

    async def put(self, key: str, value: bytes) -> int:
        with self._doing("put", key):
            return await self._write(key, value)

    async def get(self, key: str) -> KvEntry | None:
        """The entry, or None where the key does not exist or was deleted."""
        try:
            with self._doing("get", key):
                return _entry(await self._kv.get(key))
        except BusNotFound:
            return None

    async def delete(self, key: str, last: int = 0) -> None:
        """Remove `key`; with `last`, only if its revision is still that one (KeyTaken otherwise).

        Written as a purge whose marker expires after MARKER_TTL_S, so removed keys leave
        nothing behind (watchers see a PURGE, which `KvEntry.removed` counts as a delete)."""
        headers = {KV_OP: KV_PURGE, api.Header.ROLLUP: MSG_ROLLUP_SUBJECT}
        if last:
            headers[api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)
        with self._doing("delete", key):
            try:
                await self._write(key, b"", headers, ttl=MARKER_TTL_S)
            except APIError as e:
                if e.err_code == WRONG_LAST_SEQUENCE:
                    raise KeyWrongLastSequenceError(description=e.description) from e
                raise

    async def writable(self, timeout: float) -> bool:
        """Whether the bucket takes writes now: its stream has a leader that answers. Asked with
        a write the leader must refuse (a revision no key reaches), so nothing is stored; a
        refusal within `timeout` is the answer wanted."""
        headers: dict[str, str] = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(2**62)}
        try:
            with self._doing("probing", PROBE_KEY):
                await self._write(PROBE_KEY, b"", headers, timeout=timeout)
        except KeyTaken:  # the refusal asked for: a leader answered
            return True
        except BusError as e:
            # No answer, no responders, no connection, another refusal: the bus's failures
            # alone mean "not writable now". Anything else is a bug, raised: taken for "not
            # writable" it would stop the conductor's liveness for good without a word.
            log.debug("bucket %s not writable: %s", self.name, e)
            return False
        return True

    async def keys(self) -> list[str]:
        """The keys that exist now ([] for an empty bucket)."""
        try:
            with self._doing("list"):
                return list(await self._kv.keys())
        except BusNotFound as e:
            if isinstance(e.__cause__, NoKeysError):
                return []
            raise

    async def watch(self) -> Watch:
        with self._doing("watch"):
            return Watch(await self._kv.watchall(), self.name, self._denials)

    async def heartbeat(self, key: str, payload: Callable[[], bytes], period: float) -> None:
        """Put `payload()` under `key` every `period` seconds until cancelled (a failed put is
        logged and tried again next period; the bucket's TTL ends a process that stops)."""

        async def beat() -> None:
            await self.put(key, payload())
            healthfile.beat()  # stored: the conductor sees this process alive, and so may a healthcheck

        await every(period, beat, f"heartbeat {self.name}/{key}")

    async def delete_if_there(self, key: str, timeout: float = 2.0) -> None:
        """On a clean exit: remove a heartbeat or record, within `timeout`. Failing is logged,
        not raised: the bucket's TTL (or a later owner) removes it instead."""
        try:
            await asyncio.wait_for(self.delete(key), timeout)
        except (BusError, TimeoutError) as e:
            log.warning("could not delete %s/%s (%s); it expires by itself", self.name, key, e or "timeout")

    async def release(self, key: str, owner: bytes, revision: int = 0) -> None:
        """Free a key that `owner` holds (a live call's request_id), only if it still does: a
        new call may hold it now. With the revision that reserved it, that is one round trip:
        the delete is refused where the key has changed since. A failure is logged; the
        conductor frees the request_ids of a frontend that is gone."""
        try:
            if not revision:
                entry = await self.get(key)
                if entry is None or entry.value != owner:
                    return
                revision = entry.revision
            await self.delete(key, last=revision)
        except BusError as e:
            if e.status != 409:  # 409: it changed hands since, which is no failure
                log.warning("freeing %s/%s failed: %s", self.name, key, e)
