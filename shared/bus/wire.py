"""The wire schema: one typed, tagged msgpack struct per message kind.

encode/decode are pure functions. Every message carries its writer's wire version:
`v`, the major, and `vm`, the minor. Within a major, a new minor only adds fields, each
with a default that means what the message meant without it; a reader ignores fields it
does not know (msgspec's default) and fills the ones a writer did not send with their
defaults, so any two minors of one major read each other, and the services of a running
deployment can be replaced one at a time (docs/operations.md). A minor never removes a
field or changes what a field or one of its values means, and a new message kind goes on
subjects no older reader reads (an unknown tag is undecodable). A decoder refuses a newer
major rather than misreading it.
"""

from __future__ import annotations

import binascii
import enum
import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np
import pybase64

from shared.runtime.errors import ProtocolError
from shared.sdk.chunking import Item

# `v` stays the major alone: the decoders already deployed refuse any `v` above 1, so a
# new minor must never raise it. The minor travels beside it, in `vm`, which those
# decoders ignore like any field they do not know.
# Minors: 1.1 added EdgeItemMsg.walk; 1.2 the frontend's beats and held calls
# (FrontendHeartbeat.beat and .calls, Open.frontend_beat, CallRecord.frontend_beat); 1.3
# calls whose client reads msgpack (Open.binary, CallRecord.binary, Assign.binary,
# OutputMsg.packed); 1.4 realtime sessions that move between frontends
# (FrontendHeartbeat.adopted, CallRecord.moves, and RealtimeTake, RealtimeMove and
# RealtimeTaken on the `ctl.realtime.*` subjects); 1.5 where a call's messages start in the
# stream (Open.read_after, Assign.read_after, CallRecord.read_after): a worker's first read
# of the call starts there.
MAJOR = 1
MINOR = 5
_T = TypeVar("_T", bound="Msg")


class Tensor(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, a: np.ndarray) -> Tensor:
        # tobytes() is in C order whatever the array's layout. np.ascontiguousarray, used here
        # before, also made a 0-d array (a model's scalar item) 1-d on the way.
        a = np.asarray(a)
        if a.dtype.hasobject:  # its bytes would be this process's pointers
            raise TypeError(f"an array of dtype {a.dtype} cannot be sent: only plain numeric or byte data")
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def to_array(self) -> np.ndarray:
        # Every item a worker takes comes through here: the dtype is looked up, not parsed from
        # its text each time, and a 1-D item (audio) needs no reshape (1.3 against 0.5 µs).
        a = np.frombuffer(self.data, dtype=_dtype(self.dtype))
        if len(self.shape) == 1 and self.shape[0] == a.size:
            return a
        return a.reshape(self.shape)


@functools.lru_cache(maxsize=64)  # the wire's dtypes are a handful; a bound all the same
def _dtype(text: str) -> np.dtype[Any]:
    return np.dtype(text)


class WireItem(msgspec.Struct, frozen=True):
    data: Tensor | None = None
    meta: dict[str, Any] = {}

    @classmethod
    def from_item(cls, item: Item) -> WireItem:
        return cls(None if item.data is None else Tensor.from_array(item.data), item.meta)

    def to_item(self) -> Item:
        return Item(None if self.data is None else self.data.to_array(), dict(self.meta))


class Msg(msgspec.Struct, tag_field="t", kw_only=True):
    v: int = MAJOR
    # For logs and replays only: a reader decides by the fields present, never by the minor.
    # A message from before minors were carried has none and so reads as this process's own.
    vm: int = MINOR


class Open(Msg, tag="open"):
    """call.{cid}.open: frontend -> conductor."""

    cid: str
    request_id: str
    model: str
    frontend_id: str
    model_kwargs: dict[str, Any] = {}
    open_streams: list[str] = []  # client streams left open
    published: dict[str, int] = {}  # items already published per edge
    live: bool = True  # a live call leaves a stream open; a one-shot may queue
    request_id_revision: int = 0  # the request_ids KV revision that reserved it: freed in one round trip
    # 1.2: the number of the frontend's last heartbeat built before it took the call: each
    # heartbeat numbered above lists the call while the frontend holds it (0: before its first,
    # or a frontend that lists none).
    frontend_beat: int = 0
    # 1.3: the client reads the call's replies in msgpack (binary frames): its outputs are
    # published packed (`pack_event`), so the frontend relays them as they come.
    binary: bool = False
    # 1.5: the last stream sequence the frontend saw stored before it published the call's
    # first message (0: none seen): every message of the call is stored after it.
    read_after: int = 0


