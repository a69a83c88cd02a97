"""nats-py's exceptions, translated into shared.runtime.errors at the edge of the bus package.

Above the bus, code catches `BusError` (and asks `recoverable`) rather than nats-py's
classes, which no module outside shared/bus imports.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Literal

from nats import errors as nerr
from nats.js import errors as jerr

from shared.runtime.errors import (
    BusDenied,
    BusError,
    BusNoResponders,
    BusNotFound,
    BusRefused,
    BusTimeout,
    BusUnavailable,
    KeyTaken,
)

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a write conditional on a revision that moved on
DENIAL_MEMORY_S = 10.0  # a timeout this soon after a permissions violation is taken for that violation


class Denials:
    """The server reports a permissions violation on the side (an asynchronous -ERR), and
    the request it refused then simply times out. Remembering the last violation lets that
    timeout be told apart from a slow server: it is a `BusDenied`, not worth retrying."""

    def __init__(self) -> None:
        self.last: tuple[float, str] | None = None

    def saw(self, text: str) -> None:
        self.last = (time.monotonic(), text)

    def recent(self) -> str | None:
        if self.last is not None and time.monotonic() - self.last[0] < DENIAL_MEMORY_S:
            return self.last[1]
        return None


def translate(e: BaseException, doing: str, denials: Denials | None = None) -> BusError | None:
    """The BusError for a nats-py exception, or None for anything that is not one."""
    if isinstance(e, BusError):
        return e
    if isinstance(e, jerr.KeyWrongLastSequenceError) or getattr(e, "err_code", None) == WRONG_LAST_SEQUENCE:
        # (a conditional delete or purge reports it as a plain bad request with this code)
        return KeyTaken(doing, "the key exists (or changed since the revision given)")
    if isinstance(e, jerr.NotFoundError | jerr.NoKeysError):
        return BusNotFound(doing, _text(e))
    if isinstance(e, nerr.AuthorizationError | nerr.InvalidUserCredentialsError):
        return BusDenied(doing, _text(e))
    if isinstance(e, jerr.ServiceUnavailableError | jerr.NoStreamResponseError):
        return BusUnavailable(doing, _text(e))
    if isinstance(e, jerr.APIError):
        return BusRefused(doing, _text(e))
    if isinstance(e, nerr.TimeoutError | TimeoutError):
        denied = denials.recent() if denials is not None else None
        if denied is not None:
            return BusDenied(doing, f"no answer after the server said {denied!r}")
        return BusTimeout(doing, "no answer in time")
    if isinstance(e, nerr.NoRespondersError):
        return BusNoResponders(doing, "no one answers on this subject")
    if isinstance(e, nerr.NoServersError):
        return BusUnavailable(doing, "no server answered")
    if isinstance(e, nerr.Error):
        if "permissions violation" in str(e).lower():
            return BusDenied(doing, _text(e))
        return BusUnavailable(doing, _text(e))
    return None


class mapped:  # a context manager, used as the function it was: `with mapped(...)`
    """Raise nats-py's exceptions inside as the matching BusError (the original chained).

    A class rather than a generator context manager: it wraps every publish, a few thousand a
    second in each process under load, and costs a third as much (about 0.4 µs against 1.4)."""

    __slots__ = ("denials", "doing")

    def __init__(self, doing: str, denials: Denials | None = None) -> None:
        self.doing = doing
        self.denials = denials

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> Literal[False]:
        if not isinstance(e, Exception):  # none, or not ours to translate (a cancellation)
            return False
        err = translate(e, self.doing, self.denials)
        if err is None or err is e:
            return False  # raised as it is
        raise err from e


def _text(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.removeprefix("nats: ")
