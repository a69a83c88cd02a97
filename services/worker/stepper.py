"""The worker's stepper: runs each partition's engine and publishes what its steps make
(outputs, edge items and ends, dones, aborts)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from services.worker import engine as eng
from services.worker.calls import Context, Runner
from services.worker.intake import Intake
from shared.bus import subjects, wire
from shared.bus.store_behind import StoreBehind
from shared.runtime.errors import DuplexError, ModelFailed, WorkerFailed
from shared.runtime.process import cancel_and_wait
from shared.sdk.model import StepInput

log = logging.getLogger(__name__)


class Stepper:
    """Owns a step loop per partition and the store of ends behind them (`ends`): `run()`
    runs them all until it is cancelled, and cancels and awaits them then."""

    def __init__(
        self,
        ctx: Context,
        intake: Intake,
        step_window_s: float,
    ) -> None:
        self.ctx = ctx
        self.intake = intake
        self.step_window_s = step_window_s
        self.ends = StoreBehind(self._store_once)  # edge ends, dones and aborts, stored with an ack

    async def run(self) -> None:
        loops = [asyncio.create_task(self._step_loop(name, r), name=f"step {name}") for name, r in self.ctx.runners.items()]
        loops.append(asyncio.create_task(self.ends.run(), name="ends"))
        try:
            await asyncio.gather(*loops)  # one that fails fails the worker's run, the others stopped here
        finally:
            await cancel_and_wait(*loops)

    async def _step_loop(self, name: str, r: Runner) -> None:
        window = self.step_window_s
        while True:
            now = time.monotonic()
            async with r.lock:
                batch = r.engine.next_batch(now)
                if batch:
                    actions = await self._run_step(name, r, batch)
                    self.intake.freed.fire()
            if not batch:
                r.wake.clear()
                due = r.engine.next_due(now)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.wake.wait(), timeout=1.0 if due is None else max(due, 0.001))
                continue
            await self.carry_out(actions, name)
            # Let input gather between steps: bigger batches, and the outputs of one step
            # leave in one socket write rather than many.
            await asyncio.sleep(window)

    async def _run_step(self, name: str, r: Runner, batch: list[StepInput]) -> list[eng.Action]:
        """The partition's step, then the engine's account of it. Model code that raises fails
        the calls it concerns, never the worker (I-4): the engine logs the exception and fails
        them with a line that names only the partition (engine.Engine.step_failed, complete)."""
        start = time.perf_counter()
        try:
            if r.blocking:
                emissions = await asyncio.to_thread(r.engine.partition.step, batch)
            else:
                emissions = r.engine.partition.step(batch)
        except Exception as e:
            return r.engine.step_failed(batch, e)
        self.ctx.metrics.step_seconds.labels(name).observe(time.perf_counter() - start)
        self.ctx.metrics.batch_size.labels(name).observe(len(batch))
        return r.engine.complete(batch, emissions)

    async def carry_out(self, actions: list[eng.Action], partition: str) -> None:
        """Publish what an engine made, in order; an edge whose consumer runs the call here is
        also handed to it at once (Intake.hand_over_item). An output or item the wire cannot
        carry (`_encoded`) fails its call, as a model's exception does, and the call's later
        actions are dropped: never the worker (I-4)."""
        bus = self.ctx.bus
        failed: set[str] = set()
        for a in actions:
            if a.cid in failed:
                continue
            if isinstance(a, eng.PublishOutput | eng.PublishEdgeItem):
                try:
                    body = self._encoded(a, partition)
                except Exception as e:  # the model's data (our own bug would show in the log line too)
                    failed.add(a.cid)
                    await self._unsendable(a, partition, e)
                    continue
            if isinstance(a, eng.PublishOutput):
                await bus.publish(subjects.out(a.cid), body)
            elif isinstance(a, eng.PublishEdgeItem):
                await bus.publish(subjects.edge(a.cid, a.edge), body)  # stored for replay and recovery
                if (took := self.intake.hand_over_item(a.cid, a.edge, a.seq, a.item, a.walk)) is not None:
                    await self.carry_out(*took)
            elif isinstance(a, eng.PublishEdgeEnd):
                # Stored behind (self.ends): the step loop does not wait for the ack.
                body = wire.encode(wire.EdgeEnd(total=a.total))
                self.ends.put(subjects.edge_end(a.cid, a.edge), body, failed=self._fail_on_refusal(a.cid, partition))
                if (took := self.intake.hand_over_end(a.cid, a.edge, a.total)) is not None:
                    await self.carry_out(*took)
            elif isinstance(a, eng.PublishDone):
                done = wire.Done(partition=partition, worker_id=self.ctx.worker_id, outputs=a.outputs, usage=a.usage)
                # The call is let go only once its done is stored: a worker that stopped before
                # that would leave the conductor waiting on a done that never comes.
                then = functools.partial(self.intake.partition_finished, a.cid, partition)
                self.ends.put(subjects.done(a.cid, partition), wire.encode(done), then, self._fail_on_refusal(a.cid, partition))
            elif isinstance(a, eng.FailCall):
                await self._fail(a.cid, partition, a.error)

    def _encoded(self, a: eng.PublishOutput | eng.PublishEdgeItem, partition: str) -> bytes:
        """The message's body; raises where the model emitted what the wire cannot carry (an
        output or meta value msgspec cannot encode, such as a numpy scalar; an object array)."""
        if isinstance(a, eng.PublishEdgeItem):
            return wire.edge_item(a.seq, a.item, a.walk)
        # In the encoding its client reads (the frontend relays it as it is).
        call = self.intake.calls.get(a.cid)
        packed = call is not None and call.binary
        event = wire.event_body(a.data, packed, self.ctx.binary_fields)
        return wire.encode(wire.OutputMsg(partition=partition, seq=a.seq, json=event, sent_ns=time.time_ns(), packed=packed))

    async def _unsendable(self, a: eng.PublishOutput | eng.PublishEdgeItem, partition: str, error: Exception) -> None:
        what = "an output" if isinstance(a, eng.PublishOutput) else f"an item on {a.edge!r}"
        log.error("partition %s emitted %s for %s that cannot be sent: %s", partition, what, a.cid, error)
        runner = self.ctx.runners.get(partition)
        if runner is not None:
            runner.engine.stats.model_errors += 1
        await self._fail(a.cid, partition, ModelFailed(partition, "step"))

    async def _fail(self, cid: str, partition: str, error: DuplexError) -> None:
        """The call's abort, stored behind (the conductor passes it on to the client; an abort
        refused for good is only logged: nothing else would tell anyone), and its state here
        dropped."""
        log.info("call %s failed in %s: %s", cid, partition, error.message)
        self.ends.put(subjects.abort(cid), wire.encode(wire.Abort(reason=error.message, status=error.status)))
        await self.intake.forget(cid)

    def _fail_on_refusal(self, cid: str, partition: str) -> Callable[[Exception], Awaitable[None]]:
        """What StoreBehind calls where it gave up on a done or edge end (refused for good: it
        logged why). Without it the conductor, or the edge's consumer elsewhere, would wait on
        the call for ever: the call is failed instead, as a model's failure fails it."""

        async def failed(error: Exception) -> None:
            if cid in self.intake.calls:  # not failed already (its other message refused), nor ended
                await self._fail(cid, partition, WorkerFailed(f"partition {partition} could not store its results"))

        return failed

    async def _store_once(self, subject: str, body: bytes) -> None:
        await self.ctx.bus.store_once(subject, body)
