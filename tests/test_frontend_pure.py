"""The frontend's pure parts, without NATS: protocol.parse_message and calls.CallInput."""

from __future__ import annotations

import base64
import io
import json
import random
import wave
from collections.abc import Callable

import numpy as np
import pytest

from models.echo import FRAME, EchoModel
from services.frontend.calls import CallInput, InputState, Prepared
from services.frontend.protocol import AbortCall, Append, EndInput, Opening, ParseError, parse_message
from shared.runtime.errors import BadRequest, LimitExceeded
from shared.sdk import audio
from shared.sdk.audio import Framer, _read_wav_module, encode_wav, read_wav
from shared.sdk.model import ClientFile, ClientInput
from tests.protocol_model import AUX_FRAME, DuoModel


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def parse(msg: object) -> object:
    return parse_message(json.dumps(msg))


def pcm(samples: np.ndarray, name: str = "a.pcm", stream: str | None = None) -> ClientInput:
    return ClientInput(files=[ClientFile(name, np.asarray(samples, dtype="<i2").tobytes(), stream)])


# -- parse_message -------------------------------------------------------------
def test_opening_append_end_abort_shapes() -> None:
    data = b64(b"\x01\x00\x02\x00")
    o = parse({"request_id": "r1", "model": "echo", "files": [{"name": "a.pcm", "data": data}], "model_kwargs": {"k": 1}})
    assert isinstance(o, Opening) and o.request_id == "r1" and o.model == "echo" and o.end_input is None
    assert o.input.files[0].data == b"\x01\x00\x02\x00" and o.input.model_kwargs == {"k": 1}

    a = parse({"request_id": "r1", "append": [{"name": "a.pcm", "data": data, "stream": "audio_in"}]})
    assert isinstance(a, Append) and a.input.files[0].stream == "audio_in"  # the shorthand: a list of files
    a = parse({"request_id": "r1", "append": {"text": "hi", "files": []}, "end_input": ["audio_in"]})
    assert isinstance(a, Append) and a.input.text == "hi" and a.end_input == ["audio_in"]

    e = parse({"request_id": "r1", "end_input": True})
    assert isinstance(e, EndInput) and e.end_input is True
    e = parse({"request_id": "r1", "end_input": ["a", "b", "a"]})
    assert isinstance(e, EndInput) and e.end_input == ["a", "b"]
    assert isinstance(parse({"request_id": "r1", "abort": True}), AbortCall)


def test_null_fields_count_as_absent() -> None:
    o = parse({"request_id": "r", "model": None, "text": None, "files": None, "model_kwargs": None, "end_input": None})
    assert isinstance(o, Opening) and o.model is None and o.input == ClientInput() and o.end_input is None
    a = parse(
        {
            "request_id": "r",
            "append": {"text": None, "files": [{"name": "a.pcm", "data": "AAA=", "stream": None}], "model_kwargs": None},
            "end_input": None,
        }
    )
    assert isinstance(a, Append) and a.input.files[0].stream is None and a.end_input is None
    # "append": null is no append: what is left is an opening
    assert isinstance(parse({"request_id": "r", "append": None}), Opening)
    assert isinstance(parse({"request_id": "r", "abort": None}), Opening)
    assert isinstance(parse({"request_id": "r", "end_input": False}), ParseError)  # end alone must end something


@pytest.mark.parametrize("rid", ["a.b", "a*", "a>", "a b", "é", "", "x" * 65, "a/b", "a\n"])
def test_request_id_must_be_a_subject_token(rid: str) -> None:
    for msg in ({"request_id": rid}, {"request_id": rid, "end_input": True, "files": []}):
        p = parse(msg)
        assert isinstance(p, ParseError) and p.kind == "opening" and p.error.status == 400
        assert "[A-Za-z0-9_-]" in p.error.message and p.request_id == rid  # echoed for the reply
    p = parse({"request_id": rid, "append": []})
    assert isinstance(p, ParseError) and p.append and p.request_id == rid


