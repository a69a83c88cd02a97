"""I-2: input published before any worker exists waits in JetStream and is all processed.

Its own module: no other stack may be running on the bus meanwhile.
"""

from __future__ import annotations

import numpy as np

from models.echo import FRAME
from tests.support.audio import echo_bytes, pcm_file
from tests.support.client import WS, nothing_for
from tests.support.stack import running_stack


async def test_input_before_any_worker_is_not_lost(nats_url: str) -> None:
    """I-2: every append published before a worker exists is processed once one starts."""
    async with running_stack(nats_url, {"model": "echo", "placement_timeout_s": 60}, workers=[]) as s:
        ws = await WS.connect(s.ws_url())
        samples = np.arange(40 * FRAME, dtype=np.int64).astype("<i2")
        await ws.send({"request_id": "early"})
        for k in range(40):
            await ws.send({"request_id": "early", "append": [pcm_file(samples[k * FRAME : (k + 1) * FRAME])]})
        await ws.send({"request_id": "early", "end_input": True})
        await nothing_for(ws, lambda m: "output" in m, 1.5)
        s.start_worker("late-worker")
        final = await ws.final("early", timeout=60)
        assert "finish" in final, final
        outs = ws.outputs("early")
        assert echo_bytes(outs) == samples.tobytes()
        await ws.close()