class InputItem(Msg, tag="in"):
    """call.{cid}.in.{edge}: one client stream item."""

    seq: int
    item: WireItem
    sent_ns: int = 0  # wall clock at publish: the worker measures the data path with it


class EndOfInput(Msg, tag="eoi"):
    """call.{cid}.eoi.{edge}: end of a client stream, as an item count."""

    total: int


class EdgeItemMsg(Msg, tag="edge"):
    """call.{cid}.edge.{edge}: one inter-partition item."""

    seq: int
    item: WireItem
    # 1.1: the walk the consumer runs the item's chunk under (the edge's consumer_walk named
    # it on the producer's side); "": none named (an edge that drives no walk, or a 1.0 writer).
    walk: str = ""


class EdgeEnd(Msg, tag="edge_end"):
    total: int


class OutputMsg(Msg, tag="out"):
    """call.{cid}.out: one output event; `seq` counts per partition.

    The event is encoded as its client reads it already (JSON text, or for a call opened in
    msgpack, `packed`): the frontend relays it to the client without decoding it.
    """

    partition: str
    seq: int
    json: bytes  # the event: JSON text, or msgpack where `packed`
    sent_ns: int = 0  # the worker's wall clock when it published it (the frontend's reply lag); 0: not given
    # 1.3: `json` holds the event in msgpack, the model's base64 fields as bytes (`pack_event`).
    packed: bool = False

    def event_json(self) -> bytes:
        """The event as JSON text, however it was published."""
        return unpack_event(self.json) if self.packed else self.json


class Done(Msg, tag="done"):
    """call.{cid}.done.{partition}: the partition finished the call."""

    partition: str
    worker_id: str
    outputs: int  # how many outputs it published: the frontend waits for all
    usage: dict[str, Any] = {}


class Fin(Msg, tag="fin"):
    """call.{cid}.fin: the call ended."""

    status: int  # 200 on completion, else the client status
    reason: str
    usage: dict[str, Any] = {}  # merged by meaning (conductor.core.merge_usage)
    error: str | None = None
    usage_by_partition: dict[str, dict[str, Any]] = {}  # what each partition reported
    outputs: dict[str, int] = {}  # partition -> outputs published


class Abort(Msg, tag="abort"):
    reason: str
    status: int = 499


class Assign(Msg, tag="assign"):
    """ctl.worker.{id}.assign: run these partitions of the call (request/reply)."""

    cid: str
    model: str
    partitions: list[str]
    model_kwargs: dict[str, Any] = {}
    kwargs_in_open: bool = False  # too large to carry here: read them from call.{cid}.open
    binary: bool = False  # 1.3: publish the call's outputs packed (Open.binary)
    # 1.5: nothing of the call is stored at or before this stream sequence (Open.read_after;
    # 0: not known): the worker's first read of its input starts after it, not at the
    # stream's start.
    read_after: int = 0


class AssignReply(Msg, tag="assign_reply"):
    ok: bool
    error: str | None = None


class WorkerHeartbeat(Msg, tag="worker_hb"):
    worker_id: str
    model: str
    partitions: list[str]  # the ones this worker runs
    model_partitions: list[str]  # all of the model's, so the conductor needs no model code
    capacity: int
    load: int
    ts: float


class FrontendHeartbeat(Msg, tag="frontend_hb"):
    frontend_id: str
    ts: float
    # 1.2: the heartbeat's number, counted from 1 by the frontend process (0: not counted).
    beat: int = 0
    # 1.2: the cids of the calls the frontend holds as it builds the heartbeat; None: not
    # listed (a 1.1 frontend, or one holding more than it lists): nothing is reconciled by it.
    calls: list[str] | None = None
    # 1.4: of the calls listed, those the frontend took over from another one (a realtime
    # session resumed here), each with its number of moves: the conductor makes this frontend
    # the call's own where the number is above the one it knows (`CallRecord.moves`).
    adopted: dict[str, int] = {}


