"""The worked example of a model package (examples/reverse_model, installed by `make` with
its entry point): its partition by itself, then served end to end by a real stack that finds
it both ways, by name and by path.

One stack: frontend-0 serves `reverse` (the config's name: the entry point), the worker and
frontend-1 serve `reverse_model:ReverseModel` (the path, from $DUPLEXBUS_MODEL). The calls of
both frontends reach the one worker, so both ways name the model alike on the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import websockets
from reverse_model import ReverseModel, Reverser, TextReplies

from duplexbus.sdk import CallInfo, Chunk, Item, Output, ReplyEnded, ReplyStarted, ReplyText, StepInput, pcm16_from_b64
from tests.support.audio import pcm_file
from tests.support.client import WS, Message
from tests.support.realtime import RT
from tests.support.stack import Stack

PATH = "reverse_model:ReverseModel"


def test_the_partition_reverses_text_and_each_audio_item() -> None:
    part = Reverser()
    part.open_call(CallInfo("c"))
    audio = np.arange(6, dtype=np.int16)
    chunks = {"audio_in": Chunk([Item(audio[:3]), Item(audio[3:])], 0), "text_in": Chunk([Item(meta={"text": "abc"})], 0)}
    out = part.step([StepInput("c", chunks)])
    assert all(isinstance(o, Output) and o.cid == "c" for o in out)
    data = [o.data for o in out if isinstance(o, Output)]
    assert [pcm16_from_b64(d["audio"]).tolist() for d in data[:2]] == [[2, 1, 0], [5, 4, 3]]
    assert data[2] == {"text": "cba"}
    assert part.close_call("c") == {"items": 3}


def test_a_text_output_is_one_realtime_reply_and_audio_none() -> None:
    m = TextReplies()
    assert m.on_output({"text": "olleh"}) == [ReplyStarted(), ReplyText("olleh"), ReplyEnded()]
    assert m.on_output({"audio": "AAA="}) == []
    assert ReverseModel().default_stream() == "audio_in"  # what /v1/realtime needs


@pytest.fixture(scope="module")
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    s = Stack(nats_url, {"model": "reverse"})
    try:
        await s.reset_bus()
        s.start_conductor()
        s.start_frontend("frontend-0")
        s.env["DUPLEXBUS_MODEL"] = PATH  # over the config's `model`, for the processes started from here
        s.start_worker("worker-0")
        s.start_frontend("frontend-1")
        for port in s.ports:
            await s.wait_ready(port)
        await s.wait_workers(1)
        yield s
    finally:
        s.stop()


async def call(stack: Stack, frontend: int, rid: str, *messages: Message) -> tuple[list[Message], Message]:
    ws = await WS.connect(stack.ws_url(frontend))
    try:
        for m in messages:
            await ws.send({"request_id": rid, **m})
        final = await ws.final(rid, timeout=30)
        return ws.outputs(rid), final
    finally:
        await ws.close()


async def test_served_by_name_text_comes_back_reversed(stack: Stack) -> None:
    outs, final = await call(stack, 0, "by-name", {"text": "stressed", "end_input": True})
    assert outs == [{"text": "desserts"}], final
    assert final["finish"] == {**final["finish"], "usage": {"items": 1}}


async def test_served_by_path_audio_and_text_come_back_reversed(stack: Stack) -> None:
    samples = np.arange(640, dtype=np.int16)  # two items of 320 samples
    outs, final = await call(
        stack,
        1,
        "by-path",
        {},  # the frontend's own model: the one it serves by path
        {"append": [pcm_file(samples)]},
        {"append": {"text": "drawer"}, "end_input": True},
    )
    assert "finish" in final, final
    audio = [pcm16_from_b64(str(o["audio"])).tolist() for o in outs if "audio" in o]
    assert audio == [samples[319::-1].tolist(), samples[:319:-1].tolist()]
    assert [o for o in outs if "text" in o] == [{"text": "reward"}]


async def test_over_v1_realtime_a_text_item_comes_back_as_a_reversed_text_reply(stack: Stack) -> None:
    # On the frontend that serves the model by path, named by its name.
    rt = RT(await websockets.connect(f"ws://127.0.0.1:{stack.ports[1]}/v1/realtime?model=reverse", max_size=None))
    rt.seen = []
    try:
        await rt.next("session.created")
        await rt.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
        await rt.next("session.updated")
        content = [{"type": "input_text", "text": "live on"}]
        await rt.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}})
        done = await rt.next("response.output_text.done")
        assert done["text"] == "no evil"
        assert (await rt.next("response.done"))["response"]["status"] == "completed"
    finally:
        await rt.close()
