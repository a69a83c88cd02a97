"""`duplexbus eval`'s pure core and translators, with hand-made inputs (no sockets)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pybase64
import pytest

from clients.eval.core import (
    Bounds,
    Drain,
    Event,
    Failure,
    Kind,
    Progress,
    Stage,
    Timeline,
    Verdict,
    decide,
    figures,
)
from clients.eval.metrics import echo_exact, word_error_rate
from clients.eval.protocols import COMMIT_EMPTY, GenerateWS, Realtime
from clients.eval.runner import Sample, schedule

TRANSPORT = [Failure.STALL, Failure.CLOSED]


@pytest.mark.parametrize("failure", TRANSPORT)
@pytest.mark.parametrize("stage", [Stage.CONNECT, Stage.HANDSHAKE, Stage.INPUT, Stage.COMMIT, Stage.DRAIN, Stage.CLOSE])
def test_a_transport_failure_is_retried_once(stage: Stage, failure: Failure) -> None:
    assert decide(stage, failure, reply_completed=False, retries=0) is Verdict.RETRY
    assert decide(stage, failure, reply_completed=False, retries=1) is Verdict.FAIL


@pytest.mark.parametrize("stage", list(Stage)[:-1])
def test_a_server_error_or_a_client_bug_is_never_retried(stage: Stage) -> None:
    for completed in (False, True):
        assert decide(stage, Failure.SERVER_ERROR, completed, retries=0) is Verdict.FAIL
        assert decide(stage, Failure.CLIENT_ERROR, completed, retries=0) is Verdict.FAIL


@pytest.mark.parametrize("failure", TRANSPORT)
def test_a_close_that_stalls_after_a_completed_reply_is_completed_not_retried(failure: Failure) -> None:
    assert decide(Stage.CLOSE, failure, reply_completed=True, retries=0) is Verdict.COMPLETED
    assert decide(Stage.CLOSE, failure, reply_completed=True, retries=1) is Verdict.COMPLETED


@pytest.mark.parametrize("stage", [Stage.INPUT, Stage.COMMIT])
def test_an_input_or_commit_stall_under_a_completed_reply_is_still_retried(stage: Stage) -> None:
    assert decide(stage, Failure.STALL, reply_completed=True, retries=0) is Verdict.RETRY
    assert decide(stage, Failure.STALL, reply_completed=True, retries=1) is Verdict.FAIL


def test_the_outer_close_wait_outlasts_the_inner_one() -> None:
    inner, outer = Bounds(close_s=3.0, close_grace_s=1.5).close_bounds()
    assert (inner, outer) == (3.0, 4.5)
    assert Bounds().input_bound(12.0) == 12.0 + Bounds().input_slack_s


def test_stages_go_in_order_only() -> None:
    p = Progress()
    p.to(Stage.HANDSHAKE)
    with pytest.raises(RuntimeError, match="handshake -> drain"):
        p.to(Stage.DRAIN)


def ev(kind: Kind, **kw: object) -> Event:
    return Event(kind, kind.value, **kw)  # type: ignore[arg-type]


def test_listen_acks_never_hold_the_drain_open() -> None:
    d = Drain(quiet_s=1.0)
    d.end_of_input(10.0)
    for t in (10.2, 10.5, 10.9, 11.3):  # the model acknowledges every padding append
        d.on_event(ev(Kind.LISTEN), t)
        d.on_event(ev(Kind.TRANSCRIPT), t)
    assert not d.drained(10.99)
    assert d.drained(11.0)  # a quiet window after the end of input: listening only
    assert d.wake_at() == 11.0


def test_reply_activity_restarts_the_quiet_window_and_an_open_reply_holds_it() -> None:
    d = Drain(quiet_s=1.0)
    d.on_event(ev(Kind.REPLY_AUDIO), 5.0)  # before the end of input: nothing drains yet
    assert not d.drained(100.0)
    d.end_of_input(10.0)
    d.on_event(ev(Kind.REPLY_START), 10.5)
    d.on_event(ev(Kind.REPLY_AUDIO), 11.0)
    assert not d.drained(30.0) and d.wake_at() is None  # a response is open: only an event can end it
    d.on_event(ev(Kind.REPLY_END), 12.0)
    assert d.reply_completed
    assert not d.drained(12.9)
    assert d.drained(13.0)


def test_the_end_of_the_call_drains_at_once() -> None:
    d = Drain(quiet_s=5.0)
    d.end_of_input(1.0)
    d.on_event(ev(Kind.REPLY_START), 1.1)
    d.on_event(ev(Kind.TERMINAL), 1.2)
    assert d.drained(1.2) and d.reply_completed


def test_reply_audio_alone_is_not_a_completed_reply() -> None:
    d = Drain(quiet_s=1.0)
    d.end_of_input(0.0)
    d.on_event(ev(Kind.REPLY_AUDIO), 0.5)
    assert d.drained(2.0) and not d.reply_completed


def test_figures_count_from_the_end_of_input() -> None:
    t = Timeline(opened=0.0)
    t.input_ended = 2.0
    chunk = bytes(2 * 1600)  # 100 ms at 16 kHz
    for at in (1.0, 2.5, 2.6, 2.9):
        t.on_event(ev(Kind.REPLY_AUDIO, audio=chunk, rate=16000), at)
    t.on_event(ev(Kind.REPLY_END), 3.0)
    f = figures(t)
    assert f.ttfa_s == pytest.approx(0.5)
    assert f.reply_latency_s == pytest.approx(1.0)
    assert f.reply_audio_s == pytest.approx(0.4)
    assert f.rtf == pytest.approx(1.9 / 0.4)
    assert f.gaps_s == pytest.approx([1.5, 0.1, 0.3])


def test_turn_figures_count_from_the_models_turn_decision() -> None:
    """The turn's latency: end of speech to the decision (the model's `speak` says it: `at -
    end_at`), the decision to the final transcript, end of speech to the first reply audio
    after the decision; from a realtime server, speech_stopped is the decision and
    duplexbus's response.done usage gives the end of speech."""
    p = GenerateWS(16000)
    t = Timeline(opened=0.0)
    chunk: dict[str, Any] = {"output": {"type": "audio", "audio": "AAA=", "sample_rate": 22050}}
    steps: list[tuple[dict[str, Any], float]] = [
        ({"output": {"type": "speak", "turn": 1, "at": 1.8, "end_at": 1.26}}, 5.0),
        ({"output": {"type": "transcript", "text": "hi", "final": True}}, 5.15),
        (chunk, 5.4),
        (chunk, 5.5),
    ]
    for msg, at in steps:
        for e in p.classify(json.dumps(msg)):
            t.on_event(e, at)
    f = figures(t)
    assert (f.end_of_turn_s, f.transcript_s, f.first_audio_s) == pytest.approx((0.54, 0.15, 0.94))
    assert t.listen_acks == 1  # the decision acknowledges input, as before
    r = Realtime(24000, model="m")
    t = Timeline(opened=0.0)
    steps = [
        ({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 1800}, 5.0),
        ({"type": "response.output_audio.delta", "delta": "AAA="}, 5.3),
        ({"type": "response.done", "response": {"status": "completed", "usage": {"latency_ms": {"end_of_turn": 540}}}}, 6.0),
    ]
    for msg, at in steps:
        for e in r.classify(json.dumps(msg)):
            t.on_event(e, at)
    f = figures(t)
    assert (f.end_of_turn_s, f.transcript_s, f.first_audio_s) == pytest.approx((0.54, None, 0.84))
    assert figures(Timeline(opened=0.0)).first_audio_s is None  # no turn decided: none