class CallRecord(Msg, tag="call"):
    """duplex_calls KV: what a restarted conductor needs to carry on."""

    cid: str
    request_id: str
    model: str
    frontend_id: str
    state: str
    live: bool
    created: float
    request_id_revision: int = 0
    model_kwargs: dict[str, Any] = {}
    kwargs_in_open: bool = False
    partitions: list[str] = []
    open_streams: list[str] = []
    placement: dict[str, str] = {}  # partition -> worker_id
    done: dict[str, int] = {}  # partition -> outputs
    usage: dict[str, Any] = {}
    frontend_beat: int = 0  # 1.2: the open's, so a restored call is reconciled as before
    binary: bool = False  # 1.3: the open's (its outputs are published packed)
    moves: int = 0  # 1.4: how often the call moved to another frontend (`frontend_id` is its latest)
    read_after: int = 0  # 1.5: where its messages start in the stream (Assign.read_after)


class Placed(Msg, tag="placed"):
    """call.{cid}.placed.{worker_id}: a worker took these partitions of the call.

    Stored with an ack after the worker has subscribed and before it reads the call from the
    stream. The stream stores messages in the order it receives them, some time after, so a
    message published just before the subscriptions (missed by them) may not be stored yet
    when the read starts; once this one is stored, it is. It also shows where each
    partition ran in a replay."""

    worker_id: str
    partitions: list[str]


class RealtimeEvent(Msg, tag="rt"):
    """call.{cid}.rt: the n-th realtime server event of the session, as its JSON text."""

    n: int
    json: bytes


class RealtimeTake(Msg, tag="rt_take"):
    """ctl.realtime.{cid}.take: a frontend a client resumed a session on asks the frontend
    that holds the session for it (request/reply; only the holder is subscribed)."""

    token: str  # the session's resume token, as the client gave it
    last_seen: int  # the number of the last event the client saw (0: none)
    frontend_id: str  # the asking frontend
    session_format: int = 0  # the layout of a session's state the asker reads (another: refused)


class RealtimeMove(Msg, tag="rt_move"):
    """The answer to a `RealtimeTake`: the session and its call, which the holder has let go
    (it relays and publishes nothing more of it, and lists the call in its heartbeats until
    the taker says `RealtimeTaken`), or why not (`error`; nothing moved)."""

    ok: bool
    code: str = ""  # refused: the realtime error code the resuming client gets, its message and param
    error: str = ""
    param: str = ""
    frontend_id: str = ""  # the holder that let it go
    model: str = ""
    request_id: str = ""
    request_id_revision: int = 0  # the reservation, freed by whoever holds the call when it ends
    moves: int = 0  # the call's moves, this one counted
    # The call's input as the holder left it (`calls.CallInput`): items published per edge,
    # streams still open, bytes charged, and each framed stream's samples short of an item.
    published: dict[str, int] = {}
    open_streams: list[str] = []
    input_bytes: int = 0
    remainders: dict[str, Tensor] = {}
    # Its relay (`relay.OutputRelay`): outputs relayed per partition, and the stream sequence
    # a read of its outputs starts after.
    next_out: dict[str, int] = {}
    read_to: int = 0
    age_s: float = 0.0  # how long the session has lived (realtime.max_session_s)
    session: bytes = b""  # the session's own state (`pack_state`, services/frontend/realtime/moving.py)


class RealtimeTaken(Msg, tag="rt_taken"):
    """ctl.realtime.{cid}.taken: the taker holds the call and a heartbeat of its that lists
    it as adopted is stored: the previous holder stops listing it."""

    frontend_id: str