def test_valid_request_ids() -> None:
    for rid in ["a", "A-z_09", "x" * 64]:
        assert isinstance(parse({"request_id": rid}), Opening)


def test_live_opening_needs_a_request_id_one_shot_does_not() -> None:
    p = parse({"text": "hi"})
    assert isinstance(p, ParseError) and "needs a request_id" in p.error.message and p.request_id is None
    assert isinstance(parse({"files": [], "end_input": True}), Opening)
    # With a list, whether streams stay open depends on the model: the service decides.
    assert isinstance(parse({"files": [], "end_input": ["audio_in"]}), Opening)


@pytest.mark.parametrize(
    ("msg", "kind", "words"),
    [
        ("not json", None, "not JSON"),
        ("[1, 2]", None, "JSON object"),
        ('"text"', None, "JSON object"),
        ('{"request_id": 5}', "opening", "request_id must be a string"),
        ('{"request_id": "r", "text": 5}', "opening", "text must be a string"),
        ('{"request_id": "r", "model": 1}', "opening", "model must be a string"),
        ('{"request_id": "r", "files": {}}', "opening", "files must be a list"),
        ('{"request_id": "r", "files": [{"name": "a.pcm", "data": "@@"}]}', "opening", "not valid base64"),
        ('{"request_id": "r", "files": [{"data": "AA=="}]}', "opening", "files[0].name"),
        ('{"request_id": "r", "files": [{"name": "a", "data": "AA==", "x": 1}]}', "opening", "unknown field"),
        ('{"request_id": "r", "model_kwargs": []}', "opening", "model_kwargs must be an object"),
        ('{"request_id": "r", "bogus": 1}', "opening", "unknown field(s) ['bogus']"),
        ('{"request_id": "r", "end_input": "yes"}', "end", "end_input must be true or"),
        ('{"request_id": "r", "end_input": []}', "end", "end_input must be true or"),
        ('{"request_id": "r", "append": 5}', "append", "append must be an object or a list"),
        ('{"request_id": "r", "append": {"bogus": 1}}', "append", "unknown field"),
        ('{"append": []}', "append", "request_id is required"),
        ('{"request_id": "r", "abort": 1}', "abort", "abort must be true"),
        ('{"request_id": "r", "abort": true, "text": "x"}', "abort", "unknown field"),
    ],
)
def test_malformed_messages_name_the_problem(msg: str, kind: str | None, words: str) -> None:
    p = parse_message(msg)
    assert isinstance(p, ParseError), p
    assert p.kind == kind and p.error.status == 400 and words in p.error.message, p.error.message


def test_message_over_max_bytes_names_max_message_mb() -> None:
    text = json.dumps({"request_id": "big", "append": [{"name": "a.pcm", "data": "A" * 2000}]})
    p = parse_message(text, max_bytes=1000)
    assert isinstance(p, ParseError) and isinstance(p.error, LimitExceeded)
    assert p.error.limit == "max_message_mb" and p.request_id == "big" and p.kind == "append"
    p = parse_message("x" * 2000, max_bytes=1000)  # not JSON either: still the size is what is reported
    assert isinstance(p, ParseError) and "max_message_mb" in p.error.message and p.request_id is None
    assert isinstance(parse_message("é" * 400, max_bytes=1000), ParseError)  # counted in bytes, not characters
    assert isinstance(parse_message(text, max_bytes=len(text)), Append)


def test_bytes_are_parsed_as_utf8_json() -> None:
    assert isinstance(parse_message(b'{"request_id": "r"}'), Opening)
    p = parse_message(b"\xff\xfe")
    assert isinstance(p, ParseError) and "not JSON" in p.error.message


# -- CallInput -----------------------------------------------------------------
def echo_input(max_items: int | None = None, max_bytes: int = 1 << 30) -> CallInput:
    return CallInput(EchoModel(), {"audio_in": max_items}, max_bytes, now=0.0)


