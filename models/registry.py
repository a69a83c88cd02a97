"""Which model a name means: a built-in, an installed package's entry point, or `module:Class`.

`--model NAME` (and `DUPLEXBUS_MODEL`, the config's `model`) is looked up, in this order:
1. a built-in (`MODELS`);
2. an entry point of an installed package in the group `duplexbus.models`, e.g. in its
   pyproject.toml `[project.entry-points."duplexbus.models"] reverse = "reverse_model:ReverseModel"`;
3. a path `module:Class` (a dotted module on sys.path or in the current folder, a class in
   it): the class itself. The current folder is looked in as uvicorn does for `module:app`:
   `duplexbus` is a console script, whose sys.path has no current folder of its own, so
   `--model my_model:MyModel` beside my_model.py would otherwise not be found.

A model found by name must carry that name (`Model.name`): the name is what goes on the wire
(the call's `Open.model`, the worker's heartbeat), so a frontend that found a model by name
and a worker that loaded it by path agree on it. Every refusal is one line: an unknown name
lists what is there, a module that fails to import names itself and its error, a class that
is no `Model` says so. Imports are lazy: `echo` must not pay for torch.

A client's opening names a model too; it is looked up by name only (built-in or entry
point), never by path: a client does not make a frontend import a module of its choosing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import sys

from shared.runtime.errors import BadRequest, ConfigError
from shared.sdk.model import Model

MODELS: dict[str, str] = {
    "echo": "models.echo:EchoModel",
    "tiny_duplex": "models.tiny_duplex:TinyDuplexModel",
    "voice_assistant": "models.voice_assistant:VoiceAssistantModel",
}

ENTRY_POINT_GROUP = "duplexbus.models"

# module:Class, each a dotted Python name: anything else is taken for a model's name.
_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

_cache: dict[str, Model] = {}  # by what it was asked as (a name or a path) and by its name


@functools.cache
def installed() -> dict[str, str]:
    """Entry point name -> `module:Class` of the installed packages' models. Read once per
    process: a scan of every installed distribution takes tens of milliseconds, and a client
    naming an unknown model must not cost a frontend that each time."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def is_path(spec: str) -> bool:
    return _PATH.match(spec) is not None


def known() -> str:
    """What names there are to ask for, in one line."""
    eps = ", ".join(sorted(installed())) or "none"
    return f"built-in: {', '.join(sorted(MODELS))}; installed ({ENTRY_POINT_GROUP} entry points): {eps}"


def model_class(spec: str, paths: bool = True) -> type[Model]:
    """The `Model` subclass `spec` names (see the module's docstring for the order). Raises
    BadRequest for a name nothing answers to, ConfigError for one that cannot be loaded."""
    if spec in MODELS:
        return _named(spec, MODELS[spec], "built-in")
    eps = installed()
    if spec in eps:
        return _named(spec, eps[spec], f"entry point of {ENTRY_POINT_GROUP}")
    if paths and is_path(spec):
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return _unshadowed(_load(spec, spec), eps)
    also = "; or a path module:Class" if paths else ""
    raise BadRequest(f"unknown model {spec!r} ({known()}{also})")


def _named(name: str, path: str, where: str) -> type[Model]:
    cls = _load(name, path)
    if cls.name != name:
        raise ConfigError("model", f"{name!r} ({where}) is {path}, whose name is {cls.name!r}: the two must agree")
    return cls


def _unshadowed(cls: type[Model], eps: dict[str, str]) -> type[Model]:
    """A model loaded by path whose name is another model's (a built-in's, an entry point's)
    would be taken for it on the wire: refused."""
    other = MODELS.get(cls.name) or eps.get(cls.name)
    if other is not None and _load(cls.name, other) is not cls:
        raise ConfigError("model", f"{cls.__module__}:{cls.__qualname__} is named {cls.name!r}, the name of {other}")
    return cls


def _load(spec: str, path: str) -> type[Model]:
    """The class at `path` (module:Class), checked to be a servable Model."""
    module_name, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as e:  # whatever the module's import raised: one line, not a traceback
        raise ConfigError("model", f"{spec!r}: module {module_name!r} failed to import: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError("model", f"{spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Model)):
        raise ConfigError("model", f"{spec!r}: {path} is not a Model subclass (duplexbus.sdk.Model), it is {obj!r}")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ConfigError("model", f"{spec!r}: {path} does not implement {missing}")
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError("model", f"{spec!r}: {path} has no `name` (a class attribute: the name it is served as)")
    return obj


def get_model(name: str) -> Model:
    """The model a client's opening names: by name only (built-in, entry point), or the model
    this process serves, as it was configured (`served_model` put it here)."""
    if name not in _cache:
        _keep(name, model_class(name, paths=False))
    return _cache[name]


def served_model(spec: str) -> Model:
    """The model a process is configured to serve (a name or a path): a model that cannot be
    served is a start-up error naming the config key (a client asking for an unknown one gets
    get_model's 400 instead)."""
    if spec not in _cache:
        try:
            cls = model_class(spec)
        except BadRequest as e:
            raise ConfigError("model", e.message) from None
        _keep(spec, cls)
    return _cache[spec]


def _keep(spec: str, cls: type[Model]) -> None:
    """One instance per class, kept under `spec` and under its name: a client may ask for a
    model served by path by its name."""
    model = _cache.get(cls.name)
    if type(model) is not cls:
        model = cls()
    _cache[spec] = model
    _cache.setdefault(model.name, model)
