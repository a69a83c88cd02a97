"""Which `Host` a frontend answers (pure: no I/O); `app.HostCheck` asks before any route runs.

DNS rebinding: a page on evil.example whose name its owner then points at 127.0.0.1 is, to
the browser, still evil.example. Its requests reach a frontend on loopback with
`Host: evil.example` and `Origin: http://evil.example`, which the Origin check (`auth.py`)
takes for the frontend's own page; without a token nothing else stops them. The Host header
names the attacker's domain, though, and a page cannot set it. So a connection that came
over loopback to a frontend without tokens is answered only when its Host is `localhost` or
an IP address (an address is never a rebinding's name: a page that names one is a page of
that address, and cross-origin requests from elsewhere are the Origin check's), or a name
in `auth.allowed_hosts` (a reverse proxy's on the same machine, say).

With tokens a rebinding page gets nothing (it cannot know one), and a frontend reached over
another interface is reached by whatever name the operator gave it: neither is checked
unless `auth.allowed_hosts` lists names, which then holds on every connection.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from shared.runtime.config import ServingConfig
from shared.runtime.errors import MisdirectedHost

NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # a DNS name as a Host header carries it (lower case)
LOOPBACK_NAMES = frozenset({"localhost"})


@dataclass(frozen=True)
class HostRule:
    allowed: tuple[str, ...] = ()  # auth.allowed_hosts, lower case: `name`, `.domain`, `*`
    tokens: bool = False  # auth.tokens set: a rebinding page cannot use the frontend

    @classmethod
    def from_config(cls, cfg: ServingConfig) -> HostRule:
        return cls(tuple(h.strip().lower().rstrip(".") for h in cfg.auth.allowed_hosts if h.strip()), bool(cfg.auth.tokens))

    def applies(self, local_addr: str | None) -> bool:
        """Whether a connection to `local_addr` (the frontend's end of it; None: not known,
        as for a socket of another family) has its Host checked."""
        if self.allowed:
            return True
        return not self.tokens and (local_addr is None or is_loopback_address(local_addr))

    def refusal(self, host: str | None, local_addr: str | None) -> MisdirectedHost | None:
        """None where the request may go on; the refusal (421) otherwise. A request without a
        Host header is no browser's, and goes on."""
        if host is None or not self.applies(local_addr):
            return None
        name = host_name(host)
        if name is not None and (name in LOOPBACK_NAMES or _is_address(name) or self._listed(name)):
            return None
        shown = name if name is not None else host[:100]
        why = "is not in auth.allowed_hosts" if self.allowed else "is not a loopback name or address"
        return MisdirectedHost(
            shown, f"host {shown!r} {why}: this frontend answers it only once it is added to auth.allowed_hosts"
        )

    def _listed(self, name: str) -> bool:
        for allowed in self.allowed:
            if allowed == "*" or name == allowed:
                return True
            if allowed.startswith(".") and (name == allowed[1:] or name.endswith(allowed)):
                return True
        return False


def host_name(host: str) -> str | None:
    """The name or address a Host header carries, port and brackets left out, lower case, a
    trailing dot dropped; None for what is neither."""
    h = host.strip().lower()
    if h.startswith("["):  # an IPv6 address, maybe with a port
        end = h.find("]")
        if end < 0 or (h[end + 1 :] and not re.fullmatch(r":\d{1,5}", h[end + 1 :])):
            return None
        inner = h[1:end]
        return inner if _is_address(inner) else None
    if h.count(":") > 1:  # an IPv6 address without brackets: not a valid Host, but unambiguous
        return h if _is_address(h) else None
    name, _, port = h.partition(":")
    if port and not re.fullmatch(r"\d{1,5}", port):
        return None
    name = name.rstrip(".")
    return name if NAME.fullmatch(name) else None


def is_loopback_address(addr: str) -> bool:
    """127.0.0.0/8, ::1, and an IPv4 loopback address as a dual-stack socket shows it (::ffff:127.0.0.1)."""
    try:
        ip = ipaddress.ip_address(addr.strip("[]").split("%", 1)[0])
    except ValueError:
        return addr == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
