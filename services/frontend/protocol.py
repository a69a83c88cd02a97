"""Client protocol parsing for `/generate/ws` and `POST /generate` (pure).

A message is JSON text, or on `/generate/ws` the same message in msgpack (a binary
frame: `parse_frame`), whose files' `data` is raw bytes rather than base64. A null field
counts as absent. Every refusal is a ParseError carrying a ProtocolError (400) whose
message says what was wrong, the request_id if one could be read, and the kind of message
it looked like, so the socket can answer in the right shape (see docs/clients.md). Either
encoding gets the same refusals, and a message says which it came in (`binary`): replies
about it go back in that encoding.
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


class _PackedFile(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    data: bytes
    stream: str | None = None


class _PackedAppend(msgspec.Struct, forbid_unknown_fields=True):
    """The plain audio append in msgpack: its files' data as bytes."""

    request_id: str
    append: list[_PackedFile]


_packed_append = msgspec.msgpack.Decoder(_PackedAppend).decode
_packed_decode = msgspec.msgpack.Decoder().decode
PACKED_ERRORS = (msgspec.DecodeError, RecursionError)
"""What decoding a client's msgpack may raise (`decode_error` says which, for the client)."""
# A binary frame that starts with one of these is JSON text, as binary frames were read
# before msgpack: no msgpack message can start so (they are positive integers in msgpack,
# and a message must be a map).
JSON_STARTS = frozenset(b"{ \t\r\n")

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
    binary: bool = False  # sent in msgpack: the call's replies go back in msgpack


@dataclass
class Append:
    request_id: str
    input: ClientInput
    end_input: bool | list[str] | None = None
    binary: bool = False


@dataclass
class EndInput:
    request_id: str
    end_input: bool | list[str]
    binary: bool = False


@dataclass
class AbortCall:
    request_id: str
    binary: bool = False


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
    binary: bool = False  # it came in msgpack: so does its reply

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


def parse_frame(data: str | bytes, max_bytes: int | None = None) -> ClientMessage | ParseError:
    """One `/generate/ws` message: a text frame's (str) is JSON; a binary frame's (bytes) is
    msgpack, or JSON text where it starts as JSON does (`JSON_STARTS`)."""
    if isinstance(data, str) or (data and data[0] in JSON_STARTS):
        return parse_message(data, max_bytes)
    return parse_packed(data, max_bytes)


def parse_packed(data: bytes, max_bytes: int | None = None) -> ClientMessage | ParseError:
    """One client message in msgpack: the JSON message's fields, files' `data` as bytes.
    The same refusals as `parse_message`, the same shapes; a map key that is not a string,
    and a value JSON has no word for (bytes but in `data`, an extension type), are refused too."""
    too_big = max_bytes is not None and len(data) > max_bytes
    if not too_big and (fast := _fast_packed_append(data)) is not None:
        return fast
    return _parse_packed(data, max_bytes, too_big)


def _parse_packed(data: bytes, max_bytes: int | None, too_big: bool) -> ClientMessage | ParseError:
    """`_parse_text` for msgpack."""
    try:
        raw = _packed_decode(data)
    except PACKED_ERRORS as e:
        if too_big:
            return ParseError(too_big_error(data, max_bytes), binary=True)
        return ParseError(ProtocolError(f"not msgpack: {decode_error(e)}"), binary=True)
    if not isinstance(raw, dict):
        if too_big:
            return ParseError(too_big_error(data, max_bytes), binary=True)
        return ParseError(ProtocolError(f"a message must be a msgpack map, got {type(raw).__name__}"), binary=True)
    msg = _strip_nulls(raw)
    rid = msg.get("request_id")
    rid_text = rid if isinstance(rid, str) else None
    kind = kind_of(msg)
    if too_big:
        return ParseError(too_big_error(data, max_bytes), rid_text, kind, binary=True)
    try:
        _string_keys(msg, "a message")
        parsed = _parse(msg, kind, binary=True)
    except ProtocolError as e:
        return ParseError(e, rid_text, kind, binary=True)
    parsed.binary = True
    return parsed


