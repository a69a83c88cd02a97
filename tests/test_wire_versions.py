"""Wire versions (pure, no NATS): within a major, any two minors read each other, a reader
ignores fields it does not know, and a newer major is refused with a ProtocolError."""

from __future__ import annotations

import typing
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import pytest

from shared.bus import wire
from shared.runtime.errors import ProtocolError
from tests.support import wire_next

NEXT = wire_next.load("tests.wire_next_minor")
BEFORE_MINORS = wire_next.load("tests.wire_before_minors", "before_minors")

# Every kind of major 1 as the 1.0 release defined it ("!": required). Within major 1 these
# fields stay, with these types, and no field is required that is not required here: what a
# writer of any minor sends, a reader of any other can read.
MAJOR_1_0 = {
    "open": (
        "!cid:str !request_id:str !model:str !frontend_id:str model_kwargs:dict[str,Any] "
        "open_streams:list[str] published:dict[str,int] live:bool request_id_revision:int v:int"
    ),
    "in": "!seq:int !item:WireItem sent_ns:int v:int",
    "eoi": "!total:int v:int",
    "edge": "!seq:int !item:WireItem v:int",
    "edge_end": "!total:int v:int",
    "out": "!partition:str !seq:int !json:bytes sent_ns:int v:int",
    "done": "!partition:str !worker_id:str !outputs:int usage:dict[str,Any] v:int",
    "fin": (
        "!status:int !reason:str usage:dict[str,Any] error:str|None "
        "usage_by_partition:dict[str,dict[str,Any]] outputs:dict[str,int] v:int"
    ),
    "abort": "!reason:str status:int v:int",
    "placed": "!worker_id:str !partitions:list[str] v:int",
    "rt": "!n:int !json:bytes v:int",
    "assign": "!cid:str !model:str !partitions:list[str] model_kwargs:dict[str,Any] kwargs_in_open:bool v:int",
    "assign_reply": "!ok:bool error:str|None v:int",
    "worker_hb": (
        "!worker_id:str !model:str !partitions:list[str] !model_partitions:list[str] !capacity:int !load:int !ts:float v:int"
    ),
    "frontend_hb": "!frontend_id:str !ts:float v:int",
    "call": (
        "!cid:str !request_id:str !model:str !frontend_id:str !state:str !live:bool !created:float "
        "request_id_revision:int model_kwargs:dict[str,Any] kwargs_in_open:bool partitions:list[str] "
        "open_streams:list[str] placement:dict[str,str] done:dict[str,int] usage:dict[str,Any] v:int"
    ),
}


def kinds(mod: ModuleType) -> dict[str, type[msgspec.Struct]]:
    return {typing.cast(str, k.__struct_config__.tag): k for k in typing.get_args(mod.AnyMsg)}


def schema(kind: type[msgspec.Struct]) -> dict[str, str]:
    """field -> its type as MAJOR_1_0 writes it, "!" before a required field's name."""

    def name(t: Any) -> str:
        return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "").replace(" ", "")

    return {f.name: ("!" if f.required else "") + name(f.type) for f in msgspec.structs.fields(kind)}


def sample(t: msgspec.inspect.Type) -> Any:
    """A value of type t (as msgpack builtins) that is not the type's empty value."""
    simple = {
        msgspec.inspect.StrType: "s",
        msgspec.inspect.IntType: 7,
        msgspec.inspect.FloatType: 1.5,
        msgspec.inspect.BoolType: True,
        msgspec.inspect.BytesType: b"{}",
        msgspec.inspect.AnyType: 3,
    }
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, msgspec.inspect.ListType):
        return [sample(t.item_type)]
    if isinstance(t, msgspec.inspect.DictType):
        return {"k": sample(t.value_type)}
    if isinstance(t, msgspec.inspect.UnionType):
        return sample(next(u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)))
    if isinstance(t, msgspec.inspect.StructType):
        return {f.name: sample(f.type) for f in t.fields}
    raise AssertionError(f"no sample for {t}")


def full(kind: type[msgspec.Struct]) -> Any:
    """An instance of `kind` with every field given, the version fields left as written."""
    info = typing.cast(msgspec.inspect.StructType, msgspec.inspect.type_info(kind))
    given = {f.name: sample(f.type) for f in info.fields if f.name not in ("v", "vm")}
    return msgspec.convert(given, kind)


