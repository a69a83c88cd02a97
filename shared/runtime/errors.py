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


class UnknownCall(DuplexError):
    """No live call of that request_id on this socket."""

    status = 404


class Conflict(DuplexError):
    """A live call already uses that request_id."""

    status = 409


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


class ConfigError(DuplexError):
    """Invalid serving config; `key` names the offending key. Raised at start-up."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
