"""Client protocol parsing for `/generate/ws` and `POST /generate` (pure).

A null field counts as absent. Every refusal is a ParseError carrying a
ProtocolError (400) whose message says what was wrong, the request_id if one
could be read, and the kind of message it looked like, so the socket can answer
in the right shape (see docs/clients.md).
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import pybase64

from shared.runtime.errors import BadRequest, LimitExceeded, ProtocolError
from shared.sdk.model import ClientFile, ClientInput

_json_decode = msgspec.json.Decoder().decode
JSON_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What decoding a client's JSON may raise (`decode_error` says which, for the client)."""


class _AudioFile(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    data: str
    stream: str | None = None


class _AudioAppend(msgspec.Struct, forbid_unknown_fields=True):
    """The message a live call sends most: `{"request_id", "append": [files]}`, nothing else."""

    request_id: str
    append: list[_AudioFile]


_audio_append = msgspec.json.Decoder(_AudioAppend).decode

MAX_KWARGS_DEPTH = 32  # model_kwargs nest at most this deep (the conductor and workers decode them too)
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
REQUEST_ID_RULE = "request_id must be 1-64 characters of [A-Za-z0-9_-]"

Kind = Literal["opening", "append", "end", "abort"]


@dataclass
class Opening:
    request_id: str | None
    model: str | None
    input: ClientInput
    end_input: bool | list[str] | None = None


@dataclass
class Append:
    request_id: str
    input: ClientInput
    end_input: bool | list[str] | None = None


@dataclass
class EndInput:
    request_id: str
    end_input: bool | list[str]


@dataclass
class AbortCall:
    request_id: str


ClientMessage = Opening | Append | EndInput | AbortCall


@dataclass
class ParseError:
    """A message that was refused before it reached a call.

    `request_id` is the message's request_id when it is a string (valid or not:
    the reply echoes it), `kind` what the message looked like (None: not even a
    JSON object).
    """

    error: BadRequest
    request_id: str | None = None
    kind: Kind | None = None

    @property
    def append(self) -> bool:
        """An append, end_input or abort: a message about an existing call."""
        return self.kind in ("append", "end", "abort")


def valid_request_id(rid: object) -> bool:
    return isinstance(rid, str) and REQUEST_ID.fullmatch(rid) is not None


def _strip_nulls(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def kind_of(msg: dict[str, Any]) -> Kind:
    """What a (null-stripped) JSON object is, by its fields."""
    if "abort" in msg:
        return "abort"
    if "append" in msg:
        return "append"
    if "end_input" in msg and set(msg) <= {"request_id", "end_input"}:
        return "end"
    return "opening"


def parse_message(text: str | bytes, max_bytes: int | None = None, one_shot: bool = False) -> ClientMessage | ParseError:
    """One client message. Over `max_bytes` it is refused (400 naming max_message_mb)
    after reading only its request_id and kind, so the reply can name the call.
    `one_shot` (`POST /generate`): an opening ends every client stream, whatever its end_input."""
    too_big = max_bytes is not None and over_bytes(text, max_bytes)
    if not too_big and not one_shot and (fast := _fast_append(text)) is not None:
        return fast
    return _parse_text(text, max_bytes, too_big, one_shot)


def _parse_text(text: str | bytes, max_bytes: int | None, too_big: bool, one_shot: bool) -> ClientMessage | ParseError:
    """The general path: any message, every refusal with its reason (of one `too_big`, only
    its request_id and kind are read)."""
    try:
        raw = _json_decode(text)
    except JSON_ERRORS as e:
        if too_big:
            return ParseError(too_big_error(text, max_bytes))
        return ParseError(ProtocolError(f"not JSON: {decode_error(e)}"))
    if not isinstance(raw, dict):
        if too_big:
            return ParseError(too_big_error(text, max_bytes))
        return ParseError(ProtocolError(f"a message must be a JSON object, got {type(raw).__name__}"))
    msg = _strip_nulls(raw)
    rid = msg.get("request_id")
    rid_text = rid if isinstance(rid, str) else None
    kind = kind_of(msg)
    if too_big:
        return ParseError(too_big_error(text, max_bytes), rid_text, kind)
    try:
        return _parse(msg, kind, one_shot)
    except ProtocolError as e:
        return ParseError(e, rid_text, kind)


def _fast_append(text: str | bytes) -> Append | None:
    """A plain audio append, decoded straight into its fields: a third of the general path's
    time, on the message every live call sends every few tens of milliseconds. None for
    anything else, or anything the general path would refuse or read otherwise (unknown or
    null-free fields, an invalid request_id, an empty name, bad base64): that path decides,
    with its error messages."""
    try:
        msg = _audio_append(text)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    if not msg.append or not valid_request_id(msg.request_id):
        return None
    files = []
    for f in msg.append:
        if not f.name:
            return None
        try:
            files.append(ClientFile(f.name, pybase64.b64decode(f.data.encode("ascii"), validate=True), f.stream))
        except (binascii.Error, ValueError):
            return None
    return Append(msg.request_id, ClientInput(files=files))


def decode_error(e: Exception) -> str:
    # msgspec raises RecursionError for nesting deeper than the interpreter's recursion
    # limit ("[" * 5000): as malformed as any other JSON the client sends.
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def over_bytes(text: str | bytes, max_bytes: int) -> bool:
    """The message is over `max_bytes` as UTF-8 (encoded only where its length in characters
    leaves a doubt: a UTF-8 character is at most 4 bytes)."""
    size = len(text)
    return size > max_bytes or (isinstance(text, str) and 4 * size > max_bytes and len(text.encode()) > max_bytes)


def too_big_error(text: str | bytes, max_bytes: int | None) -> LimitExceeded:
    n = len(text.encode()) if isinstance(text, str) else len(text)
    return LimitExceeded("max_message_mb", f"a message of {n} bytes is over the limit of {max_bytes} bytes")


def _parse(msg: dict[str, Any], kind: Kind, one_shot: bool = False) -> ClientMessage:
    rid = msg.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(f"request_id must be a string, got {type(rid).__name__}")
    if kind == "abort":
        _only(msg, {"request_id", "abort"})
        if msg["abort"] is not True:
            raise ProtocolError("abort must be true")
        return AbortCall(_require_rid(rid))
    end = _end_input(msg.get("end_input"))
    if kind == "append":
        _only(msg, {"request_id", "append", "end_input"})
        return Append(_require_rid(rid), _append_input(msg["append"]), end)
    if kind == "end":
        if end is None:
            raise ProtocolError("end_input alone must be true or a non-empty list of stream names")
        return EndInput(_require_rid(rid), end)
    _only(msg, {"request_id", "model", "text", "files", "model_kwargs", "end_input"})
    if one_shot:
        end = True
    model = msg.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"model must be a string, got {type(model).__name__}")
    if rid is not None and not valid_request_id(rid):
        raise ProtocolError(REQUEST_ID_RULE)
    if rid is None and end is None:
        # With a list, whether streams stay open depends on the model: the service checks.
        raise ProtocolError("a live call (one that leaves a client stream open) needs a request_id")
    return Opening(rid, model, _client_input(msg), end)


def _require_rid(rid: str | None) -> str:
    if rid is None:
        raise ProtocolError("request_id is required")
    if not valid_request_id(rid):
        raise ProtocolError(REQUEST_ID_RULE)
    return rid


def _only(msg: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(msg) - allowed)
    if unknown:
        raise ProtocolError(f"unknown field(s) {unknown}; allowed here: {sorted(allowed)}")


def _end_input(v: object) -> bool | list[str] | None:
    if v is None or v is False:
        return None
    if v is True:
        return True
    if isinstance(v, list) and v and all(isinstance(e, str) for e in v):
        return list(dict.fromkeys(v))
    raise ProtocolError("end_input must be true or a non-empty list of stream names")


def _append_input(v: object) -> ClientInput:
    if isinstance(v, list):  # shorthand: "append": [files]
        return ClientInput(files=_files(v))
    if not isinstance(v, dict):
        raise ProtocolError("append must be an object or a list of files")
    body = _strip_nulls(v)
    _only(body, {"text", "files", "model_kwargs"})
    return _client_input(body)


def _client_input(msg: dict[str, Any]) -> ClientInput:
    text = msg.get("text")
    if text is not None and not isinstance(text, str):
        raise ProtocolError(f"text must be a string, got {type(text).__name__}")
    kwargs = msg.get("model_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ProtocolError("model_kwargs must be an object")
    if _depth(kwargs) > MAX_KWARGS_DEPTH:
        raise ProtocolError(f"model_kwargs nest deeper than {MAX_KWARGS_DEPTH} levels")
    files = msg.get("files", [])
    if not isinstance(files, list):
        raise ProtocolError("files must be a list")
    return ClientInput(text=text, files=_files(files), model_kwargs=kwargs)


def _depth(value: object) -> int:
    """How deep objects and arrays nest in `value` (iterative: no recursion to exhaust)."""
    deepest = 0
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_KWARGS_DEPTH:
            return deepest
        todo.extend((c, d + 1) for c in children)
    return deepest


def _files(files: list[Any]) -> list[ClientFile]:
    out = []
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise ProtocolError(f"files[{i}] must be an object")
        f = _strip_nulls(f)
        _only(f, {"name", "data", "stream"})
        name, data, stream = f.get("name"), f.get("data"), f.get("stream")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"files[{i}].name must be a non-empty string")
        if not isinstance(data, str):
            raise ProtocolError(f"files[{i}].data must be a base64 string")
        if stream is not None and not isinstance(stream, str):
            raise ProtocolError(f"files[{i}].stream must be a string")
        try:
            # pybase64 (SIMD): a tenth of the stdlib's time for an 80 ms frame, the same checks.
            raw = pybase64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"files[{i}].data is not valid base64") from None
        out.append(ClientFile(name, raw, stream))
    return out
