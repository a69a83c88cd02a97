"""Binary frames on `/generate/ws`, without NATS: a message in msgpack is the JSON message
with its files' bytes as they are; it gets the same answers as JSON, refusals included, and
a call opened in msgpack gets every message back in msgpack (docs/clients.md)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from models.echo import EchoModel
from services.conductor import core
from services.frontend.calls import CallInput, InputState
from services.frontend.outbox import Outbox, Packed, pack, to_json
from services.frontend.protocol import (
    AbortCall,
    Append,
    EndInput,
    Opening,
    ParseError,
    _fast_packed_append,
    _parse_packed,
    parse_frame,
    parse_message,
    parse_packed,
)
from services.frontend.relayed_call import RelayedCall
from services.frontend.socket_session import SocketSession
from services.worker import engine as eng
from services.worker.stepper import Stepper
from shared.bus import wire
from shared.runtime.config import parse_config
from shared.runtime.errors import LimitExceeded

PCM = np.arange(-40, 40, dtype="<i2").tobytes()


class Data:
    """A file's content: base64 text in the JSON message, bytes in the msgpack one."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def _to_json(obj: Any) -> Any:
    if isinstance(obj, Data):
        return base64.b64encode(obj.raw).decode()
    raise TypeError(type(obj))


def _to_packed(obj: Any) -> Any:
    if isinstance(obj, Data):
        return obj.raw
    raise TypeError(type(obj))


_json = msgspec.json.Encoder(enc_hook=_to_json).encode
_packed = msgspec.msgpack.Encoder(enc_hook=_to_packed).encode


def both(msg: object) -> tuple[bytes, bytes]:
    """The message as JSON text and in msgpack."""
    return _json(msg), _packed(msg)


def refusal(p: object) -> tuple[str, str, str | None, str | None]:
    assert isinstance(p, ParseError), p
    return type(p.error).__name__, p.error.message, p.request_id, p.kind


FILE = {"name": "a.pcm", "data": Data(PCM)}


# -- the same messages, the same answers ----------------------------------------
@pytest.mark.parametrize(
    "msg",
    [
        {"request_id": "r"},
        {"request_id": "r", "model": "echo", "text": "hi", "files": [FILE], "model_kwargs": {"a": [1, 2.5, None, True]}},
        {"request_id": "r", "append": [FILE, {**FILE, "stream": "audio_in"}]},
        {"request_id": "r", "append": {"text": "x", "files": [FILE]}, "end_input": True},
        {"request_id": "r", "end_input": ["audio_in"]},
        {"request_id": "r", "abort": True},
        {"request_id": "r", "append": [FILE], "text": None, "end_input": None},  # nulls count as absent
        {"files": [FILE], "end_input": True},
    ],
)
def test_a_message_in_msgpack_reads_as_its_json(msg: dict[str, Any]) -> None:
    text, packed = both(msg)
    from_json, from_packed = parse_message(text), parse_packed(packed)
    assert isinstance(from_packed, Opening | Append | EndInput | AbortCall), from_packed
    assert from_packed.binary and not getattr(from_json, "binary", True)
    from_packed.binary = False
    assert from_packed == from_json


MALFORMED: list[tuple[dict[str, Any], str | None, str]] = [
    ({"request_id": 5}, "opening", "request_id must be a string"),
    ({"request_id": "r", "text": 5}, "opening", "text must be a string"),
    ({"request_id": "r", "model": 1}, "opening", "model must be a string"),
    ({"request_id": "r", "files": {}}, "opening", "files must be a list"),
    ({"request_id": "r", "files": [{"data": Data(b"\0\0")}]}, "opening", "files[0].name"),
    ({"request_id": "r", "files": [{**FILE, "x": 1}]}, "opening", "unknown field"),
    ({"request_id": "r", "files": [5]}, "opening", "files[0] must be an object"),
    ({"request_id": "r", "files": [{**FILE, "stream": 3}]}, "opening", "files[0].stream must be a string"),
    ({"request_id": "r", "model_kwargs": []}, "opening", "model_kwargs must be an object"),
    ({"request_id": "r", "bogus": 1}, "opening", "unknown field(s) ['bogus']"),
    ({"request_id": "r r"}, "opening", "request_id must be 1-64"),
    ({"end_input": None}, "opening", "needs a request_id"),
    ({"request_id": "r", "end_input": "yes"}, "end", "end_input must be true or"),
    ({"request_id": "r", "end_input": []}, "end", "end_input must be true or"),
    ({"request_id": "r", "append": 5}, "append", "append must be an object or a list"),
    ({"request_id": "r", "append": {"bogus": 1}}, "append", "unknown field"),
    ({"append": []}, "append", "request_id is required"),
    ({"request_id": "r", "abort": 1}, "abort", "abort must be true"),
    ({"request_id": "r", "abort": True, "text": "x"}, "abort", "unknown field"),
    ({"request_id": "r", "model_kwargs": {"a": {"b": {}}}, "text": 1}, "opening", "text must be a string"),
]


