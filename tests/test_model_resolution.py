"""Which model `--model X` means (models/registry.py): a built-in, an installed package's
entry point (hand-made here: importlib.metadata.entry_points is replaced), or `module:Class`
(modules written to a temporary folder on sys.path). Every refusal is one line."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from models import registry
from models.echo import EchoModel
from services.frontend.service import FrontendService
from services.worker.service import WorkerService
from shared.runtime.config import load_config
from shared.runtime.errors import BadRequest, ConfigError

MODEL = """
from typing import Any

from duplexbus.sdk import (
    CLIENT, CallInfo, CatchUpChunkPolicy, ClientStreamLimits, Connection, Emission, Model, Partition, PartitionTopology, StepInput
)

class P(Partition):
    def open_call(self, call: CallInfo) -> None: ...
    def step(self, batch: list[StepInput]) -> list[Emission]: return []
    def close_call(self, cid: str) -> dict[str, Any]: return {{}}

class M(Model):
    name = {name!r}

    def __init__(self) -> None:
        limits = ClientStreamLimits(max_items=10)
        self.topology = PartitionTopology(["P"], [Connection(CLIENT, "P", "text_in", CatchUpChunkPolicy, limits)])

    def create_partition(self, name: str) -> Partition:
        return P()
"""

Write = Callable[[str], str]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No model kept from another test, and the entry points read anew."""
    monkeypatch.setattr(registry, "_cache", {})
    registry.installed.cache_clear()
    yield
    registry.installed.cache_clear()


@pytest.fixture
def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Write]:
    """A module of this source on sys.path, under a new name (returned); gone afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def one(source: str) -> str:
        name = f"tmp_model_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        names.append(name)
        return name

    yield one
    for n in names:
        sys.modules.pop(n, None)


def entry_points(monkeypatch: pytest.MonkeyPatch, **eps: str) -> list[str]:
    """Installed entry points of group duplexbus.models, name=value; the groups asked for are
    listed in what is returned."""
    asked: list[str] = []

    def fake(group: str) -> importlib.metadata.EntryPoints:
        asked.append(group)
        return importlib.metadata.EntryPoints(
            importlib.metadata.EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in eps.items()
        )

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return asked


def test_a_builtin_is_found_by_name() -> None:
    assert registry.model_class("echo") is EchoModel


def test_an_installed_entry_point_is_found_by_name(monkeypatch: pytest.MonkeyPatch, write: Write) -> None:
    mod = write(MODEL.format(name="rev"))
    entry_points(monkeypatch, rev=f"{mod}:M")
    cls = registry.model_class("rev")
    assert cls is sys.modules[mod].M
    assert registry.get_model("rev").name == "rev"  # a client may name it too
    assert registry.served_model("rev") is registry.get_model("rev")


def test_a_path_loads_the_class_directly(write: Write) -> None:
    mod = write(MODEL.format(name="by_path"))
    assert registry.model_class(f"{mod}:M") is sys.modules[mod].M


def test_a_path_is_found_in_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a new user runs it: `duplexbus up --model my_model:M` beside my_model.py (a console
    script's sys.path has no current folder)."""
    name = f"tmp_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODEL.format(name="here"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    try:
        assert registry.model_class(f"{name}:M").name == "here"
    finally:
        sys.modules.pop(name, None)


def test_a_model_served_by_path_is_found_by_its_path_and_its_name(write: Write) -> None:
    mod = write(MODEL.format(name="by_path"))
    served = registry.served_model(f"{mod}:M")
    assert registry.get_model(f"{mod}:M") is served
    assert registry.get_model("by_path") is served
    assert registry.served_model("by_path") is served


def test_a_client_cannot_make_a_frontend_import_a_path(write: Write) -> None:
    mod = write(MODEL.format(name="never"))
    with pytest.raises(BadRequest, match="unknown model"):
        registry.get_model(f"{mod}:M")
    assert mod not in sys.modules


def test_an_unknown_name_is_one_line_listing_builtins_and_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    entry_points(monkeypatch, mine="somewhere:Mine", theirs="elsewhere:Theirs")
    with pytest.raises(BadRequest) as client:
        registry.get_model("nosuch")
    with pytest.raises(ConfigError) as served:
        registry.served_model("nosuch")
    assert served.value.key == "model"
    for e in (client.value, served.value):
        assert "\n" not in e.message
        for name in ("'nosuch'", "echo", "tiny_duplex", "voice_assistant", "mine", "theirs"):
            assert name in e.message, e.message
    assert "module:Class" in served.value.message and "module:Class" not in client.value.message


