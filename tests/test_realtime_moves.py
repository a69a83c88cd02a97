"""A realtime session that moves to another frontend, without NATS: its pure core as data
and back (the moved session goes on exactly as one that stayed), its call's input and relay
handed over, the data codec that carries them, and the resume token (docs/realtime.md,
"Resume"). The conductor's side is in tests/test_reconcile.py; the whole move between two
frontends in tests/test_realtime_resume.py."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from models.echo import FRAME, EchoModel
from services.frontend import moves
from services.frontend.calls import CallInput, InputState
from services.frontend.outbox import Outbox
from services.frontend.realtime.session import (
    STATE_FORMAT,
    STATE_KINDS,
    RealtimeSession,
    ResponseState,
    SendAudio,
    event_number,
    resume_token,
    token_cid,
)
from services.frontend.relay import OutputRelay
from services.frontend.relayed_call import RelayedCall
from services.frontend.shares import Shares, moved_in
from shared.bus import wire
from shared.runtime.errors import ProtocolError
from shared.sdk.audio import b64_pcm16
from shared.sdk.model import ClientFile, ClientInput
from shared.sdk.realtime import ModelEvent, RealtimeMapping, ReplyStarted
from tests.support.realtime import MANUAL_16K, audio_of, check_responses, snr_db, tone
from tests.test_realtime_pure import Harness

SERVER_VAD_16K = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": {"type": "server_vad"}},
            "output": {"format": {"type": "audio/pcm", "rate": 16000}},
        },
    },
}


def echo_frames(h: Harness, upto: int | None = None) -> None:
    """echo's output for the whole frames sent so far, up to frame `upto` (not included)."""
    stream = np.concatenate(h.sent) if h.sent else np.zeros(0, np.int16)
    last = len(stream) // FRAME if upto is None else min(upto, len(stream) // FRAME)
    while h.echoed < last:
        f = stream[h.echoed * FRAME : (h.echoed + 1) * FRAME]
        rms = float(np.sqrt(np.mean(f.astype(np.float64) ** 2)))
        h.take(h.s.on_output({"frame": h.echoed, "audio": b64_pcm16(f), "rms": rms}, 0.0))
        h.echoed += 1


def move(h: Harness, there: float = 100.0, here: float = 5.0) -> None:
    """The session moves: let go at `there` on one clock, taken up at `here` on another, with a
    fresh mapping of the model."""
    h.take(h.s.let_go())
    data = h.s.snapshot(there)
    h.s = RealtimeSession.restored(data, EchoModel().realtime_mapping(), here)


def twins() -> tuple[Harness, Harness]:
    return Harness(), Harness()


def both(pair: tuple[Harness, Harness], body: dict[str, Any]) -> None:
    for h in pair:
        h.send(body)


