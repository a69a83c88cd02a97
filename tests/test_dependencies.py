"""The uvicorn internals the frontend relies on are where it expects them.

services/frontend/websocket.py, http.py and server.py subclass uvicorn's protocol and server
classes and use their private attributes and methods, which uvicorn may rename in any minor
release (pyproject.toml pins one minor for that reason). This reads the frontend's classes
and checks, for each, against the uvicorn installed:

- every `self.X` it uses and does not define is uvicorn's: a method or attribute of a base
  class, or an attribute a base class's code sets;
- every method it overrides (all but its own, listed below) is still a method of a base
  class, with the same parameters: a renamed hook would otherwise be silently never called;
- every call it makes on `self.X(...)` or `super().X(...)` binds to uvicorn's signature;
- the websockets protocol object it reaches into (`self.conn`) has what it uses;
- `uvicorn.Config` takes every keyword the frontend's `serve` gives it.

An upgrade that moves any of these fails here, naming it, and not in production.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import uvicorn
from packaging.requirements import Requirement
from websockets.server import ServerProtocol

from services.frontend import http, server, websocket
from tests.support.source import parse

ROOT = Path(__file__).resolve().parent.parent

# The frontend's own methods (not overrides): a method not listed here must be uvicorn's.
OWN_METHODS: dict[type, set[str]] = {
    websocket.FrontendWebSocketProtocol: {
        "with_send_buffer",
        "send_now",
        "backlog",
        "has_room",
        "_send_frame",
        "_sent",
        "_may_idle",
        "_flush",
        "_give_up",
        "_report",
        "load",
        "shed",
        "_shut_after_drain",
    },
    http.FrontendHttpProtocol: {"_refuse", "load", "shed"},
    server.FrontendServer: set(),
}
CLASSES = [(websocket, websocket.FrontendWebSocketProtocol), (http, http.FrontendHttpProtocol), (server, server.FrontendServer)]


@dataclass
class Uses:
    """What a class's source does with `self` and `super()`."""

    methods: set[str] = field(default_factory=set)  # defined in the class body
    class_attrs: set[str] = field(default_factory=set)
    init_sets: set[str] = field(default_factory=set)  # self.X = ... in its __init__
    names: set[str] = field(default_factory=set)  # every self.X, read or written
    calls: list[tuple[bool, str, int, tuple[str, ...]]] = field(default_factory=list)  # (on super(), name, args, keywords)
    conn_chains: set[tuple[str, ...]] = field(default_factory=set)  # self.conn.A.B...


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _chain(node: ast.Attribute) -> tuple[str, ...] | None:
    """("conn", "reader", "buffer") for self.conn.reader.buffer; None for a chain not on self."""
    parts: list[str] = []
    cur: ast.AST = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    return tuple(reversed(parts)) if _is_self(cur) else None


def _class_node(module: ModuleType, name: str) -> ast.ClassDef:
    tree = parse(inspect.getsource(module))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def uses_of(module: ModuleType, cls: type) -> Uses:
    node = _class_node(module, cls.__name__)
    u = Uses()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            u.methods.add(item.name)
        elif isinstance(item, ast.Assign | ast.AnnAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            u.class_attrs |= {t.id for t in targets if isinstance(t, ast.Name)}
    init = next(i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__")
    for n in ast.walk(init):
        if isinstance(n, ast.Attribute) and _is_self(n.value) and isinstance(n.ctx, ast.Store):
            u.init_sets.add(n.attr)
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and _is_self(n.value):
            u.names.add(n.attr)
        if isinstance(n, ast.Attribute) and (chain := _chain(n)) and chain[0] == "conn" and len(chain) > 1:
            u.conn_chains.add(chain)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            on_super = _is_super(n.func.value)
            passed_on = any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords)
            if (on_super or _is_self(n.func.value)) and not passed_on:  # *args, **kwargs: whatever came
                u.calls.append((on_super, n.func.attr, len(n.args), tuple(k.arg for k in n.keywords if k.arg)))
    return u


def set_by_base(cls: type) -> set[str]:
    """Every attribute a base class's code sets on self (in any method: uvicorn sets some only
    once a connection is made, or a server started)."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base is object or not base.__module__.startswith("uvicorn"):
            continue
        tree = parse(textwrap.dedent(inspect.getsource(base)))
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _is_self(n.value) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
    return names


def base_has(cls: type, name: str) -> Any:
    """The base classes' attribute `name`, or None."""
    for base in cls.__mro__[1:]:
        if name in vars(base):
            return vars(base)[name]
    return None


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("module", "cls"), CLASSES, ids=lambda c: getattr(c, "__name__", ""))
def test_every_uvicorn_attribute_the_frontend_uses_is_there(module: ModuleType, cls: type) -> None:
    u = uses_of(module, cls)
    own = u.methods | u.class_attrs | u.init_sets
    theirs = u.names - own
    missing = sorted(n for n in theirs if base_has(cls, n) is None and n not in set_by_base(cls))
    assert missing == [], f"uvicorn {uvicorn.__version__} no longer has what {cls.__name__} uses: {missing}"