@pytest.mark.parametrize(("msg", "kind", "words"), MALFORMED)
def test_a_malformed_message_gets_the_same_refusal_in_either_encoding(msg: dict[str, Any], kind: str | None, words: str) -> None:
    text, packed = both(msg)
    from_json, from_packed = parse_message(text), parse_packed(packed)
    assert refusal(from_packed) == refusal(from_json)
    assert isinstance(from_packed, ParseError) and from_packed.binary and from_packed.kind == kind
    assert from_packed.error.status == 400 and words in from_packed.error.message


# -- what only msgpack can get wrong ----------------------------------------------
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\xc1", "not msgpack"),  # a byte msgpack never uses
        (b"\x82\xaarequest_id", "not msgpack"),  # cut short
        (b"\x80\x80", "not msgpack"),  # two messages in one frame
        (b"\x81\xa2\xff\xfe\x01", "not msgpack"),  # a string that is not UTF-8
    ],
)
def test_not_msgpack_is_a_400(data: bytes, words: str) -> None:
    p = parse_packed(data)
    assert isinstance(p, ParseError) and p.binary and p.kind is None and p.request_id is None
    assert p.error.status == 400 and p.error.message.startswith(words), p.error.message


@pytest.mark.parametrize(("value", "got"), [([1, 2], "list"), ("text", "str"), (b"raw", "bytes"), (7, "int"), (None, "NoneType")])
def test_a_message_must_be_a_map(value: object, got: str) -> None:
    p = parse_packed(msgspec.msgpack.encode(value))
    assert isinstance(p, ParseError) and p.binary and p.kind is None
    assert p.error.message == f"a message must be a msgpack map, got {got}"


@pytest.mark.parametrize("append", [True, False])
def test_base64_text_where_bytes_are_expected_is_a_400_that_says_so(append: bool) -> None:
    f = {"name": "a.pcm", "data": base64.b64encode(PCM).decode()}
    msg = {"request_id": "r", "append": [f]} if append else {"request_id": "r", "files": [f]}
    p = parse_packed(msgspec.msgpack.encode(msg))
    assert isinstance(p, ParseError) and p.kind == ("append" if append else "opening") and p.request_id == "r"
    assert "files[0].data must be bytes (msgpack bin), got base64 text" in p.error.message
    p = parse_packed(msgspec.msgpack.encode({"request_id": "r", "files": [{"name": "a.pcm", "data": 3}]}))
    assert isinstance(p, ParseError) and "files[0].data must be bytes (msgpack bin), got int" in p.error.message


ODD_KEYS: list[tuple[dict[Any, Any], str, str]] = [
    ({"request_id": "r", 1: 2}, "opening", "a message's keys must be strings, got int"),
    ({"request_id": "r", b"text": "x"}, "opening", "a message's keys must be strings, got bytes"),
    ({"request_id": "r", "append": {b"files": []}}, "append", "append's keys must be strings, got bytes"),
    ({"request_id": "r", "append": [{**FILE, 7: 1}]}, "append", "files[0]'s keys must be strings, got int"),
]