def test_a_session_moved_mid_reply_goes_on_exactly_as_one_that_stayed() -> None:
    """Manual turns at echo's rate: moved while the model's reply comes (half of it relayed),
    the moved session sends the same events, numbered on, and the same audio to the call as
    its twin that stayed; the reply and the next turn come back byte-exact."""
    pair = twins()
    stayed, moved = pair
    both(pair, MANUAL_16K)
    clip = tone(1.0, 16000)
    both(pair, {"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    both(pair, {"type": "input_audio_buffer.commit"})
    both(pair, {"type": "response.create"})
    for h in pair:
        echo_frames(h, upto=6)
    assert moved.s.response is not None and moved.s.response.state is ResponseState.SPEAKING
    move(moved)
    second = tone(0.3, 16000, hz=880)
    for h in pair:
        echo_frames(h)
        h.send({"type": "input_audio_buffer.append", "audio": b64_pcm16(second)})
        h.send({"type": "input_audio_buffer.commit"})
        h.send({"type": "response.create"})
        h.send({"type": "conversation.item.retrieve", "item_id": h.s.last_item})
        echo_frames(h)
    assert moved.events == stayed.events
    assert np.array_equal(np.concatenate(moved.sent), np.concatenate(stayed.sent))
    done = [e["response"]["id"] for e in moved.events if e["type"] == "response.done"]
    assert audio_of(moved.events, done[0]) == clip.tobytes() and audio_of(moved.events, done[1]) == second.tobytes()
    assert [event_number(e["event_id"]) for e in moved.events] == list(range(1, len(moved.events) + 1))
    check_responses(moved.events)


def test_a_session_moved_mid_turn_under_server_vad_ends_the_turn_as_one_that_stayed() -> None:
    """echo's own turn-taking holds the open turn's frames in its mapping: moved mid-turn,
    the mapping's state goes along and the turn comes back whole."""
    pair = twins()
    stayed, moved = pair
    both(pair, SERVER_VAD_16K)
    voiced = tone(FRAME * 5 / 16000, 16000)
    both(pair, {"type": "input_audio_buffer.append", "audio": b64_pcm16(np.concatenate([np.zeros(FRAME * 2, np.int16), voiced]))})
    for h in pair:
        echo_frames(h)
    assert moved.s.speech_item is not None  # the caller is speaking
    move(moved)
    both(pair, {"type": "input_audio_buffer.append", "audio": b64_pcm16(np.zeros(FRAME * 8, np.int16))})
    for h in pair:
        echo_frames(h)
    assert moved.events == stayed.events
    assert audio_of(moved.events) == voiced.tobytes()
    check_responses(moved.events)


def test_a_move_between_resampled_appends_loses_no_input() -> None:
    """At 24 kHz the input resampler holds its filter's delay: the move sends it into the
    call first (as a change of rate does), so the model gets the whole clip, nearly as the
    twin that stayed got it."""
    pair = twins()
    moved = pair[1]
    both(pair, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    clip = tone(1.0, 24000)
    for i in range(0, len(clip), 480):
        both(pair, {"type": "input_audio_buffer.append", "audio": b64_pcm16(clip[i : i + 480])})
        if i == 480 * 25:
            move(moved)
    both(pair, {"type": "input_audio_buffer.commit"})
    both(pair, {"type": "response.create"})
    for h in pair:
        echo_frames(h)
    got = [np.frombuffer(audio_of(h.events), dtype="<i2") for h in pair]
    assert abs(len(got[1]) - len(got[0])) <= 2, (len(got[0]), len(got[1]))
    assert snr_db(clip, got[1]) > 35.0 and snr_db(got[0], got[1]) > 35.0
    check_responses(moved.events)


def test_a_move_mid_reply_at_24khz_loses_no_reply_audio() -> None:
    """The reply's resampler (echo's 16 kHz to the session's 24) holds its delay too: the move
    sends it to the client as audio first, so the reply is whole."""
    pair = twins()
    moved = pair[1]
    both(pair, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    clip = tone(1.0, 24000)
    both(pair, {"type": "input_audio_buffer.append", "audio": b64_pcm16(clip)})
    both(pair, {"type": "input_audio_buffer.commit"})
    both(pair, {"type": "response.create"})
    for h in pair:
        echo_frames(h, upto=6)
    move(moved)
    for h in pair:
        echo_frames(h)
    got = [np.frombuffer(audio_of(h.events), dtype="<i2") for h in pair]
    assert abs(len(got[1]) - len(got[0])) <= 2, (len(got[0]), len(got[1]))
    assert snr_db(clip, got[1]) > 35.0
    check_responses(moved.events)


def test_a_moved_response_keeps_its_deadline_on_the_new_clock() -> None:
    """A response waiting for the model's reply keeps what was left of response_wait_s (5 s):
    times travel against the clock of the move."""
    h = Harness()
    h.send(MANUAL_16K)
    h.append(tone(0.2, 16000))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"}, now=98.0)  # its deadline: 103.0, 3 s after the move
    move(h, there=100.0, here=5.0)
    assert h.take(h.s.tick(7.9)) == []
    out = h.take(h.s.tick(8.0))
    assert out[-1]["type"] == "response.done" and out[-1]["response"]["status"] == "incomplete"


class Holding(RealtimeMapping):
    """A mapping whose state holds an object of its own, which is not data."""

    def __init__(self) -> None:
        self.thing = object()

    def on_output(self, output: dict[str, Any]) -> list[ModelEvent]:
        return [ReplyStarted()]


class Gives(Holding):
    """The same, saying what it needs by itself."""

    def state(self) -> dict[str, Any]:
        return {"things": 1}

    def restore(self, state: dict[str, Any]) -> None:
        self.thing = ("restored", state["things"])


def test_a_mapping_that_holds_what_is_not_data_says_so_unless_it_gives_its_state() -> None:
    with pytest.raises(TypeError, match="not data"):
        Harness(Holding()).s.snapshot(0.0)
    data = Harness(Gives()).s.snapshot(0.0)
    back = RealtimeSession.restored(data, Gives(), 0.0)
    assert isinstance(back.mapping, Gives) and back.mapping.thing == ("restored", 1)


def test_a_state_of_another_layout_is_refused() -> None:
    fields = wire.unpack_state(Harness().s.snapshot(0.0), STATE_KINDS)
    fields["format"] = STATE_FORMAT + 1
    with pytest.raises(ValueError, match="another layout"):
        RealtimeSession.restored(wire.pack_state(fields, STATE_KINDS), EchoModel().realtime_mapping(), 0.0)


# -- the codec -----------------------------------------------------------------------
class Colour(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class Point:
    xy: np.ndarray
    name: str


def test_the_state_codec_keeps_types_and_builds_only_the_classes_named() -> None:
    kinds = wire.StateKinds([Colour, Point])
    state = {
        "list": [1, 2.5, None, True, b"raw", "text"],
        "tuple": (1, (2, 3)),
        "ordered": OrderedDict([("b", 1), ("a", {"nested": [Colour.RED]})]),
        "deque": deque([(0, 1280)], maxlen=4),
        "array": np.arange(6, dtype="<i2").reshape(2, 3),
        "view": np.arange(6, dtype="<i2").reshape(2, 3).T,  # not contiguous
        "0-d": np.array(7, dtype="<i4"),
        "scalar": np.float32(0.25),
        "keys": {3: "int key", ("t", 1): "tuple key"},
        "point": Point(np.zeros(2), "p"),
    }
    back = wire.unpack_state(wire.pack_state(state, kinds), kinds)
    assert type(back["tuple"]) is tuple and back["tuple"] == (1, (2, 3))
    assert type(back["ordered"]) is OrderedDict and list(back["ordered"]) == ["b", "a"]
    assert back["ordered"]["a"]["nested"] == [Colour.RED]
    assert back["deque"] == deque([(0, 1280)]) and back["deque"].maxlen == 4
    assert back["array"].dtype == np.dtype("<i2") and back["array"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["view"].tolist() == [[0, 3], [1, 4], [2, 5]]
    assert back["0-d"].shape == () and back["0-d"] == 7
    assert back["scalar"] == np.float32(0.25) and back["scalar"].dtype == np.float32
    assert back["keys"] == {3: "int key", ("t", 1): "tuple key"}
    assert isinstance(back["point"], Point) and back["point"].name == "p"
    assert back["list"] == state["list"]
    with pytest.raises(TypeError, match="not data"):
        wire.pack_state({"x": object()}, kinds)
    # A reader that does not name a class builds none of it: an error, not an object.
    with pytest.raises(ProtocolError):
        wire.unpack_state(wire.pack_state(Point(np.zeros(1), "q"), kinds), wire.StateKinds([Colour]))
    with pytest.raises(ProtocolError):
        wire.unpack_state(b"\xc1", kinds)


# -- the token -----------------------------------------------------------------------
def test_the_resume_token_names_the_call_and_nothing_else_passes_for_one() -> None:
    cid = "0193a5b2c3d4e5f6a7b8c9d0"
    token = resume_token(cid, "s3cr3t_-x")
    assert token_cid(token) == cid
    for bad in ("nope", cid, f"{cid}.", f"{cid[:-1]}.x", f"{cid.upper()}.x", "", f".{cid}"):
        assert token_cid(bad) is None, bad


# -- the call's input and relay --------------------------------------------------------
def echo_input() -> CallInput:
    model = EchoModel()
    return CallInput(model, {"audio_in": None}, 10**9, 0.0)


def pcm(samples: np.ndarray) -> ClientInput:
    return ClientInput(files=[ClientFile("a.pcm", samples.astype("<i2").tobytes())])


def test_a_moved_call_input_goes_on_with_the_next_seq_and_the_samples_short_of_an_item() -> None:
    """An item and a half sent here: the move takes the half item along, and the next append
    there makes item 1 of exactly that half and the new samples, as it would have here."""
    audio = tone(3 * FRAME / 16000, 16000)
    here = echo_input()
    first = here.accept(pcm(audio[: FRAME + FRAME // 2]), opening=False, end=None, now=0.0)
    assert [seq for _, seq, _ in first.items] == [0]
    call = RelayedCall("c" * 24, "rt-x", here, Outbox(lambda _: None), True, request_id_revision=7, moves=1)
    call.relay.accept("Talker", 0, b"{}", 0.0)
    call.relay.read(41)
    move = moves.hand_over(call, "frontend-a", b"state", 2.5)
    assert (move.moves, move.request_id, move.request_id_revision, move.age_s) == (2, "rt-x", 7, 2.5)
    assert (move.next_out, move.read_to, move.published) == ({"Talker": 1}, 41, {"audio_in": 1})
    # Through the wire, as the other frontend gets it.
    move = wire.decode_as(wire.encode(move), wire.RealtimeMove)
    there = echo_input()
    taken = moves.take_over(there, move)
    assert (taken.request_id, taken.request_id_revision, taken.moves) == ("rt-x", 7, 2)
    assert (taken.relay.next_out, taken.relay.read_to) == ({"Talker": 1}, 41)
    nxt = there.accept(pcm(audio[FRAME + FRAME // 2 :]), opening=False, end=None, now=1.0)
    assert [seq for _, seq, _ in nxt.items] == [1, 2]
    sent = np.concatenate([item.data for _, _, item in first.items + nxt.items if item.data is not None])
    assert np.array_equal(sent, audio)
    assert there.state is InputState.OPEN and there.published == {"audio_in": 3}


def test_a_move_that_does_not_fit_the_model_is_refused_before_anything_is_taken() -> None:
    there = echo_input()
    with pytest.raises(ValueError, match="not model"):
        moves.take_over(there, wire.RealtimeMove(ok=True, model="echo", published={"video_in": 3}))
    long = wire.Tensor.from_array(np.zeros(FRAME, np.int16))
    with pytest.raises(ValueError, match="short of an item"):
        moves.take_over(there, wire.RealtimeMove(ok=True, model="echo", remainders={"audio_in": long}))
    assert there.published == {"audio_in": 0} and there.framers["audio_in"].pending == 0


def test_a_relay_holding_outputs_ahead_of_a_gap_hands_over_a_read_from_the_start() -> None:
    relay = OutputRelay()
    relay.accept("P", 0, b"a", 0.0)
    relay.read(10)
    assert relay.hand_over() == ({"P": 1}, 10)
    relay.accept("P", 2, b"c", 0.0)  # 1 is missing: 2 is held, and not handed over
    assert relay.hand_over() == ({"P": 1}, 0)
    taken = OutputRelay.taken_over({"P": 1}, 0)
    assert taken.accept("P", 1, b"b", 0.0) == [b"b"] and taken.accept("P", 1, b"b", 0.0) == []


def test_a_call_that_moved_in_counts_in_its_sockets_share_even_past_the_cap() -> None:
    shares = Shares(per_socket=1, per_token=1)
    share = shares.client("tok", socket=True)
    share.take()
    ended = moved_in(share)
    assert ended is not None and share.held == 2 and shares.by_token == {"tok": 2}
    call = RelayedCall("c" * 24, None, echo_input(), Outbox(lambda _: None), True)
    ended(call)
    ended(call)  # given back once
    assert share.held == 1 and shares.by_token == {"tok": 1}
    assert moved_in(None) is None


def test_sent_audio_of_a_let_go_at_the_models_rate_is_nothing() -> None:
    h = Harness()
    h.send(MANUAL_16K)
    assert not [a for a in h.s.let_go().actions if isinstance(a, SendAudio)]
