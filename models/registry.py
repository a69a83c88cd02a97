"""Model names to model classes. Imports are lazy: `echo` must not pay for torch."""

from __future__ import annotations

import importlib

from shared.runtime.errors import BadRequest, ConfigError
from shared.sdk.model import Model

MODELS: dict[str, str] = {
    "echo": "models.echo:EchoModel",
    "tiny_duplex": "models.tiny_duplex:TinyDuplexModel",
    "voice_assistant": "models.voice_assistant:VoiceAssistantModel",
}

_cache: dict[str, Model] = {}


def get_model(name: str) -> Model:
    if name not in MODELS:
        raise BadRequest(f"unknown model {name!r}; served: {sorted(MODELS)}")
    if name not in _cache:
        module, cls = MODELS[name].split(":")
        _cache[name] = getattr(importlib.import_module(module), cls)()
    return _cache[name]


def served_model(name: str) -> Model:
    """The model a process is configured to serve: an unknown name is a start-up error
    naming the config key (a client asking for one gets get_model's 400 instead)."""
    try:
        return get_model(name)
    except BadRequest as e:
        raise ConfigError("model", e.message) from None