def test_the_entry_points_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = entry_points(monkeypatch)
    for _ in range(3):
        with pytest.raises(BadRequest):
            registry.get_model("nosuch")
    assert asked == [registry.ENTRY_POINT_GROUP]


@pytest.mark.parametrize("by", ["path", "entry point"])
def test_a_module_that_fails_to_import_is_one_line_naming_it_and_its_error(
    monkeypatch: pytest.MonkeyPatch, write: Write, by: str
) -> None:
    mod = write("import no_such_dependency_here\n")
    entry_points(monkeypatch, broken=f"{mod}:M")
    with pytest.raises(ConfigError) as e:
        registry.served_model(f"{mod}:M" if by == "path" else "broken")
    assert "\n" not in e.value.message
    assert f"module {mod!r} failed to import" in e.value.message
    assert "ModuleNotFoundError" in e.value.message and "no_such_dependency_here" in e.value.message


def test_a_module_that_raises_on_import_is_one_line(write: Write) -> None:
    mod = write("raise RuntimeError('weights missing')\n")
    with pytest.raises(ConfigError, match=f"module '{mod}' failed to import: RuntimeError: weights missing"):
        registry.served_model(f"{mod}:M")


def test_a_missing_class_is_one_line(write: Write) -> None:
    mod = write(MODEL.format(name="x"))
    with pytest.raises(ConfigError, match=f"module '{mod}' has no 'Nope'"):
        registry.served_model(f"{mod}:Nope")


@pytest.mark.parametrize("attr", ["NotAModel", "a_function", "AN_INSTANCE"])
def test_what_is_not_a_model_subclass_is_refused(write: Write, attr: str) -> None:
    others = "\nclass NotAModel:\n    name = 'x'\n\ndef a_function() -> None: ...\n\nAN_INSTANCE = M()\n"
    mod = write(MODEL.format(name="x") + others)
    with pytest.raises(ConfigError, match="is not a Model subclass"):
        registry.served_model(f"{mod}:{attr}")


def test_a_model_missing_an_abstract_method_is_refused(write: Write) -> None:
    mod = write("from duplexbus.sdk import Model\n\nclass Half(Model):\n    name = 'half'\n")
    with pytest.raises(ConfigError, match="does not implement create_partition"):
        registry.served_model(f"{mod}:Half")


def test_a_model_without_a_name_is_refused(write: Write) -> None:
    mod = write(MODEL.format(name="x").replace("    name = 'x'\n", ""))
    with pytest.raises(ConfigError, match="has no `name`"):
        registry.served_model(f"{mod}:M")


def test_an_entry_points_name_must_be_its_models_name(monkeypatch: pytest.MonkeyPatch, write: Write) -> None:
    mod = write(MODEL.format(name="reverse"))
    entry_points(monkeypatch, rev=f"{mod}:M")
    with pytest.raises(ConfigError, match="whose name is 'reverse': the two must agree"):
        registry.served_model("rev")


def test_a_model_by_path_cannot_take_another_models_name(monkeypatch: pytest.MonkeyPatch, write: Write) -> None:
    mod = write(MODEL.format(name="echo") + MODEL.format(name="theirs").replace("class M(", "class T("))
    other = write(MODEL.format(name="theirs"))
    entry_points(monkeypatch, theirs=f"{other}:M")
    with pytest.raises(ConfigError, match=r"the name of models\.echo:EchoModel"):
        registry.served_model(f"{mod}:M")
    with pytest.raises(ConfigError, match=f"the name of {other}:M"):
        registry.served_model(f"{mod}:T")
    assert registry.served_model(f"{other}:M").name == "theirs"  # the entry point's own class, by path


def test_frontend_and_worker_serve_a_model_by_path_under_its_name(write: Write) -> None:
    mod = write(MODEL.format(name="by_path"))
    cfg = load_config(model=f"{mod}:M", client_streams={"text_in": {"max_items": 5}})
    front = FrontendService(cfg)
    assert front.model("by_path") is front.model(None) is front.served
    # the config's client_streams apply to the served model however a client names it
    assert front.stream_limits("by_path") == front.stream_limits(f"{mod}:M") == {"text_in": 5}
    assert WorkerService(cfg, cfg.model).model_name == "by_path"