@pytest.mark.parametrize(("module", "cls"), CLASSES, ids=lambda c: getattr(c, "__name__", ""))
def test_every_override_still_overrides_a_uvicorn_method_of_the_same_parameters(module: ModuleType, cls: type) -> None:
    u = uses_of(module, cls)
    # __init__ is left out: uvicorn builds a protocol with keywords its own code passes (ours
    # takes any and passes them on), and the frontend builds its server itself.
    overrides = u.methods - OWN_METHODS[cls] - {"__init__"}
    gone = sorted(m for m in overrides if not callable(base_has(cls, m)))
    assert gone == [], f"{cls.__name__} overrides what uvicorn {uvicorn.__version__} no longer has: {gone}"
    for name in sorted(overrides):
        ours = vars(cls)[name]
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in inspect.signature(ours).parameters.values()):
            continue  # takes whatever uvicorn passes (and passes it on)
        assert _params(ours) == _params(base_has(cls, name)), f"{cls.__name__}.{name}: uvicorn's parameters changed"


@pytest.mark.parametrize(("module", "cls"), CLASSES, ids=lambda c: getattr(c, "__name__", ""))
def test_every_call_on_uvicorn_binds_to_its_signature(module: ModuleType, cls: type) -> None:
    u = uses_of(module, cls)
    checked = 0
    for on_super, name, nargs, keywords in u.calls:
        if not on_super and name in u.methods | u.init_sets | u.class_attrs:
            continue  # the frontend's own, or an attribute holding a callable (on_room, busy)
        fn = base_has(cls, name)
        if not callable(fn):
            continue  # an attribute uvicorn sets (its loop, its transport): checked above
        try:
            inspect.signature(fn).bind(None, *([None] * nargs), **dict.fromkeys(keywords))
        except TypeError as e:
            pytest.fail(f"{cls.__name__} calls uvicorn {uvicorn.__version__}'s {name} as it no longer takes: {e}")
        checked += 1
    assert checked > 0


def test_the_websockets_protocol_object_has_what_the_frontend_reaches_into() -> None:
    u = uses_of(websocket, websocket.FrontendWebSocketProtocol)
    assert ("conn", "reader", "buffer") in u.conn_chains  # the unparsed bytes a partial message holds
    conn = ServerProtocol()  # sans-I/O: no socket
    for chain in sorted(u.conn_chains):
        obj: Any = conn
        for part in chain[1:]:
            assert hasattr(obj, part), f"websockets' ServerProtocol has no {'.'.join(chain[1:])}"
            obj = getattr(obj, part)
    assert len(conn.reader.buffer) == 0  # a sized buffer: its length is counted against the guard


def test_uvicorn_config_takes_every_keyword_the_frontend_gives_it() -> None:
    tree = parse(inspect.getsource(server.serve))
    call = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "Config"
    )
    keywords = [k.arg for k in call.keywords if k.arg]
    assert "http" in keywords and "ws" in keywords
    inspect.signature(uvicorn.Config).bind(*([None] * len(call.args)), **dict.fromkeys(keywords))


def test_the_installed_uvicorn_is_in_the_range_pyproject_pins() -> None:
    """These checks ran on the uvicorn installed; the pin keeps an install from taking another."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in deps if Requirement(d).name == "uvicorn")
    assert pin.specifier.contains(metadata.version("uvicorn"))
    assert any(s.operator == "<" for s in pin.specifier), "uvicorn needs an upper bound: a minor the tests never saw"


def _constraints_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("constraints_script", ROOT / "scripts" / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_constraints_txt_pins_exactly_what_this_environment_runs() -> None:
    """`make` installs from constraints.txt: a package upgraded here, or one pyproject.toml
    gained, without the file regenerated would be tested at one version and installed at
    another (or at whatever is newest)."""
    script = _constraints_script()
    versions = script.closure(script.top_level(ROOT / "pyproject.toml"))
    versions.pop("duplexbus", None)
    written = (ROOT / "constraints.txt").read_text()
    assert written == script.render(versions), "constraints.txt is stale: regenerate it (make constraints) and commit it"
    pinned = {Requirement(line).name for line in written.splitlines() if line and not line.startswith("#")}
    assert {"uvicorn", "torch", "jiwer", "httpx", "soxr"} <= pinned
