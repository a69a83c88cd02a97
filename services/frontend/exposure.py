"""Whether a frontend serves anyone who finds it: an open address with no bearer token.

Both `duplexbus frontend` (in its log, `server.serve`) and `duplexbus up` (at the terminal,
`duplexbus.supervisor`) say so; the rule lives here so neither imports the other.
"""

from __future__ import annotations

import ipaddress
import logging

from shared.runtime.config import ServingConfig


def open_warning(host: str, cfg: ServingConfig) -> str | None:
    """A frontend that other machines can reach and that asks for no token serves anyone who
    finds it: what to say, loudly, at start (it is a choice to make, not a default to miss)."""
    if cfg.auth.tokens or is_loopback(host):
        return None
    bar = "!" * 78
    return (
        f"{bar}\nThis frontend listens on {host}, reachable from other machines, and no bearer token is set:\n"
        f"anyone who reaches it can run calls. Set auth.tokens in the serving config (or $DUPLEXBUS_TOKENS).\n{bar}"
    )


def warn_if_open(host: str, cfg: ServingConfig) -> None:
    """The open_warning in the frontend's log (`duplexbus up` prints it at the terminal too)."""
    warning = open_warning(host, cfg)
    if warning is not None:
        logging.getLogger("duplexbus.frontend").warning("\n%s", warning)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