def items_of(p: Prepared) -> list[np.ndarray]:
    data = []
    for _, _, item in p.items:
        assert item.data is not None  # an audio item always carries its samples
        data.append(item.data)
    return data


def test_framing_carries_the_remainder_across_appends_of_any_size() -> None:
    rng = random.Random(5)
    ci = echo_input()
    sizes = [1, 1279, 1, 2560, 7, 5000, 1280, 3, 40000, 639, 641]
    samples = np.array([rng.randint(-32768, 32767) for _ in range(sum(sizes))], dtype="<i2")
    got: list[np.ndarray] = []
    seqs: list[int] = []
    pos = 0
    for n in sizes:
        p = ci.accept(pcm(samples[pos : pos + n]), opening=False, end=None, now=1.0)
        pos += n
        assert all(len(x) == FRAME for x in items_of(p))
        got += items_of(p)
        seqs += [seq for _, seq, _ in p.items]
        assert ci.published["audio_in"] == pos // FRAME  # only whole items are published
    assert seqs == list(range(len(seqs)))
    assert np.concatenate(got).tobytes() == samples[: len(got) * FRAME].tobytes()


def test_flush_pads_the_remainder_at_end_of_input() -> None:
    ci = echo_input()
    samples = np.arange(1, 3001, dtype="<i2")
    p = ci.accept(pcm(samples), opening=True, end=None, now=0.0)
    assert len(p.items) == 2 and ci.state is InputState.OPEN
    p = ci.end_input(True, now=1.0)
    assert p.ended == {"audio_in": 3} and len(p.items) == 1 and p.items[0][1] == 2
    last = items_of(p)[0]
    assert len(last) == FRAME and last[:440].tolist() == list(range(2561, 3001)) and not last[440:].any()
    # mypy keeps ci.state narrowed to OPEN by the assert above across end_input(), which changes it.
    assert ci.state is InputState.INPUT_ENDED  # type: ignore[comparison-overlap]
    # A stream ending on a whole item gets no padding item.
    ci = echo_input()
    p = ci.accept(pcm(np.ones(2 * FRAME)), opening=True, end=True, now=0.0)
    assert len(p.items) == 2 and p.ended == {"audio_in": 2}


def test_limits_are_checked_before_commit() -> None:
    ci = echo_input(max_items=3)
    ci.accept(pcm(np.ones(FRAME + 100)), opening=False, end=None, now=0.0)
    before = (dict(ci.published), ci.framers["audio_in"].pending, ci.input_bytes)
    with pytest.raises(LimitExceeded) as e:
        ci.accept(pcm(np.ones(3 * FRAME)), opening=False, end=None, now=1.0)  # would make 4 items
    assert e.value.limit == "client_streams.audio_in.max_items" and "items of 1280 samples" in e.value.message
    assert (dict(ci.published), ci.framers["audio_in"].pending, ci.input_bytes) == before
    # The flush at end of input is an item too, and is bounded like any.
    ci.accept(pcm(np.ones(2 * FRAME - 100)), opening=False, end=None, now=2.0)
    assert ci.published["audio_in"] == 3 and ci.framers["audio_in"].pending == 0
    ci.accept(pcm(np.ones(5)), opening=False, end=None, now=3.0)
    with pytest.raises(LimitExceeded):
        ci.end_input(True, now=4.0)
    assert ci.state is InputState.OPEN and ci.framers["audio_in"].pending == 5

    ci = echo_input(max_bytes=10_000)
    ci.accept(pcm(np.ones(2000)), opening=False, end=None, now=0.0)  # 4,000 bytes
    ci.accept(pcm(np.ones(2000)), opening=False, end=None, now=0.0)  # 8,000: the budget is the call's lifetime
    with pytest.raises(LimitExceeded) as e:
        ci.accept(pcm(np.ones(1001)), opening=False, end=None, now=0.0)  # 10,002
    assert e.value.limit == "max_call_input_mb" and ci.input_bytes == 8000 and ci.framers["audio_in"].pending == 160
    ci.accept(pcm(np.ones(1000)), opening=False, end=None, now=0.0)  # exactly the budget
    assert ci.input_bytes == 10_000


