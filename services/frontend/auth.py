"""Who may start work on a frontend: bearer tokens and an Origin allow-list (pure: no I/O).

- **Tokens** (`auth.tokens` in the serving config, or `$DUPLEXBUS_TOKENS`, comma-separated):
  where any is set, `POST /generate`, `WS /generate/ws` and `WS /v1/realtime` need one, as
  `Authorization: Bearer TOKEN` or, from a browser (which cannot set headers on a WebSocket),
  as the WebSocket subprotocol `duplexbus.bearer.TOKEN` (or `openai-insecure-api-key.TOKEN`,
  what OpenAI's browser clients send). The frontend then accepts the socket with that
  subprotocol, as browsers require. Tokens are compared in constant time.
- **Origins**: a request that carries an `Origin` (every browser does, on a WebSocket and on a
  cross-origin POST) is refused unless that origin is the frontend's own (the page at `/`),
  or listed in `auth.allowed_origins`. Clients that are not browsers send none and are let
  through (to the token check). This is what stops any web page a user visits from driving
  their local frontend.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.runtime.errors import Forbidden, Unauthorized

SUBPROTOCOL_PREFIXES = ("duplexbus.bearer.", "openai-insecure-api-key.")


@dataclass(frozen=True)
class Grant:
    """Let in; `subprotocol` is the one to accept the socket with (the one that carried the token).
    `client` names the token that let it in (`token 1`, by its place; never the token itself),
    which its calls count against (`shares.py`); None without tokens."""

    subprotocol: str | None = None
    client: str | None = field(default=None, compare=False)


class Access:
    def __init__(self, tokens: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> None:
        self.tokens = [t.encode() for t in tokens if t]
        self.allowed_origins = {_origin(o) for o in allowed_origins}

    @property
    def needs_token(self) -> bool:
        return bool(self.tokens)

    def check(
        self, headers: Mapping[str, str], scheme: str, subprotocols: Iterable[str] = ()
    ) -> Grant | Forbidden | Unauthorized:
        """Headers as the client sent them (lower-case names), the request's scheme (http, ws, ...)."""
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", ""), scheme):
            return Forbidden(f"origin {origin!r} is not allowed (auth.allowed_origins)")
        if not self.tokens:
            return Grant()
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and (which := self._which(auth[7:].strip())) is not None:
            return Grant(client=which)
        for proto in subprotocols:
            for prefix in SUBPROTOCOL_PREFIXES:
                if proto.startswith(prefix) and (which := self._which(proto[len(prefix) :])) is not None:
                    return Grant(subprotocol=proto, client=which)
        return Unauthorized("a bearer token is needed (Authorization: Bearer TOKEN)")

    def bearer(self, headers: Mapping[str, str]) -> bool:
        """An `Authorization: Bearer` header with a known token (`/metrics`: no subprotocols, no Origin rule)."""
        auth = headers.get("authorization", "")
        return auth[:7].lower() == "bearer " and self._which(auth[7:].strip()) is not None

    def _which(self, token: str) -> str | None:
        """The label of the token given (`token N`, by its place), None if it is not one."""
        given = token.encode()
        # Every token is compared, whatever matched, so the time taken says nothing.
        matches = [hmac.compare_digest(given, t) for t in self.tokens]
        return f"token {matches.index(True) + 1}" if any(matches) else None

    def _origin_allowed(self, origin: str, host: str, scheme: str) -> bool:
        o = _origin(origin)
        if o in self.allowed_origins:
            return True
        secure = scheme in ("https", "wss")
        return o == _origin(f"{'https' if secure else 'http'}://{host}")


def _origin(url: str) -> str:
    """scheme://host[:port], lower case, default ports left out: the form browsers send."""
    parts = urlsplit(url.strip().lower())
    port = parts.port
    default = {"http": 80, "https": 443}.get(parts.scheme)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port and port != default else "")