@pytest.mark.parametrize(("msg", "kind", "words"), ODD_KEYS)
def test_map_keys_are_strings_as_in_json(msg: dict[Any, Any], kind: str, words: str) -> None:
    p = parse_packed(_packed(msg))
    assert isinstance(p, ParseError) and (p.request_id, p.kind) == ("r", kind) and p.error.status == 400
    assert words in p.error.message, p.error.message


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"a": b"\x00"}, "no bytes values"),
        ({"a": [{"b": msgspec.msgpack.Ext(5, b"x")}]}, "no Ext values"),
        ({"when": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)}, "no datetime values"),
        ({"a": {1: "x"}}, "map keys must be strings"),
    ],
)
def test_model_kwargs_hold_only_what_json_can(kwargs: dict[Any, Any], words: str) -> None:
    """A model sees the same kwargs whichever encoding its client chose."""
    for msg in ({"request_id": "r", "model_kwargs": kwargs}, {"request_id": "r", "append": {"model_kwargs": kwargs}}):
        p = parse_packed(msgspec.msgpack.encode(msg))
        assert isinstance(p, ParseError) and p.request_id == "r" and p.error.status == 400
        assert f"model_kwargs must hold only what JSON can: {words}" in p.error.message, p.error.message


@pytest.mark.parametrize("data", [b"\x91" * 5000 + b"\x01", b"\x82\xaarequest_id\xa1r\xa6append" + b"\x91" * 5000 + b"\x01"])
def test_msgpack_nested_too_deeply_is_a_400(data: bytes) -> None:
    p = parse_packed(data)
    assert isinstance(p, ParseError) and p.error.status == 400 and "nested too deeply" in p.error.message


def test_model_kwargs_nest_at_most_32_deep_in_msgpack_too() -> None:
    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(40):
        deep = {"k": deep}
    p = parse_packed(msgspec.msgpack.encode({"request_id": "r", "model_kwargs": deep}))
    assert isinstance(p, ParseError) and "model_kwargs nest deeper than 32 levels" in p.error.message


def test_msgpack_over_max_bytes_names_max_message_mb() -> None:
    big = msgspec.msgpack.encode({"request_id": "big", "append": [{"name": "a.pcm", "data": bytes(2000)}]})
    p = parse_packed(big, max_bytes=1000)
    assert isinstance(p, ParseError) and isinstance(p.error, LimitExceeded) and p.binary
    assert (p.error.limit, p.request_id, p.kind) == ("max_message_mb", "big", "append")
    p = parse_packed(b"\xc1" * 2000, max_bytes=1000)  # not msgpack either: the size is what is reported
    assert isinstance(p, ParseError) and "max_message_mb" in p.error.message and p.request_id is None
    assert isinstance(parse_packed(big, max_bytes=len(big)), Append)


def test_a_binary_frame_holding_json_is_read_as_json_as_before() -> None:
    for data in (b'{"request_id": "r"}', b' {"request_id": "r"}', b'\n{"request_id": "r"}'):
        p = parse_frame(data)
        assert isinstance(p, Opening) and not p.binary
    assert isinstance(parse_frame('{"request_id": "r"}'), Opening)
    p = parse_frame(msgspec.msgpack.encode({"request_id": "r"}))
    assert isinstance(p, Opening) and p.binary
    p = parse_frame(b"")
    assert isinstance(p, ParseError) and p.binary and "not msgpack" in p.error.message