def test_wav_files_are_charged_by_their_bytes_and_checked() -> None:
    ci = echo_input()
    wav = encode_wav(np.ones(FRAME, dtype="<i2"), 16000)
    p = ci.accept(ClientInput(files=[ClientFile("a.wav", wav)]), opening=False, end=None, now=0.0)
    assert len(p.items) == 1 and ci.input_bytes == len(wav)
    with pytest.raises(BadRequest, match="16000 Hz"):
        ci.accept(ClientInput(files=[ClientFile("b.wav", encode_wav(np.ones(10), 8000))]), False, None, 0.0)
    with pytest.raises(BadRequest, match="not a WAV"):
        ci.accept(ClientInput(files=[ClientFile("b.wav", b"junk")]), False, None, 0.0)
    with pytest.raises(BadRequest, match="even byte count"):
        ci.accept(ClientInput(files=[ClientFile("b.pcm", b"abc")]), False, None, 0.0)


def test_appends_that_produce_nothing_are_refused() -> None:
    ci = echo_input()
    with pytest.raises(BadRequest, match="no text stream"):
        ci.accept(ClientInput(text="hello"), opening=False, end=None, now=0.0)
    with pytest.raises(BadRequest, match="no text stream"):
        ci.accept(ClientInput(text="hello"), opening=False, end=True, now=0.0)
    with pytest.raises(BadRequest, match="needs text or files"):
        ci.accept(ClientInput(), opening=False, end=None, now=0.0)
    with pytest.raises(BadRequest, match="unknown stream 'nope'"):
        ci.accept(pcm(np.ones(10), stream="nope"), opening=False, end=None, now=0.0)
    with pytest.raises(BadRequest, match=r"unknown stream\(s\) \['nope'\] in end_input"):
        ci.end_input(["nope"], now=0.0)
    assert ci.state is InputState.OPEN and ci.published == {"audio_in": 0}
    # An empty opening is fine: a live call may start with nothing.
    assert ci.accept(ClientInput(), opening=True, end=None, now=0.0).items == []


def duo_input(max_bytes: int = 1 << 30) -> CallInput:
    m = DuoModel()
    limits = {e: c.limits.max_items for e, c in m.client_edges().items() if c.limits}
    return CallInput(m, limits, max_bytes, now=0.0)


def test_late_streams_are_neither_charged_nor_sent() -> None:
    ci = duo_input(max_bytes=5000)
    p = ci.accept(ClientInput(text="a"), opening=True, end=["text_in"], now=0.0)
    assert [(e, s, i.meta) for e, s, i in p.items] == [("text_in", 0, {"text": "a"})] and p.ended == {"text_in": 1}
    p = ci.accept(ClientInput(text="b"), opening=False, end=None, now=1.0)
    assert p.late == ["text_in"] and p.items == [] and ci.published["text_in"] == 1
    p = ci.end_input(["aux_in"], now=1.0)
    assert p.ended == {"aux_in": 0}
    aux = pcm(np.ones(2000), stream="aux_in")  # 4,000 bytes to an ended stream: not charged
    for _ in range(3):
        p = ci.accept(aux, opening=False, end=None, now=2.0)
        assert p.late == ["aux_in"] and p.items == []
    assert ci.input_bytes == 0
    mixed = ClientInput(files=[*aux.files, ClientFile("b.pcm", np.ones(2000, "<i2").tobytes(), "audio_in")])
    p = ci.accept(mixed, opening=False, end=None, now=3.0)
    assert p.late == ["aux_in"] and ci.input_bytes == 4000 and {e for e, _, _ in p.items} == {"audio_in"}
    p = ci.end_input(["aux_in", "audio_in"], now=4.0)
    assert p.already_ended == ["aux_in"] and p.ended == {"audio_in": 2} and ci.state is InputState.INPUT_ENDED
    with pytest.raises(BadRequest, match="input has ended"):
        ci.accept(ClientInput(text="c"), opening=False, end=None, now=5.0)


