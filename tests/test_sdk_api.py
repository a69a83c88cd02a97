"""`duplexbus.sdk`, the stable API of model packages: no name of it disappears, it holds
every chunk policy and realtime event there is, importing it stays light, and the models
here import from it alone."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import get_args

import duplexbus.sdk as sdk
from shared.sdk import chunking, realtime
from tests.support.source import parse

REPO = Path(__file__).resolve().parents[1]

# Frozen: a name leaves this list only with a major version of the SDK (docs/models.md).
# A name added to the SDK is added here too.
STABLE = frozenset(
    {
        "BadRequest",
        "CLIENT",
        "find_client_streams",
        "client_stream_limits",
        "ClientStream",
        "CallInfo",
        "CatchUpChunkPolicy",
        "Chunk",
        "ChunkPolicy",
        "ClientFile",
        "ClientInput",
        "ClientStreamLimits",
        "ConfigError",
        "Connection",
        "EdgeItem",
        "Emission",
        "FixedChunkPolicy",
        "InputTranscript",
        "Item",
        "Model",
        "ModelEvent",
        "Output",
        "Overloaded",
        "Partition",
        "PartitionTopology",
        "ProducerWalkCtx",
        "RealtimeMapping",
        "ReplyAudio",
        "ReplyCut",
        "ReplyEnded",
        "ReplyStarted",
        "ReplyText",
        "Resampler",
        "SpeechStarted",
        "SpeechStopped",
        "StepInput",
        "StreamInput",
        "TurnSettings",
        "TurnTaking",
        "b64_pcm16",
        "decode_audio_file",
        "encode_wav",
        "pcm16_bytes",
        "pcm16_from_b64",
        "resample_pcm16",
    }
)


def test_no_stable_name_disappears() -> None:
    assert STABLE - set(sdk.__all__) == set(), "removed from duplexbus.sdk"
    assert set(sdk.__all__) - STABLE == set(), "new in duplexbus.sdk: add it to STABLE (and docs/models.md)"
    assert len(sdk.__all__) == len(set(sdk.__all__))
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None, name


def test_every_chunk_policy_and_realtime_event_is_in_the_sdk() -> None:
    """A policy or a realtime event added inside the project is one a model can use only
    through the SDK."""
    policies = {n for n, c in vars(chunking).items() if inspect.isclass(c) and issubclass(c, chunking.ChunkPolicy)}
    events = {c.__name__ for c in get_args(realtime.ModelEvent)}
    assert policies - set(sdk.__all__) == set()
    assert events - set(sdk.__all__) == set()


def test_importing_the_sdk_loads_no_torch_and_no_service() -> None:
    code = (
        "import sys, duplexbus.sdk; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'services', 'nats', 'models')); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO)


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_models_import_the_project_only_through_the_sdk() -> None:
    """The built-in models and the example package are written as a model package is: of the
    project, `duplexbus.sdk` alone (and their own modules)."""
    files = [*(REPO / "models").rglob("*.py"), *(REPO / "examples").rglob("*.py")]
    files = [f for f in files if f.name != "registry.py"]  # the registry is the project's, not a model
    assert len(files) > 5
    for f in files:
        for mod in imported_modules(f):
            top = mod.split(".")[0]
            assert top not in ("shared", "services", "clients") and (top != "duplexbus" or mod == "duplexbus.sdk"), (f, mod)
