"""Every error the system reports, each mapped to one client status."""

from __future__ import annotations


class DuplexError(Exception):
    """Root of all duplexbus errors. `status` is what a client sees."""

    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(DuplexError):
    status = 400


class ProtocolError(BadRequest):
    """A message that breaks the client protocol or the wire format."""


class LimitExceeded(BadRequest):
    """A configured bound was crossed; `limit` names its config key."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit}: {message}")
        self.limit = limit


class Unauthorized(DuplexError):
    """No bearer token, or one the frontend does not know (auth.tokens)."""

    status = 401


class Forbidden(DuplexError):
    """A browser page from an origin the frontend does not allow (auth.allowed_origins)."""

    status = 403


class MisdirectedHost(DuplexError):
    """A request naming a host the frontend does not serve (`Host` header): on a loopback
    frontend with no token, only loopback names and `auth.allowed_hosts` are taken, so a
    page on a rebinding DNS name (evil.example resolving to 127.0.0.1) reaches nothing."""

    status = 421

    def __init__(self, host: str, message: str) -> None:
        super().__init__(message)
        self.host = host


class UnknownCall(DuplexError):
    """No live call of that request_id on this socket."""

    status = 404


class Conflict(DuplexError):
    """A live call already uses that request_id."""

    status = 409


class BodyTooLarge(LimitExceeded):
    """A request announcing a body over a bound (its Content-Length), refused before any of it is read."""

    status = 413


class TooManyCalls(DuplexError):
    """One client holds as many calls as it may (`limit`: max_calls_per_socket or
    max_calls_per_token); its other calls go on, and a slot frees as one ends."""

    status = 429

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit}: {message}")
        self.limit = limit


class CallTimeout(DuplexError):
    status = 408


class Overloaded(DuplexError):
    """No capacity: admission cap, full queue, or no worker able to take the call."""

    status = 503


class Aborted(DuplexError):
    """The client or the system aborted the call."""

    status = 499


class WorkerFailed(DuplexError):
    status = 500


class ModelFailed(WorkerFailed):
    """A partition's own code failed a call: it raised in `during` (step, close_call,
    wants_step), or broke the model API there (an emission on an edge not its own). The
    client is told only which partition failed; the exception is in the worker's log."""

    def __init__(self, partition: str, during: str) -> None:
        super().__init__(f"partition {partition} failed")
        self.partition = partition
        self.during = during


class ConfigError(DuplexError):
    """Invalid serving config; `key` names the offending key. Raised at start-up."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class BusError(DuplexError):
    """The bus (NATS) failed an operation; `doing` says which. `recoverable`: the same
    operation may work later (a timeout, a server restarting, no connection); otherwise it
    will not without a change (permissions, a request the server refuses). A service retries
    the first kind and stops with a clear message on the second."""

    status = 503
    recoverable = True

    def __init__(self, doing: str, message: str) -> None:
        super().__init__(f"{doing}: {message}")
        self.doing = doing


class BusTimeout(BusError):
    """No answer in time (the server is slow, restarting, or out of reach)."""


class BusUnavailable(BusError):
    """Not connected, the connection closed, or no one answers on that subject."""


class BusNoResponders(BusUnavailable):
    """A request no subscriber of its subject answers: nobody is there now (where one may be
    later, as for any BusUnavailable; where exactly one holder subscribes, as a realtime
    session's, it means no one holds it)."""


class BusLost(BusUnavailable):
    """The connection cannot mend itself (deaf past a bound, or closed for good: see
    shared/bus/link.py): only a new process gets a new one."""

    recoverable = False


class BusNotFound(BusError):
    """The stream, consumer, bucket or key asked for does not exist."""

    status = 404


class BusDenied(BusError):
    """The server refused for want of permission, or the credentials were refused."""

    recoverable = False


class BusRefused(BusError):
    """The server refused the request itself (a bad request, a limit, storage full)."""

    recoverable = False


class KeyTaken(BusError):
    """A create in a KV bucket found the key already there (a live request_id, say)."""

    status = 409
    recoverable = False