def test_model_bounds_in_model_units() -> None:
    ci = duo_input()
    ci.accept(pcm(np.ones(40 * AUX_FRAME), stream="aux_in"), opening=False, end=None, now=0.0)
    with pytest.raises(LimitExceeded, match=r"client_streams\.aux_in\.max_items.*items of 160 samples"):
        ci.accept(pcm(np.ones(1), stream="aux_in"), opening=False, end=["aux_in"], now=0.0)
    for t in "abcd":
        ci.accept(ClientInput(text=t), opening=False, end=None, now=0.0)
    with pytest.raises(LimitExceeded, match=r"client_streams\.text_in\.max_items"):
        ci.accept(ClientInput(text="e"), opening=False, end=None, now=0.0)
    with pytest.raises(BadRequest, match="names no stream"):  # two audio streams: a file must name one
        ci.accept(pcm(np.ones(10)), opening=False, end=None, now=0.0)


def test_idle_clock_runs_only_while_input_is_open() -> None:
    ci = echo_input()
    assert ci.idle_for(5.0) == 5.0
    ci.accept(pcm(np.ones(10)), opening=False, end=None, now=4.0)
    assert ci.idle_for(5.0) == 1.0
    ci.end_input(True, now=6.0)
    assert ci.idle_for(100.0) == 0.0


def test_framer_items_take_the_stream_dtype_with_or_without_a_remainder() -> None:
    f = Framer(4)
    first = f.push(np.arange(4, dtype=np.int32))  # no remainder carried: still cast
    second = f.push(np.arange(6, dtype=np.int32))
    third = f.push(np.arange(2, dtype=np.int32))  # completes an item from the remainder
    assert [x.dtype for x in first + second + third] == [np.dtype("<i2")] * 3


def _same(a: object, b: object) -> bool:
    """Parse results equal, errors by type, text and fields (exceptions compare by identity)."""
    if isinstance(a, ParseError) and isinstance(b, ParseError):
        return (type(a.error), str(a.error), a.request_id, a.kind) == (type(b.error), str(b.error), b.request_id, b.kind)
    return a == b


B64 = base64.b64encode(np.arange(8, dtype="<i2").tobytes()).decode()
FAST_OR_NOT = [
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64}]}, True),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64, "stream": "aux_in"}, {"name": "b.pcm", "data": ""}]}, True),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64, "stream": None}]}, True),
    ({"request_id": "r1", "append": []}, False),
    ({"request_id": "r1", "append": [{"name": "", "data": B64}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64[:-1]}]}, False),  # bad padding
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64[:4] + "\n" + B64[4:]}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": "é" + B64}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64, "extra": 1}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64}], "end_input": True}, False),
    ({"request_id": "r1", "append": {"files": [{"name": "a.pcm", "data": B64}]}}, False),
    ({"request_id": "r 1", "append": [{"name": "a.pcm", "data": B64}]}, False),
    ({"request_id": None, "append": [{"name": "a.pcm", "data": B64}]}, False),
    ({"request_id": "r1", "append": [{"name": 3, "data": B64}]}, False),
    ({"request_id": "r1", "append": [{"name": "a.pcm", "data": B64}], "abort": True}, False),
]


