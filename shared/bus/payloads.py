"""Bodies over the server's max_payload go through the JetStream Object Store.

The message on the call's subject then carries no body and names the object in a header;
`body()` gives the bytes back either way. The bucket keeps them as long as the stream keeps
a call at most (`ServingConfig.stream_max_age_s`), with no byte limit, so neither a replayed
call nor a live one (a worker taking it over) misses its large payloads. They go by age
only: the conductor's removal of finished calls does not reach them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, NotFoundError
from nats.nuid import NUID

from shared.bus import subjects
from shared.runtime.config import ServingConfig

PAYLOAD_HEADER = "Duplex-Payload"
HEADROOM = 8192  # room for the subject and headers within max_payload


class Payloads:
    def __init__(self, js: JetStreamContext, config: ServingConfig, max_payload: int) -> None:
        self._js = js
        self.config = config
        self.limit = max_payload - HEADROOM
        self._store: Any = None  # nats-py's ObjectStore, made on first use
        self._nuid = NUID()

    async def _bucket(self) -> Any:
        if self._store is None:
            try:
                self._store = await self._js.object_store(subjects.OBJ_PAYLOADS)
            except NotFoundError:
                cfg = ObjectStoreConfig(
                    bucket=subjects.OBJ_PAYLOADS,
                    ttl=self.config.stream_max_age_s,
                    storage=StorageType.FILE,
                    replicas=self.config.retention.replicas,
                )
                try:
                    self._store = await self._js.create_object_store(subjects.OBJ_PAYLOADS, config=cfg)
                except BadRequestError:
                    self._store = await self._js.object_store(subjects.OBJ_PAYLOADS)
        return self._store

    async def outgoing(self, subject: str, body: bytes, headers: dict[str, str] | None) -> tuple[dict[str, str] | None, bytes]:
        """(headers, body) to publish: a body over the limit is put in the Object Store and
        named in a header instead."""
        if len(body) <= self.limit:
            return headers, body
        name = f"{subject}.{self._nuid.next().decode()}"
        await (await self._bucket()).put(name, body)
        return {**(headers or {}), PAYLOAD_HEADER: name}, b""

    @staticmethod
    def is_stored(headers: Mapping[str, str] | None) -> bool:
        return bool(headers and headers.get(PAYLOAD_HEADER))

    async def body(self, headers: Mapping[str, str] | None, data: bytes) -> bytes:
        """The message's body, fetched from the Object Store when it was too large to carry."""
        name = headers.get(PAYLOAD_HEADER) if headers else None
        if not name:
            return bytes(data)
        result = await (await self._bucket()).get(name)
        return bytes(result.data or b"")