@pytest.mark.parametrize("tag", sorted(kinds(wire)))
def test_any_two_adjacent_minors_read_each_other_both_ways(tag: str) -> None:
    newer = full(kinds(NEXT)[tag])
    assert getattr(newer, wire_next.ADDED_FIELD) == "s"  # the added field is on the wire
    read_here = wire.decode(NEXT.encode(newer))
    assert (read_here.v, read_here.vm) == (wire.MAJOR, NEXT.MINOR)  # a newer minor: read, not refused
    assert msgspec.to_builtins(read_here) == {
        k: v for k, v in msgspec.to_builtins(newer).items() if k != wire_next.ADDED_FIELD and k != "vm"
    } | {"vm": NEXT.MINOR}

    older = full(kinds(wire)[tag])
    read_there = NEXT.decode(wire.encode(older))
    assert getattr(read_there, wire_next.ADDED_FIELD) == ""  # not sent: its default
    assert read_there.vm == wire.MINOR
    assert msgspec.to_builtins(read_there) == msgspec.to_builtins(older) | {wire_next.ADDED_FIELD: ""}


@pytest.mark.parametrize("tag", sorted(kinds(wire)))
def test_the_reader_released_before_minors_reads_this_release_and_the_next(tag: str) -> None:
    """The decoders already deployed refuse any `v` above 1 and know no `vm`: a new minor
    reaches them only because it leaves `v` alone and they skip what they do not know."""
    for mod in (wire, NEXT):
        msg = BEFORE_MINORS.decode(mod.encode(full(kinds(mod)[tag])))
        assert msg.v == 1
        assert not hasattr(msg, "vm")


def test_unknown_fields_are_ignored_at_every_depth() -> None:
    body = {
        "t": "in",
        "v": 1,
        "vm": 9,
        "seq": 3,
        "later": {"anything": [1, 2]},
        "item": {"data": {"dtype": "<i2", "shape": [2], "data": b"\x01\x00\x02\x00", "strides": [2]}, "meta": {}, "x": 1},
    }
    msg = wire.decode_as(msgspec.msgpack.encode(body), wire.InputItem)
    assert (msg.seq, msg.vm) == (3, 9)
    data = msg.item.to_item().data
    assert data is not None and data.tolist() == [1, 2]


def test_a_message_written_before_minors_were_carried_reads_as_this_processs_minor() -> None:
    # Bytes as the 1.0 release encoded them: `v` and no `vm` (the default, this process's own:
    # a reader decides by the fields present, never by the minor).
    msg = wire.decode_as(b"\x84\xa1t\xa5abort\xa6reason\xa4gone\xa6status\xcd\x01\xf7\xa1v\x01", wire.Abort)
    assert (msg.reason, msg.status, msg.v, msg.vm) == ("gone", 503, 1, wire.MINOR)
    item = wire.decode_as(
        b"\x85\xa1t\xa2in\xa3seq\x03\xa4item\x82\xa4data\x83\xa5dtype\xa3<i2\xa5shape\x91\x02\xa4data\xc4\x04"
        b"\x01\x00\x02\x00\xa4meta\x81\xa1k\x01\xa7sent_ns\x00\xa1v\x01",
        wire.InputItem,
    )
    data = item.item.to_item().data
    assert data is not None and np.array_equal(data, np.array([1, 2], "<i2"))


def test_a_newer_major_is_refused_with_a_protocol_error_that_names_both_versions() -> None:
    body = msgspec.msgpack.encode({"t": "abort", "v": wire.MAJOR + 1, "vm": 4, "reason": "x", "new_thing": 1})
    with pytest.raises(ProtocolError) as e:
        wire.decode(body)
    assert f"wire version {wire.MAJOR + 1}.4" in str(e.value)
    assert f"{wire.MAJOR}.{wire.MINOR}" in str(e.value)
    assert "newer major" in str(e.value)
    with pytest.raises(ProtocolError):
        wire.decode_as(body, wire.Abort)


def test_this_release_writes_major_1_and_its_minor() -> None:
    raw = msgspec.msgpack.decode(wire.encode(wire.Abort(reason="x")))
    assert (raw["v"], raw["vm"]) == (1, wire.MINOR)


def test_within_major_1_fields_are_only_added_and_with_defaults() -> None:
    assert wire.MAJOR == 1, "a new major starts a new MAJOR_1_0 table (and a rolled-out-together release)"
    now = kinds(wire)
    assert set(MAJOR_1_0) <= set(now), "a kind of major 1 is gone"
    for tag, fields in MAJOR_1_0.items():
        then = dict(f.lstrip("!").split(":", 1) for f in fields.split())
        required_then = {f.lstrip("!").split(":", 1)[0] for f in fields.split() if f.startswith("!")}
        have = schema(now[tag])
        for name, typ in then.items():
            assert name in have, f"{tag}.{name} was removed"
            assert have[name].lstrip("!") == typ, f"{tag}.{name} changed type: {typ} -> {have[name]}"
        required_now = {n for n, t in have.items() if t.startswith("!")}
        assert required_now == required_then, f"{tag}: required fields changed: {required_then} -> {required_now}"
