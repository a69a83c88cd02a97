"""What one item costs a worker's own Python, without the bus: echo's Encoder and Talker
workers, each a real `WorkerService` (intake, engine, stepper), fed live items for many calls
by hand and stepped as the step loop steps them; the bus is a stand-in that keeps what is
published. No nats-server, no sockets: the figure is the worker's per-item path (take the
item, step, publish the output), which profiles at 400 calls put at most of a worker's CPU.

    .venv/bin/python -m bench.worker_path                  # 400 calls, 5 repeats
    .venv/bin/python -m bench.worker_path --calls 200 --rounds 50
    .venv/bin/python -m bench.worker_path --binary          # calls whose clients read msgpack

Each repeat sends `--rounds` items to each call, in steps of `--batch` calls (the step loop's
batches at 400 live calls hold about that many), and prints µs of CPU per item for each
partition, the best of the repeats. Run it in two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import numpy as np

from services.worker.service import WorkerService
from shared.bus import subjects, wire
from shared.runtime.config import ServingConfig
from shared.sdk.chunking import Item
from tests.support.bus import StandInBus

SAMPLES = 1280  # 80 ms of 16 kHz audio: what a client sends every 80 ms


@dataclass
class _Msg:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


async def _worker(partition: str, cids: list[str], binary: bool) -> tuple[WorkerService, StandInBus]:
    w = WorkerService(ServingConfig(), "echo", partitions=[partition], worker_id=f"bench-{partition}")
    bus = StandInBus()
    w._bus = bus  # type: ignore[assignment]
    for cid in cids:
        await w.assignment.assign(wire.Assign(cid=cid, model="echo", partitions=[partition], binary=binary))
    await asyncio.sleep(0.01)  # the placement reads (of nothing) end
    return w, bus


async def _feed(w: WorkerService, msgs: list[_Msg], batch: int) -> None:
    """Each message taken live, and the partition stepped every `batch` of them."""
    ((name, r),) = w.runners.items()
    for i in range(0, len(msgs), batch):
        for m in msgs[i : i + batch]:
            w.intake._on_data(m)  # type: ignore[arg-type]
        while b := r.engine.next_batch(time.monotonic()):
            await w.stepper.carry_out(await w.stepper._run_step(name, r, b), name)


def _inputs(cids: list[str], seq: int) -> list[_Msg]:
    rng = np.random.default_rng(seq)
    out = []
    for cid in cids:
        pcm = rng.integers(-3000, 3000, SAMPLES, dtype=np.int16)
        item = wire.InputItem(seq=seq, item=wire.WireItem.from_item(Item(pcm)), sent_ns=time.time_ns())
        out.append(_Msg(subjects.input_(cid, "audio_in"), wire.encode(item)))
    return out


async def run(calls: int, rounds: int, batch: int, repeats: int, binary: bool = False) -> dict[str, float]:
    best = {"Encoder": float("inf"), "Talker": float("inf")}
    for _ in range(repeats):
        cids = [subjects.new_cid() for _ in range(calls)]
        enc, enc_bus = await _worker("Encoder", cids, binary)
        talk, talk_bus = await _worker("Talker", cids, binary)
        for seq in range(rounds):
            msgs = _inputs(cids, seq)
            t = time.process_time()
            await _feed(enc, msgs, batch)
            best["Encoder"] = min(best["Encoder"], (time.process_time() - t) / len(msgs) * 1e6)
            edges = [_Msg(s, b) for s, b in enc_bus.published if subjects.parse(s).kind == subjects.EDGE]
            enc_bus.published.clear()
            assert len(edges) == len(msgs), f"the Encoder made {len(edges)} edge items of {len(msgs)}"
            t = time.process_time()
            await _feed(talk, edges, batch)
            best["Talker"] = min(best["Talker"], (time.process_time() - t) / len(edges) * 1e6)
            outs = [s for s, _ in talk_bus.published if s.endswith(".out")]
            talk_bus.published.clear()
            assert len(outs) == len(edges), f"the Talker made {len(outs)} outputs of {len(edges)}"
        for w in (enc, talk):
            await w.intake.close()
    return best


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=30, help="items to each call in a repeat")
    ap.add_argument("--batch", type=int, default=16, help="items taken between steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--binary", action="store_true", help="the calls' clients read msgpack (outputs packed)")
    args = ap.parse_args(argv)
    for name in ("calls", "rounds", "batch", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    best = asyncio.run(run(args.calls, args.rounds, args.batch, args.repeats, args.binary))
    for name, us in best.items():
        print(f"{name}: {us:.1f} µs of CPU per item (take, step, publish), best round")


if __name__ == "__main__":
    cli()