AnyMsg = (
    Open
    | InputItem
    | EndOfInput
    | EdgeItemMsg
    | EdgeEnd
    | OutputMsg
    | Done
    | Fin
    | Abort
    | Placed
    | RealtimeEvent
    | RealtimeTake
    | RealtimeMove
    | RealtimeTaken
    | Assign
    | AssignReply
    | WorkerHeartbeat
    | FrontendHeartbeat
    | CallRecord
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> AnyMsg:
    try:
        msg = _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable message: {e}") from None
    if msg.v > MAJOR:
        raise ProtocolError(
            f"a {type(msg).__name__} of wire version {msg.v}.{msg.vm}, a newer major than this process's "
            f"{MAJOR}.{MINOR}: it cannot be read (a new major is not rolled out one process at a time)"
        )
    return msg


def decode_as(data: bytes, kind: type[_T]) -> _T:
    msg = decode(data)
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def edge_item(seq: int, item: Item, walk: str = "") -> bytes:
    """An edge item's message. Raises (TypeError, ValueError) where the model's item holds
    what the wire cannot carry: a value msgspec cannot encode, such as a numpy scalar in its
    meta, or an array of objects."""
    return encode(EdgeItemMsg(seq=seq, item=WireItem.from_item(item), walk=walk))


def as_sent(item: Item) -> Item:
    """The item as a partition in another process gets it: encoded and decoded, so its array
    is read-only and its meta is what msgpack gives back (lists for tuples). Raises as
    `edge_item` does (`duplexbus check-model` finds it so)."""
    return decode_as(edge_item(0, item), EdgeItemMsg).item.to_item()


def event_body(data: dict[str, Any], packed: bool, binary_fields: Collection[str]) -> bytes:
    """An output event as its client reads it: JSON text, or packed (`pack_event`) for a call
    opened in msgpack. Raises (TypeError, ValueError) where a value cannot be encoded."""
    return pack_event(data, binary_fields) if packed else msgspec.json.encode(data)


def check_event(data: dict[str, Any], binary_fields: Collection[str]) -> None:
    """Raises where an output event cannot reach a client in either encoding."""
    for packed in (False, True):
        event_body(data, packed, binary_fields)


# -- output events -------------------------------------------------------------
# An output event is a model's dict. Its client reads it as JSON text, or, on a call opened
# in msgpack, as msgpack with the fields the model names in `Model.binary_fields` (base64
# text in JSON: audio) as raw bytes. Workers publish it in the call's encoding, so the
# frontend relays it without decoding it; these convert one to the other where an output
# arrives in the other encoding (a worker of a release before 1.3, a recording read back).
_event_encoder = msgspec.msgpack.Encoder()


def pack_event(data: dict[str, Any], binary_fields: Collection[str]) -> bytes:
    """The event in msgpack, each of `binary_fields` that holds base64 text as its bytes
    (text that is not base64 stays text; bytes, `pcm16_bytes`'s, stay as they are)."""
    raw: dict[str, Any] | None = None
    for f in binary_fields:
        v = data.get(f)
        if isinstance(v, str):
            try:
                b = pybase64.b64decode(v.encode("ascii"), validate=True)
            except (binascii.Error, ValueError):
                continue
            if raw is None:
                raw = dict(data)
            raw[f] = b
    return _event_encoder.encode(data if raw is None else raw)


def repack_event(json_text: bytes, binary_fields: Collection[str]) -> bytes:
    """A JSON event as `pack_event` makes it."""
    try:
        data = msgspec.json.decode(json_text)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"an output that is not JSON: {e}") from None
    if not isinstance(data, dict):
        return _event_encoder.encode(data)
    return pack_event(data, binary_fields)


def unpack_event(packed: bytes) -> bytes:
    """A packed event as JSON text: its bytes as base64 again (msgspec writes bytes so)."""
    try:
        return msgspec.json.encode(msgspec.msgpack.decode(packed))
    except (msgspec.DecodeError, TypeError) as e:
        raise ProtocolError(f"an output that is not msgpack: {e}") from None


# -- object state ----------------------------------------------------------------
# A realtime session that moves to another frontend travels as its pure objects' state
# (`RealtimeMove.session`): msgpack, with what msgpack has no type for as extensions. Only
# data is built from the bytes: containers, numpy arrays, and instances of the classes a
# reader names (`StateKinds`), made without running any of their code (their attributes
# are set as they were). Nothing else: no pickle, whose bytes may run anything.
_TUPLE, _DICT, _ODICT, _DEQUE, _ARRAY, _SCALAR, _ENUM, _OBJECT, _REDUCED = range(1, 10)
_state_encoder = msgspec.msgpack.Encoder()