def test_a_clip_goes_in_appends_sent_when_their_audio_has_been_recorded() -> None:
    pcm = np.arange(16000 + 800, dtype="<i2")
    plan = schedule(Sample("s", pcm, 16000), append_ms=80)
    assert [len(b) // 2 for _, b in plan] == [1280] * 13 + [160]
    assert plan[0][0] == pytest.approx(0.08) and plan[-1][0] == pytest.approx(1.05)
    assert b"".join(b for _, b in plan) == pcm.tobytes()


def test_generate_ws_outputs_are_reply_or_acknowledgement() -> None:
    p = GenerateWS(16000)
    audio = np.arange(10, dtype="<i2")

    def one(msg: dict[str, object]) -> Event:
        [e] = p.classify(json.dumps(msg))
        return e

    a = one({"output": {"frame": 0, "audio": pybase64.b64encode(audio.tobytes()).decode(), "rms": 1.0}})
    assert a.kind is Kind.REPLY_AUDIO and a.audio == audio.tobytes() and a.rate == 16000
    assert one({"output": {"type": "audio", "audio": "AAA=", "sample_rate": 22050}}).rate == 22050
    assert one({"output": {"type": "listen", "turn": 1}}).kind is Kind.LISTEN
    assert one({"output": {"type": "transcript", "text": "hi", "final": False}}).kind is Kind.LISTEN
    assert one({"output": {"type": "transcript", "text": "hi", "final": True}}).kind is Kind.TRANSCRIPT
    assert one({"output": {"type": "reply", "text": "You said: hi."}}).kind is Kind.REPLY_START
    assert one({"output": {"type": "reply_end"}}).kind is Kind.REPLY_END
    assert one({"output": {"type": "barge_in"}}).kind is Kind.REPLY_END
    fin = one({"request_id": "r", "finish": {"reason": "completed", "call_id": "c1"}})
    assert fin.kind is Kind.TERMINAL and p.call_id == "c1"
    err = one({"request_id": "r", "error": "bad", "status": 400})
    assert err.kind is Kind.ERROR and err.code == "400"
    assert one({"request_id": "r", "append": True, "error": "x", "status": 409}).name == "append_error"
    assert p.classify("not json")[0].kind is Kind.ERROR


def test_realtime_events_by_their_ga_and_beta_names() -> None:
    p = Realtime(24000, model="m")
    assert p.url("ws://h/v1/realtime") == "ws://h/v1/realtime?model=m"
    kinds = {
        "response.created": Kind.REPLY_START,
        "response.output_audio.delta": Kind.REPLY_AUDIO,
        "response.audio.delta": Kind.REPLY_AUDIO,
        "response.output_audio_transcript.delta": Kind.REPLY_TEXT,
        "response.text.delta": Kind.REPLY_TEXT,
        "response.done": Kind.REPLY_END,
        "input_audio_buffer.speech_started": Kind.LISTEN,
        "input_audio_buffer.committed": Kind.COMMITTED,
        "conversation.item.added": Kind.LISTEN,
        "conversation.item.input_audio_transcription.completed": Kind.TRANSCRIPT,
        "session.updated": Kind.SESSION,
        "rate_limits.updated": Kind.OTHER,
        "error": Kind.ERROR,
    }
    for name, kind in kinds.items():
        [e] = p.classify(json.dumps({"type": name, "delta": "AAA=", "response": {"status": "completed"}}))
        assert e.kind is kind, name
    failed = p.classify(json.dumps({"type": "response.done", "response": {"status": "failed"}}))[0]
    assert failed.failed
    [empty] = p.classify(json.dumps({"type": "error", "error": {"type": "invalid_request_error", "code": COMMIT_EMPTY}}))
    assert p.commit_redundant(empty)
    p.classify(json.dumps({"type": "session.updated", "session": {"audio": {"output": {"format": {"rate": 16000}}}}}))
    assert p.out_rate == 16000  # the rate the server says it sends wins
    p.classify(json.dumps({"type": "session.updated", "session": {"audio": {"output": {"format": {"sample_rate_hz": 22050}}}}}))
    assert p.out_rate == 22050


def test_realtime_session_declares_the_clip_rate_and_turn_detection() -> None:
    sess = Realtime(16000, turn_detection=None).session()
    assert sess["audio"]["input"] == {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}
    vad = Realtime(8000, turn_detection="server_vad")
    assert vad.session()["audio"]["input"]["turn_detection"] == {"type": "server_vad"}
    assert vad.end_input() == [] and not vad.commit_acked  # the server's turn-taking commits, not the client
    assert Realtime(8000).commit_acked
    msgs = [json.loads(m) for m in Realtime(16000, response_create=True).end_input()]
    assert [m["type"] for m in msgs] == ["input_audio_buffer.commit", "response.create"]
    assert len({m["event_id"] for m in msgs}) == 2


def test_word_error_rate_and_echo_identity() -> None:
    assert word_error_rate(["a b c d"], ["a x c"]) == (0.5, 2, 4)
    assert word_error_rate(["You said: It's ON."], ["you said it's on"])[0] == 0.0
    assert word_error_rate(["", "a b"], ["x", "a b"]) == (0.0, 0, 2)  # no words, no rate
    sent = np.arange(1, 100, dtype="<i2")
    assert echo_exact(sent, np.concatenate([sent, np.zeros(28, "<i2")]))
    assert not echo_exact(sent, sent[:-1])
    assert not echo_exact(sent, np.concatenate([sent, np.ones(1, "<i2")]))
    flipped = sent.copy()
    flipped[50] += 1
    assert not echo_exact(sent, flipped)


@pytest.mark.parametrize("ms", ["79", "101", "20", "0", "80.5"])
def test_append_ms_outside_80_to_100_is_a_command_line_error(ms: str, capsys: pytest.CaptureFixture[str]) -> None:
    from duplexbus.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["eval", "--synthesize", "1", "--append-ms", ms])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--append-ms" in err and ("80-100 ms" in err or "whole number" in err)


@pytest.mark.parametrize("ms", [80, 90, 100])
def test_append_ms_within_80_to_100_is_taken(ms: int) -> None:
    from duplexbus.cli import build_parser

    assert build_parser().parse_args(["eval", "--synthesize", "1", "--append-ms", str(ms)]).append_ms == ms