def _fast_packed_append(data: bytes) -> Append | None:
    """`_fast_append` for msgpack: the files' bytes are taken as they are (no base64)."""
    try:
        msg = _packed_append(data)
    except PACKED_ERRORS:
        return None
    if not msg.append or not valid_request_id(msg.request_id):
        return None
    files = []
    for f in msg.append:
        if not f.name:
            return None
        files.append(ClientFile(f.name, f.data, f.stream))
    return Append(msg.request_id, ClientInput(files=files), binary=True)


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


def _parse(msg: dict[str, Any], kind: Kind, one_shot: bool = False, binary: bool = False) -> ClientMessage:
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
        return Append(_require_rid(rid), _append_input(msg["append"], binary), end)
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
    return Opening(rid, model, _client_input(msg, binary), end)


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


def _append_input(v: object, binary: bool = False) -> ClientInput:
    if isinstance(v, list):  # shorthand: "append": [files]
        return ClientInput(files=_files(v, binary))
    if not isinstance(v, dict):
        raise ProtocolError("append must be an object or a list of files")
    body = _strip_nulls(v)
    if binary:
        _string_keys(body, "append")
    _only(body, {"text", "files", "model_kwargs"})
    return _client_input(body, binary)


def _string_keys(d: dict[Any, Any], what: str) -> None:
    """A msgpack map's keys may be anything; a message's, as in JSON, are strings."""
    for k in d:
        if not isinstance(k, str):
            raise ProtocolError(f"{what}'s keys must be strings, got {type(k).__name__}")


def _client_input(msg: dict[str, Any], binary: bool = False) -> ClientInput:
    text = msg.get("text")
    if text is not None and not isinstance(text, str):
        raise ProtocolError(f"text must be a string, got {type(text).__name__}")
    kwargs = msg.get("model_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ProtocolError("model_kwargs must be an object")
    if _depth(kwargs) > MAX_KWARGS_DEPTH:
        raise ProtocolError(f"model_kwargs nest deeper than {MAX_KWARGS_DEPTH} levels")
    if binary and (odd := _not_json(kwargs)) is not None:
        raise ProtocolError(f"model_kwargs must hold only what JSON can: {odd}")
    files = msg.get("files", [])
    if not isinstance(files, list):
        raise ProtocolError("files must be a list")
    return ClientInput(text=text, files=_files(files, binary), model_kwargs=kwargs)


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


def _not_json(value: object) -> str | None:
    """What in a msgpack value JSON could not say (a model sees the same kwargs, whichever
    encoding the client chose), or None (iterative: no recursion to exhaust; the depth is
    bounded before this runs)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            if any(not isinstance(k, str) for k in v):
                return "map keys must be strings"
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif v is not None and not isinstance(v, str | int | float | bool):
            return f"no {type(v).__name__} values"
    return None


def _files(files: list[Any], binary: bool = False) -> list[ClientFile]:
    out = []
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise ProtocolError(f"files[{i}] must be an object")
        f = _strip_nulls(f)
        if binary:
            _string_keys(f, f"files[{i}]")
        _only(f, {"name", "data", "stream"})
        name, data, stream = f.get("name"), f.get("data"), f.get("stream")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"files[{i}].name must be a non-empty string")
        if binary:
            if not isinstance(data, bytes):
                got = "base64 text: a binary message carries the file's bytes" if isinstance(data, str) else type(data).__name__
                raise ProtocolError(f"files[{i}].data must be bytes (msgpack bin), got {got}")
        elif not isinstance(data, str):
            raise ProtocolError(f"files[{i}].data must be a base64 string")
        if stream is not None and not isinstance(stream, str):
            raise ProtocolError(f"files[{i}].stream must be a string")
        if isinstance(data, str):
            try:
                # pybase64 (SIMD): a tenth of the stdlib's time for an 80 ms frame, the same checks.
                data = pybase64.b64decode(data.encode("ascii"), validate=True)
            except (binascii.Error, ValueError):
                raise ProtocolError(f"files[{i}].data is not valid base64") from None
        out.append(ClientFile(name, data, stream))
    return out