@pytest.mark.parametrize(("msg", "fast"), FAST_OR_NOT)
def test_the_fast_append_path_reads_exactly_what_the_general_path_reads(msg: dict[str, object], fast: bool) -> None:
    """A plain audio append skips the general parser; anything else (refusals included) goes
    through it, so every answer is the general path's."""
    from services.frontend import protocol

    text = json.dumps(msg)
    assert (protocol._fast_append(text) is not None) is fast
    general = protocol._parse_text(text, None, False, False)
    assert _same(parse_message(text), general)
    assert _same(parse_message(text.encode()), general)
    if fast:
        assert isinstance(general, Append)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        '{"request_id": "r", "append": ' + "[" * 5000,
        '{"request_id": "r", "model_kwargs": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
        '{"request_id": "r", "append": ' + "[" * 3000 + "]" * 3000 + "}",
    ],
)
def test_json_nested_too_deeply_is_a_400(text: str) -> None:
    """msgspec raises RecursionError for these (not a DecodeError): a 400 all the same."""
    for one_shot in (False, True):
        p = parse_message(text, one_shot=one_shot)
        assert isinstance(p, ParseError) and p.error.status == 400 and "nested too deeply" in p.error.message


def test_model_kwargs_nest_at_most_32_deep() -> None:
    def nested(depth: int) -> dict[str, object]:
        d: dict[str, object] = {"leaf": [1, 2]}  # the list is one level more
        for _ in range(depth - 2):
            d = {"k": d}
        return d

    ok = parse({"request_id": "r", "model_kwargs": nested(32)})
    assert isinstance(ok, Opening)
    deep = parse({"request_id": "r", "model_kwargs": nested(33)})
    assert isinstance(deep, ParseError) and "model_kwargs nest deeper than 32 levels" in deep.error.message
    assert isinstance(parse({"request_id": "r", "append": {"model_kwargs": nested(40)}}), ParseError)


def _wav_variants() -> list[bytes]:
    """Canonical WAVs of several formats and lengths, and each with one header field or its
    length changed (what other writers make, and malformed files)."""
    rng = random.Random(7)
    out = []
    for channels, width, rate, frames in [
        (1, 2, 16000, 1280),
        (2, 2, 8000, 3),
        (1, 1, 16000, 5),
        (1, 3, 44100, 2),
        (1, 2, 16000, 0),
    ]:
        with io.BytesIO() as buf:
            with wave.open(buf, "wb") as w:
                w.setnchannels(channels)
                w.setsampwidth(width)
                w.setframerate(rate)
                w.writeframes(rng.randbytes(frames * channels * width))
            out.append(buf.getvalue())
    base = out[0]
    for at, size in [(4, 4), (16, 4), (20, 2), (22, 2), (24, 4), (34, 2), (40, 4)]:  # sizes, tag, channels, rate, bits
        for value in (0, 1, 17, 2 ** (8 * size) - 1):
            out.append(base[:at] + value.to_bytes(size, "little") + base[at + size :])
    for at in (0, 8, 12, 36):  # the chunk names
        out.append(base[:at] + b"LIST" + base[at + 4 :])
    n = int.from_bytes(base[40:44], "little")
    odd = base[:40] + (n - 1).to_bytes(4, "little") + base[44:-1]  # a data chunk of an odd size
    out += [base[:-1], base + b"\0", base[:43], odd, odd[:4] + (len(odd) - 8).to_bytes(4, "little") + odd[8:]]
    return out


def _read_either(read: Callable[[bytes], object], data: bytes) -> object:
    try:
        return read(data)
    except Exception as e:  # WAV_ERRORS, and what else the wave module raises on a malformed file
        return type(e), str(e)


def test_a_wav_reads_as_the_wave_module_reads_it_whatever_its_header() -> None:
    for data in _wav_variants():
        assert _read_either(read_wav, data) == _read_either(_read_wav_module, data), data[:44]


def test_a_canonical_wav_is_read_without_the_wave_module(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(data: bytes) -> object:
        raise AssertionError("read by the wave module")

    monkeypatch.setattr(audio, "_read_wav_module", refuse)
    samples = np.arange(-640, 640, dtype="<i2")
    assert np.array_equal(audio.decode_audio_file("mic.wav", encode_wav(samples, 16000), 16000), samples)