B = PCM[:16]
FAST_OR_NOT = [
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B}]}, True),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B, "stream": "aux_in"}, {"name": "b.pcm", "data": b""}]}, True),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B, "stream": None}]}, True),
    ({"request_id": "r1", "append": []}, False),
    ({"request_id": "r1", "append": [{"name": "", "data": B}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": base64.b64encode(B).decode()}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B, "extra": 1}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B}], "end_input": True}, False),
    ({"request_id": "r1", "append": {"files": [{"name": "a.pcm", "data": B}]}}, False),
    ({"request_id": "r 1", "append": [{"name": "a.pcm", "data": B}]}, False),
    ({"request_id": None, "append": [{"name": "a.pcm", "data": B}]}, False),
    ({"request_id": "r1", "append": [{"name": 3, "data": B}]}, False),
]


@pytest.mark.parametrize(("msg", "fast"), FAST_OR_NOT)
def test_the_fast_packed_append_reads_exactly_what_the_general_path_reads(msg: dict[str, object], fast: bool) -> None:
    data = msgspec.msgpack.encode(msg)
    assert (_fast_packed_append(data) is not None) is fast
    general = _parse_packed(data, None, False)
    either = parse_packed(data)
    assert refusal(either) == refusal(general) if isinstance(general, ParseError) else either == general
    if fast:
        assert isinstance(general, Append) and general.binary and general.input.files[0].data == B


# -- replies ---------------------------------------------------------------------
EVENT = {"frame": 3, "audio": base64.b64encode(PCM).decode(), "rms": 12.5}


def a_call(sink: Any, binary: bool, rid: str | None = "r1") -> RelayedCall:
    inp = CallInput(EchoModel(), {"audio_in": None}, 1 << 20, 0.0)
    return RelayedCall("cid1", rid, inp, sink, True, binary=binary, binary_fields=("audio",))


def test_pack_event_gives_base64_fields_as_bytes() -> None:
    packed = msgspec.msgpack.decode(wire.pack_event(EVENT, ("audio",)))
    assert packed == {**EVENT, "audio": PCM}
    assert msgspec.msgpack.decode(wire.pack_event({"audio": "not base64!"}, ("audio",))) == {"audio": "not base64!"}
    assert msgspec.msgpack.decode(wire.pack_event({"text": "x"}, ("audio",))) == {"text": "x"}
    assert json.loads(wire.unpack_event(wire.pack_event(EVENT, ("audio",)))) == EVENT  # and back


@pytest.mark.parametrize("rid", ["r1", None])
def test_a_binary_call_gets_its_outputs_and_replies_in_msgpack(rid: str | None) -> None:
    sent: list[Any] = []
    sink = SimpleNamespace(send=sent.append)
    call = a_call(sink, binary=True, rid=rid)
    call.relay_output(wire.pack_event(EVENT, ("audio",)))
    call.reply({"finish": {"reason": "completed"}})
    assert all(isinstance(m, Packed) for m in sent)
    assert msgspec.msgpack.decode(sent[0].data) == {"request_id": rid, "output": {**EVENT, "audio": PCM}}
    assert msgspec.msgpack.decode(sent[1].data) == {"request_id": rid, "finish": {"reason": "completed"}}
    json_call = a_call(SimpleNamespace(send=sent.append), binary=False, rid=rid)
    json_call.relay_output(msgspec.json.encode(EVENT))
    assert json.loads(sent[2]) == {"request_id": rid, "output": EVENT}  # JSON text as before


def test_an_output_published_in_the_other_encoding_is_converted() -> None:
    """A worker of a release before 1.3 publishes JSON whatever the call: a binary call still
    gets bytes; and a packed output reaches a JSON call as base64 again."""
    as_json = wire.OutputMsg(partition="p", seq=0, json=msgspec.json.encode(EVENT))
    as_packed = wire.OutputMsg(partition="p", seq=0, json=wire.pack_event(EVENT, ("audio",)), packed=True)
    binary, text = a_call(None, binary=True), a_call(None, binary=False)
    assert binary.event_body(as_packed) is as_packed.json and text.event_body(as_json) is as_json.json  # untouched
    assert msgspec.msgpack.decode(binary.event_body(as_json)) == {**EVENT, "audio": PCM}
    assert json.loads(text.event_body(as_packed)) == EVENT
    assert json.loads(as_packed.event_json()) == EVENT == json.loads(as_json.event_json())


class Outlet:
    """A connection that records each frame and whether it was binary."""

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, bool]] = []
        self.on_room: Callable[[], None] | None = None

    def send_now(self, payload: bytes, binary: bool = False) -> None:
        self.frames.append((payload, binary))

    def has_room(self) -> bool:
        return True

    def messages(self) -> list[tuple[dict[str, Any], bool]]:
        return [(msgspec.msgpack.decode(p) if b else json.loads(p), b) for p, b in self.frames]


async def test_the_outbox_sends_packed_messages_as_binary_frames() -> None:
    outlet = Outlet()
    box = Outbox(outlet)
    box.send(pack({"request_id": "a", "error": "x", "status": 400}))
    box.send({"request_id": "b"})
    assert outlet.messages() == [({"request_id": "a", "error": "x", "status": 400}, True), ({"request_id": "b"}, False)]
    queued = Outbox()  # another ASGI server's socket: queued for its writer
    queued.send(pack({"audio": b"\x01\x02"}))
    got = await queued.get()
    assert isinstance(got, Packed) and queued.queued_bytes == 0
    assert json.loads(to_json(got)) == {"audio": base64.b64encode(b"\x01\x02").decode()}  # JSON carries bytes as base64


