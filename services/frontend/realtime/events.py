"""Realtime client events, parsed (pure): GA names, the GA and the flat beta `session.update`.

Unknown fields are ignored, never refused; a field of the wrong type, an unknown event type
or undecodable audio is a `ClientError` whose `code` and `param` go into the `error` event.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pybase64

from services.frontend.protocol import JSON_ERRORS, decode_error

MIN_RATE = 8_000
MAX_RATE = 48_000
DEFAULT_RATE = 24_000  # the GA default: PCM16 at 24 kHz

_decode = msgspec.json.Decoder().decode


@dataclass
class ClientError(Exception):
    """A client event refused; the session goes on."""

    code: str
    message: str
    param: str | None = None
    event_id: str | None = None  # the client event's own event_id, echoed in the error


def invalid(message: str, param: str | None = None) -> ClientError:
    return ClientError("invalid_value", message, param)


@dataclass(frozen=True)
class TurnDetection:
    """`turn_detection` as the client set it (`server_vad` or `semantic_vad`); None: not given."""

    semantic: bool = False
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    idle_timeout_ms: int | None = None  # server_vad only (as OpenAI's)
    eagerness: str | None = None  # semantic_vad only
    create_response: bool = True
    interrupt_response: bool = True


@dataclass
class SessionUpdate:
    """What a `session.update` sets; None: left as it is."""

    input_rate: int | None = None
    output_rate: int | None = None
    server_vad: bool | None = None
    turn_detection: TurnDetection | None = None  # its settings where server_vad is True
    transcription: dict[str, Any] | None = None
    instructions: str | None = None
    output_modalities: list[str] | None = None
    beta: bool = False  # sent in the flat beta shape: answer with beta-only events too


@dataclass
class AppendAudio:
    pcm: np.ndarray  # PCM16 at the session's input rate


@dataclass
class Commit:
    pass


@dataclass
class Clear:
    pass


@dataclass
class ResponseCreate:
    output_modalities: list[str] | None = None
    metadata: dict[str, Any] | None = None  # echoed in the response (LiveKit waits for its client_event_id)


@dataclass
class ResponseCancel:
    response_id: str | None = None


@dataclass
class ItemCreate:
    item_id: str | None
    role: str
    text: str | None = None
    pcm: np.ndarray | None = None  # an input_audio content part, at the session's input rate


@dataclass
class ItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass
class ItemRetrieve:
    item_id: str


@dataclass
class ItemDelete:
    item_id: str


@dataclass
class OutputClear:
    """`output_audio_buffer.clear`: the client dropped what it had not played yet."""


@dataclass
class PlaybackAck:
    fields: dict[str, Any] = field(default_factory=dict)  # response_id, played_ms, ... echoed back


@dataclass
class SessionClose:
    pass


@dataclass
class Heartbeat:
    pass


@dataclass
class Resume:
    token: str
    last_event_id: str | None


Action = (
    SessionUpdate
    | AppendAudio
    | Commit
    | Clear
    | ResponseCreate
    | ResponseCancel
    | ItemCreate
    | ItemTruncate
    | ItemRetrieve
    | ItemDelete
    | OutputClear
    | PlaybackAck
    | SessionClose
    | Heartbeat
    | Resume
)


@dataclass
class ClientEvent:
    event_id: str | None
    action: Action


def parse_event(text: str | bytes) -> ClientEvent:
    """One client frame; raises ClientError (with the event's event_id when it had one)."""
    try:
        raw = _decode(text)
    except JSON_ERRORS as e:  # "[" * 5000 too: as /generate/ws says, "nested too deeply"
        raise ClientError("invalid_json", f"not JSON: {decode_error(e)}") from None
    if not isinstance(raw, dict):
        raise ClientError("invalid_event", f"an event must be a JSON object, got {type(raw).__name__}")
    eid = raw.get("event_id")
    event_id = eid if isinstance(eid, str) else None
    try:
        if eid is not None and not isinstance(eid, str):
            raise invalid("event_id must be a string", "event_id")
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise ClientError("invalid_event", "an event needs a string `type`", "type")
        parser = _PARSERS.get(kind)
        if parser is None:
            raise ClientError("unknown_event", f"unknown event type {kind!r}", "type")
        return ClientEvent(event_id, parser(raw))
    except ClientError as e:
        e.event_id = event_id
        raise


# -- field readers ---------------------------------------------------------------------
def _obj(d: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"{path} must be an object", path)
    return v


def _str(d: dict[str, Any], key: str, path: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise invalid(f"{path} must be a string", path)
    return v


def _int(d: dict[str, Any], key: str, path: str, low: int = 0) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise invalid(f"{path} must be an integer >= {low}", path)
    return v


def _rate(v: object, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not MIN_RATE <= v <= MAX_RATE:
        raise invalid(f"{path} must be an integer sample rate from {MIN_RATE} to {MAX_RATE} Hz, got {v!r}", path)
    return v


def pcm16(v: object, path: str) -> np.ndarray:
    """base64 PCM16 LE mono samples."""
    if not isinstance(v, str):
        raise invalid(f"{path} must be a base64 string", path)
    try:
        raw = pybase64.b64decode(v.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise invalid(f"{path} is not valid base64", path) from None
    if len(raw) % 2:
        raise invalid(f"{path} must hold whole PCM16 samples (an even byte count, got {len(raw)})", path)
    return np.frombuffer(raw, dtype="<i2").copy()


def _format(v: object, path: str) -> int | None:
    """A GA audio format object: `{type: "audio/pcm", rate}`; the rate it sets (None: unchanged)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"{path} must be an object", path)
    kind = v.get("type", "audio/pcm")
    if kind != "audio/pcm":
        raise invalid(f"{path}.type: only audio/pcm (PCM16) is served, got {kind!r}", f"{path}.type")
    return _rate(v["rate"], f"{path}.rate") if v.get("rate") is not None else None


def _beta_format(v: object, path: str) -> None:
    if v is not None and v != "pcm16":
        raise invalid(f"{path}: only pcm16 is served, got {v!r}", path)


EAGERNESS = ("low", "medium", "high", "auto")


def _bool(d: dict[str, Any], key: str, path: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{path} must be true or false", path)
    return v


def _turn_detection(d: dict[str, Any], key: str, path: str) -> tuple[bool, TurnDetection | None] | None:
    """(True, its settings): server_vad or semantic_vad; (False, None): null (manual commits);
    None: not given."""
    if key not in d:
        return None
    v = d[key]
    if v is None:
        return False, None
    if not isinstance(v, dict):
        raise invalid(f"{path} must be an object or null", path)
    kind = v.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise invalid(f"{path}.type must be server_vad or semantic_vad, got {kind!r}", f"{path}.type")
    threshold = v.get("threshold")
    number = isinstance(threshold, int | float) and not isinstance(threshold, bool)
    if threshold is not None and not (number and 0 <= threshold <= 1):
        raise invalid(f"{path}.threshold must be a number from 0.0 to 1.0", f"{path}.threshold")
    eagerness = _str(v, "eagerness", f"{path}.eagerness")
    if eagerness is not None and eagerness not in EAGERNESS:
        raise invalid(f"{path}.eagerness must be one of {', '.join(EAGERNESS)}, got {eagerness!r}", f"{path}.eagerness")
    return True, TurnDetection(
        semantic=kind == "semantic_vad",
        threshold=None if threshold is None else float(threshold),
        prefix_padding_ms=_int(v, "prefix_padding_ms", f"{path}.prefix_padding_ms"),
        silence_duration_ms=_int(v, "silence_duration_ms", f"{path}.silence_duration_ms"),
        idle_timeout_ms=_int(v, "idle_timeout_ms", f"{path}.idle_timeout_ms") if kind == "server_vad" else None,
        eagerness=eagerness,
        create_response=_bool(v, "create_response", f"{path}.create_response", True),
        interrupt_response=_bool(v, "interrupt_response", f"{path}.interrupt_response", True),
    )


def _modalities(v: object, path: str) -> list[str] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or any(m not in ("audio", "text") for m in v):
        raise invalid(f'{path} must be a non-empty list of "audio" and "text"', path)
    return list(v)


def _transcription(v: object, path: str) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"{path} must be an object or null", path)
    return v


# -- events ----------------------------------------------------------------------------
def _session_update(raw: dict[str, Any]) -> SessionUpdate:
    s = _obj(raw, "session", "session")
    if s is None:
        raise invalid("session.update needs a `session` object", "session")
    up = SessionUpdate()
    up.instructions = _str(s, "instructions", "session.instructions")
    audio = _obj(s, "audio", "session.audio")
    beta = any(k in s for k in ("input_audio_format", "output_audio_format", "turn_detection", "sample_rate_hz", "modalities"))
    if audio is not None:
        inp = _obj(audio, "input", "session.audio.input") or {}
        out = _obj(audio, "output", "session.audio.output") or {}
        up.input_rate = _format(inp.get("format"), "session.audio.input.format")
        up.output_rate = _format(out.get("format"), "session.audio.output.format")
        if (td := _turn_detection(inp, "turn_detection", "session.audio.input.turn_detection")) is not None:
            up.server_vad, up.turn_detection = td
        up.transcription = _transcription(inp.get("transcription"), "session.audio.input.transcription")
    up.output_modalities = _modalities(s.get("output_modalities"), "session.output_modalities")
    if beta:
        up.beta = True
        _beta_format(s.get("input_audio_format"), "session.input_audio_format")
        _beta_format(s.get("output_audio_format"), "session.output_audio_format")
        if (td := _turn_detection(s, "turn_detection", "session.turn_detection")) is not None:
            up.server_vad, up.turn_detection = td
        if s.get("sample_rate_hz") is not None:
            rate = _rate(s["sample_rate_hz"], "session.sample_rate_hz")
            up.input_rate, up.output_rate = up.input_rate or rate, up.output_rate or rate
        if (t := _transcription(s.get("input_audio_transcription"), "session.input_audio_transcription")) is not None:
            up.transcription = t
        if (m := _modalities(s.get("modalities"), "session.modalities")) is not None:
            up.output_modalities = m
    return up


def _append(raw: dict[str, Any]) -> AppendAudio:
    if "audio" not in raw:
        raise invalid("input_audio_buffer.append needs `audio` (base64 PCM16)", "audio")
    return AppendAudio(pcm16(raw["audio"], "audio"))


def _response_create(raw: dict[str, Any]) -> ResponseCreate:
    r = _obj(raw, "response", "response") or {}
    mods = _modalities(r.get("output_modalities"), "response.output_modalities") or _modalities(
        r.get("modalities"), "response.modalities"
    )
    return ResponseCreate(mods, _obj(r, "metadata", "response.metadata"))


def _item_create(raw: dict[str, Any]) -> ItemCreate:
    item = _obj(raw, "item", "item")
    if item is None:
        raise invalid("conversation.item.create needs an `item`", "item")
    if item.get("type", "message") != "message":
        raise invalid(f"item.type: only message items are served, got {item.get('type')!r}", "item.type")
    role = item.get("role")
    if role not in ("user", "system", "assistant"):
        raise invalid(f"item.role must be user, system or assistant, got {role!r}", "item.role")
    content = item.get("content", [])
    if not isinstance(content, list):
        raise invalid("item.content must be a list", "item.content")
    out = ItemCreate(_str(item, "id", "item.id"), role)
    texts, audio = [], []
    for i, part in enumerate(content):
        path = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise invalid(f"{path} must be an object", path)
        kind = part.get("type")
        if kind in ("input_text", "text", "output_text"):
            text = _str(part, "text", f"{path}.text")
            texts.append(text or "")
        elif kind == "input_audio":
            audio.append(pcm16(part.get("audio"), f"{path}.audio"))
        else:
            raise invalid(f"{path}.type must be input_text or input_audio, got {kind!r}", f"{path}.type")
    out.text = " ".join(texts) if texts else None
    out.pcm = np.concatenate(audio) if audio else None
    return out


def _truncate(raw: dict[str, Any]) -> ItemTruncate:
    item_id = _str(raw, "item_id", "item_id")
    if not item_id:
        raise invalid("conversation.item.truncate needs `item_id`", "item_id")
    end = _int(raw, "audio_end_ms", "audio_end_ms")
    if end is None:
        raise invalid("conversation.item.truncate needs `audio_end_ms`", "audio_end_ms")
    return ItemTruncate(item_id, _int(raw, "content_index", "content_index") or 0, end)


def _item_id(raw: dict[str, Any], kind: str) -> str:
    item_id = _str(raw, "item_id", "item_id")
    if not item_id:
        raise invalid(f"{kind} needs `item_id`", "item_id")
    return item_id


def _playback_ack(raw: dict[str, Any]) -> PlaybackAck:
    keep = {k: v for k, v in raw.items() if k not in ("type", "event_id")}
    return PlaybackAck(keep)


def _resume(raw: dict[str, Any]) -> Resume:
    token = _str(raw, "resume_token", "resume_token")
    if not token:
        raise invalid("session.resume needs `resume_token` (from session.created)", "resume_token")
    return Resume(token, _str(raw, "last_event_id", "last_event_id"))


def _cancel(raw: dict[str, Any]) -> ResponseCancel:
    return ResponseCancel(_str(raw, "response_id", "response_id"))


_PARSERS: dict[str, Any] = {
    "session.update": _session_update,
    "input_audio_buffer.append": _append,
    "input_audio_buffer.commit": lambda raw: Commit(),
    "input_audio_buffer.clear": lambda raw: Clear(),
    "response.create": _response_create,
    "response.cancel": _cancel,
    "conversation.item.create": _item_create,
    "conversation.item.truncate": _truncate,
    "conversation.item.retrieve": lambda raw: ItemRetrieve(_item_id(raw, "conversation.item.retrieve")),
    "conversation.item.delete": lambda raw: ItemDelete(_item_id(raw, "conversation.item.delete")),
    "output_audio_buffer.clear": lambda raw: OutputClear(),
    "playback.ack": _playback_ack,
    "session.close": lambda raw: SessionClose(),
    "session.heartbeat": lambda raw: Heartbeat(),
    "session.resume": _resume,
}
