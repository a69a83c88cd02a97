"""The model SDK: everything a model package imports, from this one module.

    from duplexbus.sdk import CLIENT, Connection, Model, Output, Partition, PartitionTopology, ...

This is the stable API for models served by duplexbus (docs/models.md): a name here stays
here (tests/test_sdk_api.py holds the list), while where it is defined inside the project
(`shared/sdk/`, `shared/runtime/errors.py`) may change. Importing it is light: numpy and the
project's pure SDK modules, no torch and nothing of the services.
"""

from shared.runtime.errors import BadRequest, ConfigError, Overloaded
from shared.sdk.audio import Resampler, b64_pcm16, decode_audio_file, encode_wav, pcm16_bytes, pcm16_from_b64, resample_pcm16
from shared.sdk.chunking import CatchUpChunkPolicy, Chunk, ChunkPolicy, FixedChunkPolicy, Item
from shared.sdk.model import (
    CallInfo,
    ClientFile,
    ClientInput,
    EdgeItem,
    Emission,
    Model,
    Output,
    Partition,
    StepInput,
    StreamInput,
)
from shared.sdk.realtime import (
    InputTranscript,
    ModelEvent,
    RealtimeMapping,
    ReplyAudio,
    ReplyCut,
    ReplyEnded,
    ReplyStarted,
    ReplyText,
    SpeechStarted,
    SpeechStopped,
    TurnSettings,
    TurnTaking,
)
from shared.sdk.topology import (
    CLIENT,
    ClientStream,
    ClientStreamLimits,
    Connection,
    PartitionTopology,
    ProducerWalkCtx,
    client_stream_limits,
    find_client_streams,
)

__all__ = [  # sorted (ruff); grouped by what they are for in docs/models.md
    "CLIENT",
    "BadRequest",
    "CallInfo",
    "CatchUpChunkPolicy",
    "Chunk",
    "ChunkPolicy",
    "ClientFile",
    "ClientInput",
    "ClientStream",
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
    "client_stream_limits",
    "decode_audio_file",
    "encode_wav",
    "find_client_streams",
    "pcm16_bytes",
    "pcm16_from_b64",
    "resample_pcm16",
]
