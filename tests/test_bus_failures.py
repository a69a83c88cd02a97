"""nats-py's exceptions come out of the bus package as BusErrors with the right status and
recoverable mark; a timeout right after a permissions violation is a denial, not a slow server."""

from __future__ import annotations

import pytest
from nats import errors as nerr
from nats.js import errors as jerr

from shared.bus.failures import Denials, mapped, translate
from shared.runtime.errors import (
    BusDenied,
    BusError,
    BusNoResponders,
    BusNotFound,
    BusRefused,
    BusTimeout,
    BusUnavailable,
    DuplexError,
    KeyTaken,
)


@pytest.mark.parametrize(
    ("exc", "kind", "status", "recoverable"),
    [
        (nerr.TimeoutError(), BusTimeout, 503, True),
        (TimeoutError(), BusTimeout, 503, True),
        (nerr.NoRespondersError(), BusNoResponders, 503, True),
        (nerr.ConnectionClosedError(), BusUnavailable, 503, True),
        (nerr.AuthorizationError(), BusDenied, 503, False),
        (nerr.Error('nats: permissions violation for publish to "call.x.abort"'), BusDenied, 503, False),
        (jerr.ServiceUnavailableError(), BusUnavailable, 503, True),
        (jerr.NotFoundError(code=404, description="stream not found"), BusNotFound, 404, True),
        (jerr.KeyWrongLastSequenceError(description="wrong last sequence: 3"), KeyTaken, 409, False),
        (jerr.BadRequestError(code=400, err_code=10071, description="wrong last sequence: 7"), KeyTaken, 409, False),
        (jerr.BadRequestError(code=400, description="insufficient resources"), BusRefused, 503, False),
    ],
)
def test_nats_exceptions_translate_with_status_and_mark(
    exc: Exception, kind: type[BusError], status: int, recoverable: bool
) -> None:
    err = translate(exc, "doing a thing")
    assert type(err) is kind
    assert err is not None and err.status == status and err.recoverable is recoverable
    assert err.message.startswith("doing a thing: ") and isinstance(err, DuplexError)


def test_other_exceptions_are_not_translated() -> None:
    assert translate(ValueError("a bug"), "x") is None
    with pytest.raises(ValueError), mapped("x"):
        raise ValueError("a bug")


def test_mapped_chains_the_original() -> None:
    with pytest.raises(BusTimeout) as e, mapped("asking ctl.worker.w1.assign"):
        raise nerr.TimeoutError()
    assert isinstance(e.value.__cause__, nerr.TimeoutError)
    assert e.value.doing == "asking ctl.worker.w1.assign"


def test_a_timeout_after_a_permissions_violation_is_a_denial() -> None:
    denials = Denials()
    assert isinstance(translate(nerr.TimeoutError(), "x", denials), BusTimeout)
    denials.saw('Permissions Violation for Subscription to "call.>"')
    err = translate(nerr.TimeoutError(), "x", denials)
    assert isinstance(err, BusDenied) and not err.recoverable
    assert "Permissions Violation" in err.message
