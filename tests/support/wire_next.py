"""The wire format's next minor, for tests of rolling upgrades.

It is today's `shared/bus/wire.py` as the next release would write it: the minor raised by
one and one optional field added to every message kind (on the base struct). Run as
`python -m tests.support.wire_next ROLE ...`, this module is a duplexbus process
(`duplexbus.cli`) that speaks that minor; `load` gives it in-process under a name of its
own, beside the real one, for pure tests.

Built from the source text rather than by patching classes: a struct's defaults (the
minor in `vm`) are fixed when it is defined, and this way the two versions differ exactly
as two releases would.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import shared.bus

WIRE = Path(shared.bus.__file__).parent / "wire.py"
ADDED_FIELD = "trace_id"  # what the next minor adds: a str whose default, "", means "none"
_BASE_VM = "    vm: int = MINOR\n"


def source(release: str = "next") -> str:
    """wire.py as `release` writes it: "next", the next minor; "before_minors", the 1.0
    release's structs, which had no `vm` (for its reader only: its error text differed)."""
    text = WIRE.read_text()
    found = re.search(r"^MINOR = (\d+)$", text, re.MULTILINE)
    if found is None or _BASE_VM not in text:
        raise RuntimeError(f"{WIRE} has no `MINOR = n` or no `vm` field on its base struct: update this module")
    if release == "before_minors":
        return text.replace(_BASE_VM, "", 1)
    if release != "next":
        raise ValueError(f"no release {release!r}")
    text = text[: found.start()] + f"MINOR = {int(found.group(1)) + 1}" + text[found.end() :]
    return text.replace(_BASE_VM, f'{_BASE_VM}    {ADDED_FIELD}: str = ""\n', 1)


def load(name: str, release: str = "next") -> types.ModuleType:
    """That release's wire module as module `name` (msgspec resolves the structs'
    annotations through sys.modules, so it is registered there before it runs)."""
    text = source(release)
    mod = types.ModuleType(name)
    mod.__file__ = str(WIRE)
    sys.modules[name] = mod
    exec(compile(text, str(WIRE), "exec"), mod.__dict__)
    return mod


def install() -> types.ModuleType:
    """Make the next minor this process's `shared.bus.wire`: before anything imports it."""
    if "shared.bus.wire" in sys.modules:
        raise RuntimeError("shared.bus.wire is imported already: install the next minor first")
    mod = load("shared.bus.wire")
    setattr(shared.bus, "wire", mod)  # noqa: B010 (mypy knows the attribute as the real module's)
    return mod


if __name__ == "__main__":
    install()
    from duplexbus.cli import main

    sys.exit(main())