class StateKinds:
    """The classes an object state may hold besides containers and numpy arrays, known by
    their names: `classes` (dataclasses, enums, plain objects: built from their attributes),
    and `reduced` ones, each with a function to data and one that builds it again from that
    (an object holding a native handle)."""

    def __init__(
        self,
        classes: Iterable[type],
        reduced: Mapping[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] | None = None,
    ) -> None:
        self.names: dict[type, str] = {c: c.__qualname__ for c in classes}
        self.classes = {name: c for c, name in self.names.items()}
        self.reduce = {c: (c.__qualname__, to) for c, (to, _) in (reduced or {}).items()}
        self.build = {c.__qualname__: back for c, (_, back) in (reduced or {}).items()}


def pack_state(obj: Any, kinds: StateKinds) -> bytes:
    """`obj` as bytes `unpack_state` reads back; TypeError for a value of a class `kinds`
    does not name (nothing is packed)."""
    return _state_encoder.encode(_tree(obj, kinds))


def _ext(code: int, value: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, _state_encoder.encode(value))


def _tree(o: Any, kinds: StateKinds) -> Any:
    t = type(o)
    if o is None or t in (bool, int, float, str, bytes):
        return o
    if t is list:
        return [_tree(v, kinds) for v in o]
    if t is dict:
        if all(type(k) is str for k in o):
            return {k: _tree(v, kinds) for k, v in o.items()}
        return _ext(_DICT, [[_tree(k, kinds), _tree(v, kinds)] for k, v in o.items()])
    if t is OrderedDict:
        return _ext(_ODICT, [[_tree(k, kinds), _tree(v, kinds)] for k, v in o.items()])
    if t is tuple:
        return _ext(_TUPLE, [_tree(v, kinds) for v in o])
    if t is deque:
        return _ext(_DEQUE, [o.maxlen, [_tree(v, kinds) for v in o]])
    if t is np.ndarray:
        return _ext(_ARRAY, [o.dtype.str, list(o.shape), o.tobytes()])  # (C order, any layout)
    if isinstance(o, np.generic):
        return _ext(_SCALAR, [o.dtype.str, o.tobytes()])
    if t in kinds.reduce:
        reduced, to = kinds.reduce[t]
        return _ext(_REDUCED, [reduced, _tree(to(o), kinds)])
    name = kinds.names.get(t)
    if name is None:
        raise TypeError(f"a {t.__module__}.{t.__qualname__} is not data that can move to another process")
    if isinstance(o, enum.Enum):
        return _ext(_ENUM, [name, _tree(o.value, kinds)])
    try:
        fields = vars(o)
    except TypeError:  # __slots__: no attributes to set again
        raise TypeError(f"a {t.__qualname__} keeps no attributes of its own (__slots__): it cannot be moved") from None
    return _ext(_OBJECT, [name, {k: _tree(v, kinds) for k, v in fields.items()}])


def unpack_state(data: bytes, kinds: StateKinds) -> Any:
    """What `pack_state` packed; ProtocolError for bytes that are not such a state or name a
    class `kinds` does not."""

    def hook(code: int, body: memoryview) -> Any:
        v = decoder.decode(body)
        if code in (_DICT, _ODICT):
            return (dict if code == _DICT else OrderedDict)((k, x) for k, x in v)
        if code == _TUPLE:
            return tuple(v)
        if code == _DEQUE:
            return deque(v[1], maxlen=v[0])
        if code == _ARRAY:
            return np.frombuffer(v[2], dtype=np.dtype(v[0])).reshape(v[1]).copy()
        if code == _SCALAR:
            return np.frombuffer(v[1], dtype=np.dtype(v[0]))[0]
        if code == _REDUCED:
            return kinds.build[v[0]](v[1])
        cls = kinds.classes[v[0]]
        if code == _ENUM:
            return cls(v[1])
        if code == _OBJECT:
            obj: Any = object.__new__(cls)
            obj.__dict__.update(v[1])  # as it was: no __init__, no __setattr__ (a frozen dataclass)
            return obj
        raise ValueError(f"unknown extension {code}")

    decoder = msgspec.msgpack.Decoder(ext_hook=hook)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise ProtocolError(f"an object state that cannot be read: {e!r}") from None
