"""Client protocol parsing for `/generate/ws` and `POST /generate` (pure).

A null field counts as absent. Every refusal is a ProtocolError (400) whose
message says what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

from duplexbus.shared.errors import ProtocolError
from duplexbus.shared.model import ClientFile, ClientInput

REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
    """A message that could not be parsed; `request_id` if one could be read (for the reply)."""

    error: ProtocolError
    request_id: str | None = None
    append: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def valid_request_id(rid: object) -> bool:
    return isinstance(rid, str) and REQUEST_ID.fullmatch(rid) is not None


def _strip_nulls(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def parse_message(text: str | bytes) -> ClientMessage | ParseError:
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return ParseError(ProtocolError(f"not JSON: {e}"))
    if not isinstance(raw, dict):
        return ParseError(ProtocolError("a message must be a JSON object"))
    msg = _strip_nulls(raw)
    rid = msg.get("request_id")
    rid_text = rid if isinstance(rid, str) else None
    is_append = "append" in msg
    try:
        return _parse(msg)
    except ProtocolError as e:
        return ParseError(e, rid_text if valid_request_id(rid_text) else None, append=is_append)


def _parse(msg: dict[str, Any]) -> ClientMessage:
    rid = msg.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("request_id must be a string")
    end = _end_input(msg.get("end_input"))
    if "abort" in msg:
        if msg["abort"] is not True:
            raise ProtocolError("abort must be true")
        return AbortCall(_require_rid(rid))
    if "append" in msg:
        _only(msg, {"request_id", "append", "end_input"})
        return Append(_require_rid(rid), _append_input(msg["append"]), end)
    if set(msg) <= {"request_id", "end_input"} and "end_input" in msg:
        if not end:
            raise ProtocolError("end_input alone must be true or a non-empty list of stream names")
        return EndInput(_require_rid(rid), end)
    _only(msg, {"request_id", "model", "text", "files", "model_kwargs", "end_input"})
    model = msg.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model must be a string")
    inp = _client_input(msg)
    live = end is not True
    if live and rid is None:
        raise ProtocolError("a live call (one that leaves a client stream open) needs a request_id")
    if rid is not None and not valid_request_id(rid):
        raise ProtocolError("request_id must be 1-64 characters of [A-Za-z0-9_-]")
    return Opening(rid, model, inp, end)


def _require_rid(rid: object) -> str:
    if rid is None:
        raise ProtocolError("request_id is required")
    if not valid_request_id(rid):
        raise ProtocolError("request_id must be 1-64 characters of [A-Za-z0-9_-]")
    assert isinstance(rid, str)
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
        return list(v)
    raise ProtocolError("end_input must be true or a list of stream names")


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
        raise ProtocolError("text must be a string")
    kwargs = msg.get("model_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ProtocolError("model_kwargs must be an object")
    files = msg.get("files", [])
    if not isinstance(files, list):
        raise ProtocolError("files must be a list")
    return ClientInput(text=text, files=_files(files), model_kwargs=kwargs)


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
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"files[{i}].data is not valid base64") from None
        out.append(ClientFile(name, raw, stream))
    return out