class StandIn:
    """The service, standing in: openings open at once, appends are taken."""

    def __init__(self) -> None:
        self.config = parse_config({})

    async def open_call(self, o: Opening, sink: Any, on_end: Any = None) -> Any:
        return SimpleNamespace(
            cid=f"c-{o.request_id}",
            request_id=o.request_id,
            binary=o.binary,
            live=True,
            ended=asyncio.Event(),
            input=SimpleNamespace(state=InputState.ENDED if o.request_id == "ended" else InputState.OPEN),
        )

    async def append(self, call: Any, a: Any) -> None: ...
    async def end_input(self, call: Any, e: Any) -> None: ...
    async def abort(self, call: Any, reason: str, status: int, tell_client: bool = False) -> None: ...


async def test_a_reply_goes_in_the_encoding_of_its_call_or_else_of_its_message() -> None:
    outlet = Outlet()
    session = SocketSession(Outbox(outlet), StandIn())
    for rid in ("bin", "ended"):
        await session.handle(msgspec.msgpack.encode({"request_id": rid}))
    await asyncio.sleep(0)
    assert session.live("bin") is not None and session.live("bin").binary  # type: ignore[union-attr]
    # A JSON message about a binary call: the reply is the call's, in msgpack.
    await session.handle(json.dumps({"request_id": "ended", "end_input": True}))
    # No call: each reply in its message's encoding.
    await session.handle(json.dumps({"request_id": "none", "abort": True}))
    await session.handle(msgspec.msgpack.encode({"request_id": "none", "abort": True}))
    await session.handle(b"\xc1")
    await session.handle("not json")
    await session.handle(msgspec.msgpack.encode({"request_id": "new", "files": [{"name": "a.pcm", "data": "AAAA"}]}))
    await asyncio.sleep(0)
    got = [(m.get("request_id"), m["status"], b) for m, b in outlet.messages()]
    assert got == [
        ("ended", 409, True),
        ("none", 404, False),
        ("none", 404, True),
        (None, 400, True),
        (None, 400, False),
        ("new", 400, True),
    ]
    await session.close()


# -- the call's encoding on the bus ------------------------------------------------
def test_the_conductor_passes_a_binary_call_on_to_its_workers_and_its_record() -> None:
    c = core.Conductor(parse_config({}))
    c.handle(
        core.WorkerSeen(
            wire.WorkerHeartbeat(
                worker_id="w", model="echo", partitions=["p"], model_partitions=["p"], capacity=4, load=0, ts=0.0
            )
        )
    )
    for cid, binary in (("a", True), ("b", False)):
        acts = c.handle(
            core.Opened(
                wire.Open(cid=cid, request_id=cid, model="echo", frontend_id="f", open_streams=["audio_in"], binary=binary), 0.0
            )
        )
        assert [a.msg.binary for a in acts if isinstance(a, core.SendAssign)] == [binary]
        assert [a.record.binary for a in acts if isinstance(a, core.SaveRecord)] == [binary]
        assert core.Call.from_record(c.calls[cid].record()).binary is binary


async def test_a_worker_publishes_a_binary_calls_outputs_packed() -> None:
    published: list[bytes] = []

    async def publish(subject: str, body: bytes) -> None:
        published.append(body)

    calls = {"bin": SimpleNamespace(binary=True), "txt": SimpleNamespace(binary=False)}
    ctx = SimpleNamespace(bus=SimpleNamespace(publish=publish), binary_fields=("audio",))
    stepper = Stepper(ctx, SimpleNamespace(calls=calls), 0.0)  # type: ignore[arg-type]
    await stepper.carry_out([eng.PublishOutput("bin", 0, EVENT), eng.PublishOutput("txt", 0, EVENT)], "p")
    bin_out, txt_out = (wire.decode_as(b, wire.OutputMsg) for b in published)
    assert bin_out.packed and msgspec.msgpack.decode(bin_out.json) == {**EVENT, "audio": PCM}
    assert not txt_out.packed and json.loads(txt_out.json) == EVENT


def test_a_packed_output_reads_as_json_in_a_replay() -> None:
    from clients import replay

    o = wire.OutputMsg(partition="p", seq=0, json=wire.pack_event(EVENT, ("audio",)), packed=True)
    assert f"audio {len(PCM)} B" in replay._output(o)
    assert replay._output(wire.OutputMsg(partition="p", seq=0, json=b"\xc1", packed=True)) == "1 B (not msgpack)"
