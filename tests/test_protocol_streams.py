"""Rules that need more than one client stream, through the real services with the
test-only `duo` model (tests/protocol_model.py): end_input naming some streams, late
appends, and `max_items` in the model's units, declared by the model or lowered by the
serving config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tests.protocol_model import AUDIO_FRAME, AUX_FRAME, AUX_MAX, TEXT_MAX, DuoStack
from tests.support.audio import pcm_file
from tests.support.client import WS
from tests.support.stack import running_stack

AUDIO_MAX_LOWERED = 8  # the config lowers audio_in's bound of 100
MAX_INPUT_MB = 0.03  # 31,457 bytes a call
CONFIG = {
    "client_streams": {"audio_in": {"max_items": AUDIO_MAX_LOWERED}},
    "max_call_input_mb": MAX_INPUT_MB,
}


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[DuoStack]:
    async with running_stack(nats_url, CONFIG, cls=DuoStack) as s:
        assert isinstance(s, DuoStack)
        yield s


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype="<i2")


def outputs_by_stream(ws: WS, rid: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in ws.outputs(rid):
        out.setdefault(o["stream"], []).append(o)
    return out


async def placed(ws: WS, rid: str) -> None:
    """Until the call's first output: it runs on a worker. (A call aborted before its worker
    subscribed to it stays on that worker, which then takes 10 s to stop: the worker's
    catch-up read covers the input subjects, not `abort`/`fin`.)"""
    await ws.until(lambda m: m.get("request_id") == rid and "output" in m, keep=True)


def late_reply(rid: str) -> Any:
    return lambda m: m.get("request_id") == rid and m.get("append") is True


async def test_end_input_list_ends_only_the_named_streams(ws: WS) -> None:
    await ws.send({"request_id": "d1", "text": "first"})
    await ws.send({"request_id": "d1", "end_input": ["text_in"]})
    await ws.send({"request_id": "d1", "append": [pcm_file(ones(AUDIO_FRAME), stream="audio_in")]})
    await ws.send({"request_id": "d1", "append": [pcm_file(ones(AUX_FRAME), stream="aux_in")], "end_input": ["aux_in"]})
    await ws.send({"request_id": "d1", "append": [pcm_file(ones(100), stream="audio_in")]})
    await ws.send({"request_id": "d1", "end_input": ["audio_in"]})
    final = await ws.final("d1")
    assert "finish" in final, final
    assert final["finish"]["usage"] == {"text_in": 1, "audio_in": 2, "aux_in": 1}
    got = outputs_by_stream(ws, "d1")
    assert [o["text"] for o in got["text_in"]] == ["first"]
    assert [o["sum"] for o in got["audio_in"]] == [AUDIO_FRAME, 100]  # the last one padded with zeros


async def test_late_append_is_neither_charged_nor_sent(ws: WS) -> None:
    """Input the model routes to a stream the client already ended: the late-append reply
    (409, `late` names the streams), not sent, not charged to max_call_input_mb; the call goes on."""
    await ws.send({"request_id": "d2", "text": "a"})
    await ws.send({"request_id": "d2", "end_input": ["aux_in", "text_in"]})
    aux = pcm_file(ones(6000), stream="aux_in")  # 12,000 bytes for an ended stream
    for _ in range(3):  # 36,000 bytes: over the call's 31,457 if they were charged
        await ws.send({"request_id": "d2", "append": [aux]})
        m = await ws.until(late_reply("d2"))
        assert m["status"] == 409 and m["late"] == ["aux_in"] and "neither charged nor sent" in m["error"]
    await ws.send({"request_id": "d2", "append": {"text": "b"}})
    m = await ws.until(late_reply("d2"))
    assert m["status"] == 409 and m["late"] == ["text_in"]
    await ws.send({"request_id": "d2", "end_input": ["text_in"]})  # ending it again: the same reply
    assert (await ws.until(late_reply("d2")))["late"] == ["text_in"]
    # 8 items of audio_in (its lowered bound), 20,480 bytes: within the budget because nothing late was charged
    both = [pcm_file(ones(8 * AUDIO_FRAME), stream="audio_in"), aux]
    await ws.send({"request_id": "d2", "append": both, "end_input": ["audio_in"]})
    m = await ws.until(late_reply("d2"))
    assert m["late"] == ["aux_in"]
    final = await ws.final("d2")
    assert "finish" in final, final
    assert final["finish"]["usage"] == {"text_in": 1, "audio_in": 8}
    got = outputs_by_stream(ws, "d2")
    assert set(got) == {"text_in", "audio_in"} and [o["text"] for o in got["text_in"]] == ["a"]


async def test_max_items_lowered_by_the_config_counts_model_items(ws: WS) -> None:
    """audio_in: the model says 100 items, the config 8; items are 1280 samples, so 8 x 1280
    samples in any cut pass and one sample more (a padded 9th item at end of input) is a 400."""
    await ws.send({"request_id": "d3"})
    for n in (5000, 5240):
        await ws.send({"request_id": "d3", "append": [pcm_file(ones(n), stream="audio_in")]})
    await placed(ws, "d3")
    await ws.send({"request_id": "d3", "append": [pcm_file(ones(1), stream="audio_in")]})
    await ws.send({"request_id": "d3", "end_input": True})
    m = await ws.final("d3")
    assert m.get("status") == 400, m
    assert m["error"].startswith("client_streams.audio_in.max_items:") and "items of 1280 samples" in m["error"]


async def test_max_items_declared_by_the_model(ws: WS) -> None:
    """aux_in: the model's own bound (40 items of 160 samples), not in the config."""
    await ws.send({"request_id": "d4"})
    await ws.send({"request_id": "d4", "append": [pcm_file(ones(AUX_MAX * AUX_FRAME), stream="aux_in")]})
    await placed(ws, "d4")
    await ws.send({"request_id": "d4", "append": [pcm_file(ones(AUX_FRAME), stream="aux_in")]})
    m = await ws.final("d4")
    assert m.get("status") == 400 and m["error"].startswith("client_streams.aux_in.max_items:"), m
    await ws.send({"request_id": "d5"})
    for i in range(TEXT_MAX):
        await ws.send({"request_id": "d5", "append": {"text": f"t{i}"}})
    await placed(ws, "d5")
    await ws.send({"request_id": "d5", "append": {"text": "one too many"}})
    m = await ws.final("d5")
    assert m.get("status") == 400 and m["error"].startswith("client_streams.text_in.max_items:"), m
    assert len(outputs_by_stream(ws, "d5")["text_in"]) <= TEXT_MAX


async def test_a_file_must_name_a_stream_when_the_model_has_two(ws: WS) -> None:
    await ws.send({"request_id": "d6", "files": [pcm_file(ones(10))]})
    m = await ws.final("d6")
    assert m.get("status") == 400 and "names no stream" in m["error"]
