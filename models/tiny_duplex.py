"""`tiny_duplex`: a small randomly initialised transformer with a per-call KV cache,
batched across calls. The model for GPU-style throughput work.

Client stream `audio_in` (16 kHz PCM16, 80 ms items of 1280 samples) -> partition
`Duplex`, one frame per call per step (`FixedChunkPolicy(1)`). Each frame is scaled to
[-1, 1], projected to d_model, given a sinusoidal embedding of its absolute position,
and run through one decoder step that attends over the call's cached keys/values. One
output per frame: `{"frame": i, "token": argmax of a small vocab head}`. `close_call`
returns usage `{"frames": N}`. Weights are seeded, so every partition built from the
same config computes the same function.

KV pool. One preallocated tensor per partition,
`[max_calls, n_layers, 2 (k, v), n_heads, window, head_dim]`. A call owns one slot
(the first index) from `open_call` to `close_call`; opening a call with every slot in
use raises `Overloaded`. A call's frame at absolute position `p` writes its keys and
values at ring index `p % window`, so a long call keeps the last `window` positions
(a sliding window) and the pool never grows.

Batched step. One forward pass for every call in the batch whatever their cache
lengths: per layer, scatter the new k/v of each row to `(slot, p % window)`, take the
first `L` ring entries of each slot, `L` the longest valid length in the batch (rows are
padded only up to the longest one present), and run `scaled_dot_product_attention` with
a boolean mask `[rows, 1, 1, L]` that keeps, per row, the first `min(p + 1, window)` ring
entries (no mask when every row is full). Taking the entries: when the batch's slots are
dense (span of slots < 2 x batch), attention runs on the view `pool[lo:hi, layer, :, :, :L]`
with no copy, slots in the span that are not in the batch riding along as dummy rows
(query 0, one valid entry, dropped); otherwise the B slots are copied into a reused
workspace (`torch.stack(views, out=...)`). A ring holds exactly those entries and,
as positions live in the embeddings (not in the attention), the order of the entries
in the ring does not matter. The single query is the newest position, so the step is
causal by construction. `step_unbatched` runs the same frames one call at a time
(one forward per call, no padding): the baseline of `bench/batching.py`.

Prefill walk (`prefill=True`; off by default). A call's audio often arrives in bulk: a
one-shot upload, a live call's pre-roll, a replaced worker's catch-up. Decoded one
position per step, T frames cost T forward passes; `prefill` runs them as one
full-sequence pass. With `prefill=True` a cheap `Frames` partition takes `audio_in` and
forwards each frame to `Duplex` on edge `frames`, whose `consumer_walk` (`frames_walk`)
names Duplex's walk: `prefill` for the frames a call had gathered by its first step, when
they are more than one, `decode` for every other frame. The engine batches one walk per
step, so a step of `Duplex` runs one kind of pass (one graph, on a GPU): a prefill step is
a sequence pass per call, a decode step one batched position per round. A prefill run
split over two chunks (more than `PREFILL_MAX_FRAMES`, or not all arrived) has its
later part decoded; under the walk "" (no stream named one) the frames' own backlog mark
decides, call by call. Prefill and decode give the same tokens (tests/test_tiny_duplex.py).

torch is imported only where the partition needs it: a frontend loads this module for
the topology and the stream units and never pays for torch.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexbus.sdk import (
    CLIENT,
    CallInfo,
    CatchUpChunkPolicy,
    ClientStreamLimits,
    Connection,
    EdgeItem,
    Emission,
    FixedChunkPolicy,
    Item,
    Model,
    Output,
    Overloaded,
    Partition,
    PartitionTopology,
    ProducerWalkCtx,
    StepInput,
)

if TYPE_CHECKING:
    import torch

SAMPLE_RATE = 16_000
FRAME = 1280  # 80 ms
MAX_ITEMS = 45_000  # one hour of 80 ms frames
EDGE = "audio_in"
PARTITION = "Duplex"
DEVICE_ENV = "DUPLEXBUS_DEVICE"
# prefill=True: the Frames partition in front of Duplex, and Duplex's walks
FRAMES_PARTITION = "Frames"
FRAMES_EDGE = "frames"
PREFILL, DECODE = "prefill", "decode"
PREFILL_MAX_FRAMES = 512  # the most frames one chunk (so one prefill pass) takes: 41 s of audio


@dataclass(frozen=True)
class TinyDuplexConfig:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    vocab: int = 256
    window: int = 1024  # KV positions kept per call (sliding window)
    max_calls: int = 64  # KV pool slots
    frame: int = FRAME
    seed: int = 0
    device: str | None = None  # None: $DUPLEXBUS_DEVICE, else cuda if available, else cpu
    dtype: str = "float32"  # float32 | bfloat16 | float16
    prefill: bool = False  # a Frames partition in front: a call's opening backlog is prefilled (walk "prefill")

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        for name in ("d_model", "n_layers", "n_heads", "vocab", "window", "max_calls", "frame"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def resolve_device(device: str | None = None) -> str:
    """`device`, else $DUPLEXBUS_DEVICE, else cuda if available, else cpu."""
    import torch

    chosen = device or os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.device(chosen)  # a clear error for a malformed name
    return chosen


def frame_to_float(data: np.ndarray | None, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """One item as `size` float32 samples in [-1, 1]: PCM16 is scaled, floats are taken as
    already scaled, a short item is zero-padded and a long one cut (the framer makes
    items of exactly `size`; this only keeps a malformed item from failing the batch).
    Written into `out` (`size` float32 zeros, e.g. a row of the batch) when given."""
    if out is None:
        out = np.zeros(size, dtype=np.float32)
    if data is None:
        return out
    a = np.asarray(data).reshape(-1)[:size]
    if a.dtype.kind in "iu":
        out[: len(a)] = a.astype(np.float32) / 32768.0
    else:
        out[: len(a)] = np.nan_to_num(a.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return out


@dataclass
class _Layer:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    w_fc: torch.Tensor
    b_fc: torch.Tensor
    w_proj: torch.Tensor
    b_proj: torch.Tensor


class TinyNet:
    """The transformer as plain tensors: a cached one-position step and a full-sequence pass."""

    def __init__(self, cfg: TinyDuplexConfig, device: str) -> None:
        import torch

        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = getattr(torch, cfg.dtype)
        g = torch.Generator().manual_seed(cfg.seed)
        d = cfg.d_model

        def w(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
            t = torch.randn(rows, cols, generator=g) * (scale / math.sqrt(cols))
            return t.to(self.device, self.dtype)

        def const(n: int, value: float) -> torch.Tensor:
            return torch.full((n,), value, device=self.device, dtype=self.dtype)

        residual = 1.0 / math.sqrt(2 * cfg.n_layers)
        self.w_in, self.b_in = w(d, cfg.frame), const(d, 0.0)
        self.layers = [
            _Layer(
                ln1_w=const(d, 1.0),
                ln1_b=const(d, 0.0),
                w_qkv=w(3 * d, d),
                b_qkv=const(3 * d, 0.0),
                w_o=w(d, d, residual),
                b_o=const(d, 0.0),
                ln2_w=const(d, 1.0),
                ln2_b=const(d, 0.0),
                w_fc=w(4 * d, d),
                b_fc=const(4 * d, 0.0),
                w_proj=w(d, 4 * d, residual),
                b_proj=const(d, 0.0),
            )
            for _ in range(cfg.n_layers)
        ]
        self.lnf_w, self.lnf_b = const(d, 1.0), const(d, 0.0)
        self.w_head = w(cfg.vocab, d)
        half = d // 2
        self._inv_freq = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float64) / half)
        self._workspace: torch.Tensor | None = None  # gather buffer, grown on demand
        self.gather_mode = "auto"  # auto | range | gather (see decode; tests force each)

    def new_pool(self, slots: int) -> torch.Tensor:
        import torch

        c = self.cfg
        shape = (slots, c.n_layers, 2, c.n_heads, c.window, c.head_dim)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def pos_emb(self, positions: list[int]) -> torch.Tensor:
        """Sinusoidal embedding of absolute positions, [len(positions), d_model]."""
        import torch

        angles = torch.tensor(positions, dtype=torch.float64)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([angles.sin(), angles.cos()], dim=1)
        if emb.shape[1] < self.cfg.d_model:
            emb = torch.nn.functional.pad(emb, (0, self.cfg.d_model - emb.shape[1]))
        return emb.to(self.device, self.dtype)

    def embed(self, frames: torch.Tensor, positions: list[int]) -> torch.Tensor:
        import torch.nn.functional as F

        return F.linear(frames.to(self.device, self.dtype), self.w_in, self.b_in) + self.pos_emb(positions)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        import torch.nn.functional as F

        h = F.layer_norm(x, (self.cfg.d_model,), layer.ln2_w, layer.ln2_b)
        return x + F.linear(F.gelu(F.linear(h, layer.w_fc, layer.b_fc)), layer.w_proj, layer.b_proj)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.linear(hidden, self.w_head)

    def decode(self, pool: torch.Tensor, frames: torch.Tensor, slots: list[int], positions: list[int]) -> torch.Tensor:
        """One position for each of B calls in one pass: frames [B, frame] -> hidden [B, d_model].

        Row b writes its k/v at `pool[slots[b], layer, :, :, positions[b] % window]` and
        attends over the first `min(positions[b] + 1, window)` ring entries of its slot.
        """
        import torch
        import torch.nn.functional as F

        c = self.cfg
        b, d = len(slots), c.d_model
        lengths = [min(p + 1, c.window) for p in positions]
        span = max(lengths)
        lo, hi = min(slots), max(slots) + 1
        use_range = self.gather_mode == "range" or (self.gather_mode == "auto" and hi - lo < 2 * b)
        if use_range:
            # attend over the view pool[lo:hi] (no copy); slots in the range that are not in
            # the batch ride along as dummy rows (query 0, one valid entry) and are dropped
            rows = hi - lo
            row_len = [1] * rows
            for s, n in zip(slots, lengths, strict=True):
                row_len[s - lo] = n
            identity = slots == list(range(lo, hi))
            row_t = torch.tensor([s - lo for s in slots], device=self.device)
        else:
            rows, row_len = b, lengths
        mask = None
        if min(row_len) < span:
            valid = torch.tensor(row_len, device=self.device)
            mask = (torch.arange(span, device=self.device)[None, :] < valid[:, None])[:, None, None, :]
        slot_t = torch.tensor(slots, device=self.device)
        ring_t = torch.tensor([p % c.window for p in positions], device=self.device)
        x = self.embed(frames, positions)
        for i, layer in enumerate(self.layers):
            h = F.layer_norm(x, (d,), layer.ln1_w, layer.ln1_b)
            q, k, v = F.linear(h, layer.w_qkv, layer.b_qkv).view(b, 3, c.n_heads, c.head_dim).unbind(1)
            pool[slot_t, i, :, :, ring_t] = torch.stack([k, v], dim=1)  # scatter: [B, 2, H, Dh]
            if use_range:
                kv = pool[lo:hi, i, :, :, :span]  # a view: [rows, 2, H, span, Dh]
                if not identity:
                    q = q.new_zeros(rows, c.n_heads, c.head_dim).index_copy_(0, row_t, q)
            else:
                kv = self._gather(pool, i, slots, span)  # a copy: [B, 2, H, span, Dh]
            att = F.scaled_dot_product_attention(q[:, :, None, :], kv[:, 0], kv[:, 1], attn_mask=mask)
            if use_range and not identity:
                att = att.index_select(0, row_t)
            x = x + F.linear(att.reshape(b, d), layer.w_o, layer.b_o)
            x = self._mlp(x, layer)
        return F.layer_norm(x, (d,), self.lnf_w, self.lnf_b)

    def _gather(self, pool: torch.Tensor, layer: int, slots: list[int], span: int) -> torch.Tensor:
        """The first `span` ring entries of each slot, copied into a reused workspace:
        [B, 2, H, span, Dh]. `torch.stack(views, out=...)` is B block copies; advanced
        indexing (`pool[slot_t, layer, :, :, :span]`) is 10-25x slower on CPU, and a fresh
        output tensor per layer costs ~7x in page faults."""
        import torch

        c = self.cfg
        shape = (len(slots), 2, c.n_heads, span, c.head_dim)
        need = math.prod(shape)
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = torch.empty(need, device=self.device, dtype=self.dtype)
        out = self._workspace[:need].view(shape)
        return torch.stack([pool[s, layer, :, :, :span] for s in slots], out=out)

    def sequence(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A whole call from position 0 without a cache: frames [T, frame] -> hidden [T, d_model],
        with the sliding window as a banded causal mask. Also returns each layer's k and v
        ([H, T, Dh]). The reference the cached path must match, and the prefill path."""
        import torch
        import torch.nn.functional as F

        c = self.cfg
        t, d = frames.shape[0], c.d_model
        idx = torch.arange(t, device=self.device)
        mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - c.window)
        x = self.embed(frames, list(range(t)))
        kvs = []
        for layer in self.layers:
            h = F.layer_norm(x, (d,), layer.ln1_w, layer.ln1_b)
            q, k, v = F.linear(h, layer.w_qkv, layer.b_qkv).view(t, 3, c.n_heads, c.head_dim).permute(1, 2, 0, 3).unbind(0)
            kvs.append((k, v))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [H, T, Dh]
            x = x + F.linear(att.transpose(0, 1).reshape(t, d), layer.w_o, layer.b_o)
            x = self._mlp(x, layer)
        return F.layer_norm(x, (d,), self.lnf_w, self.lnf_b), kvs


@dataclass
class _CallState:
    slot: int
    frames: int = 0  # positions seen so far; the next frame's absolute position


def frames_walk(ctx: ProducerWalkCtx) -> str:
    """Duplex's walk for one frame the Frames partition forwards (its backlog mark)."""
    return PREFILL if ctx.item.meta.get("backlog") else DECODE


class FramesPartition(Partition):
    """`prefill=True`'s front: each audio item on to Duplex on `frames`, those of a call's first
    chunk marked `backlog` when that chunk holds more than one frame (the call had gathered
    them before it was first stepped). No model work: it steps on the event loop."""

    blocking = False

    def __init__(self) -> None:
        self._stepped: set[str] = set()  # calls it has had a frame of

    def open_call(self, call: CallInfo) -> None:
        pass

    def step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        for s in batch:
            chunk = s.chunks.get(EDGE)
            items = chunk.items if chunk is not None else []
            backlog = s.cid not in self._stepped and len(items) > 1
            if items:
                self._stepped.add(s.cid)
            out.extend(EdgeItem(s.cid, FRAMES_EDGE, Item(i.data, {"backlog": backlog})) for i in items)
        return out

    def close_call(self, cid: str) -> dict[str, Any]:
        self._stepped.discard(cid)
        return {}


class TinyDuplexPartition(Partition):
    """The model's partition: per-call KV slots in a shared pool, one forward pass per step
    (or, under walk `prefill`, one sequence pass per call). `edge`: its input edge."""

    def __init__(self, cfg: TinyDuplexConfig, edge: str = EDGE) -> None:
        self.cfg = cfg
        self.edge = edge
        self.prefilled = 0  # frames run through a prefill pass
        self.device = resolve_device(cfg.device)
        self.net = TinyNet(cfg, self.device)
        self.pool = self.net.new_pool(cfg.max_calls)
        self._free = list(range(cfg.max_calls))  # a heap: the lowest free slot first
        self._calls: dict[str, _CallState] = {}

    # -- call lifecycle -------------------------------------------------------------

    def capacity(self) -> int:
        return self.cfg.max_calls

    def open_call(self, call: CallInfo) -> None:
        if call.cid in self._calls:
            return
        if not self._free:
            raise Overloaded(f"tiny_duplex: all {self.cfg.max_calls} KV cache slots of this partition are in use")
        slot = heapq.heappop(self._free)
        self.pool[slot].zero_()
        self._calls[call.cid] = _CallState(slot)

    def close_call(self, cid: str) -> dict[str, Any]:
        state = self._calls.pop(cid, None)
        if state is None:
            return {"frames": 0}
        heapq.heappush(self._free, state.slot)
        return {"frames": state.frames}

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def kv_pool_bytes(self) -> int:
        return int(self.pool.numel() * self.pool.element_size())

    def slot_of(self, cid: str) -> int:
        return self._state(cid).slot

    def frames_of(self, cid: str) -> int:
        return self._state(cid).frames

    # -- stepping -------------------------------------------------------------------

    def step(self, batch: list[StepInput]) -> list[Emission]:
        """One forward pass for every call in the batch (per item round, see `_run`); the calls
        `plan` says to prefill get a sequence pass each instead."""
        prefill, decode = self.plan(batch)
        out = self._prefill_step(prefill)
        out += self._run(decode, batched=True)
        return out

    def plan(self, batch: list[StepInput]) -> tuple[list[StepInput], list[StepInput]]:
        """(calls to prefill, calls to decode). Prefilled: a fresh call's frames under walk
        `prefill`, or under the walk "" where its frames are marked `backlog`. Under `decode`
        or in a one-partition model (no marks) nothing is."""
        prefill: list[StepInput] = []
        decode: list[StepInput] = []
        for s in batch:
            chunk = s.chunks.get(self.edge)
            items = chunk.items if chunk is not None else []
            fresh = bool(items) and self._state(s.cid).frames == 0
            wanted = s.walk == PREFILL or (s.walk == "" and bool(items) and bool(items[0].meta.get("backlog")))
            (prefill if fresh and wanted else decode).append(s)
        return prefill, decode

    def _prefill_step(self, batch: list[StepInput]) -> list[Emission]:
        out: list[Emission] = []
        for s in batch:
            items = s.chunks[self.edge].items
            frames = np.stack([frame_to_float(i.data, self.cfg.frame) for i in items])
            tokens, _ = self.prefill(s.cid, frames)
            self.prefilled += len(tokens)
            out.extend(Output(s.cid, {"frame": i, "token": t}) for i, t in enumerate(tokens))
        return out

    def step_unbatched(self, batch: list[StepInput]) -> list[Emission]:
        """The same frames and outputs as `step`, one forward pass per call: the baseline."""
        return self._run(batch, batched=False)

    def _run(self, batch: list[StepInput], batched: bool) -> list[Emission]:
        items: dict[str, list[np.ndarray | None]] = {}
        states: dict[str, _CallState] = {}
        for s in batch:
            state = self._state(s.cid)
            if s.cid in items:
                raise ValueError(f"call {s.cid!r} appears twice in one batch")
            chunk = s.chunks.get(self.edge)
            items[s.cid] = [i.data for i in chunk.items] if chunk else []
            states[s.cid] = state
        # FixedChunkPolicy(1) gives one item per call; a chunk of several (another policy,
        # a catch-up) is run as rounds of one position per call.
        out: list[Emission] = []
        size = self.cfg.frame
        for r in range(max((len(f) for f in items.values()), default=0)):
            cids = [cid for cid, f in items.items() if len(f) > r]
            first = [states[cid].frames for cid in cids]
            x = np.zeros((len(cids), size), dtype=np.float32)  # the round's frames, converted in place
            for row, cid in zip(x, cids, strict=True):
                frame_to_float(items[cid][r], size, out=row)
            tokens, _ = self.forward(cids, x, batched=batched)
            out.extend(Output(cid, {"frame": i, "token": t}) for cid, i, t in zip(cids, first, tokens, strict=True))
        return out

    def forward(self, cids: list[str], frames: np.ndarray | torch.Tensor, batched: bool = True) -> tuple[list[int], torch.Tensor]:
        """Advance each call by one frame (frames [B, frame], floats in [-1, 1]).

        Returns the tokens and the final hidden states [B, d_model]. `batched=False` runs
        one forward pass per call instead of one for all.
        """
        import torch

        if len(set(cids)) != len(cids):
            raise ValueError("a call appears twice in one forward pass")
        states = [self._state(cid) for cid in cids]
        x = torch.as_tensor(frames, dtype=torch.float32)
        if x.shape != (len(cids), self.cfg.frame):
            raise ValueError(f"frames must be [{len(cids)}, {self.cfg.frame}], got {list(x.shape)}")
        slots = [s.slot for s in states]
        positions = [s.frames for s in states]
        with torch.inference_mode():
            if batched:
                hidden = self.net.decode(self.pool, x, slots, positions)
            else:
                hidden = torch.cat(
                    [self.net.decode(self.pool, x[b : b + 1], slots[b : b + 1], positions[b : b + 1]) for b in range(len(cids))]
                )
            tokens = self.net.head(hidden).argmax(dim=-1).tolist()
        for s in states:
            s.frames += 1
        return tokens, hidden

    def prefill(self, cid: str, frames: np.ndarray | torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Run a fresh call's first T frames ([T, frame]) in one full-sequence pass and leave
        its cache as T steps would. Returns the tokens and hidden states [T, d_model]."""
        import torch

        state = self._state(cid)
        if state.frames:
            raise ValueError(f"call {cid!r} is past its first frame; prefill needs a fresh call")
        x = torch.as_tensor(frames, dtype=torch.float32)
        if x.ndim != 2 or x.shape[1] != self.cfg.frame or x.shape[0] < 1:
            raise ValueError(f"frames must be [T >= 1, {self.cfg.frame}], got {list(x.shape)}")
        t = x.shape[0]
        kept = min(t, self.cfg.window)
        ring = torch.arange(t - kept, t, device=self.net.device) % self.cfg.window
        with torch.inference_mode():
            hidden, kvs = self.net.sequence(x)
            for i, (k, v) in enumerate(kvs):
                self.pool[state.slot, i, 0, :, ring] = k[:, t - kept :]
                self.pool[state.slot, i, 1, :, ring] = v[:, t - kept :]
            tokens = self.net.head(hidden).argmax(dim=-1).tolist()
        state.frames = t
        return tokens, hidden

    def _state(self, cid: str) -> _CallState:
        state = self._calls.get(cid)
        if state is None:
            raise KeyError(f"call {cid!r} is not open on this tiny_duplex partition")
        return state


class TinyDuplexModel(Model):
    name = "tiny_duplex"

    def __init__(self, **kwargs: Any) -> None:
        """`kwargs` override `TinyDuplexConfig` (device, dtype, max_calls, window, seed, sizes, prefill)."""
        self.config = TinyDuplexConfig(**kwargs)
        audio = ClientStreamLimits(max_items=MAX_ITEMS, item_size=self.config.frame, unit="samples", sample_rate=SAMPLE_RATE)
        if not self.config.prefill:
            self.topology = PartitionTopology(
                [PARTITION], [Connection(CLIENT, PARTITION, EDGE, lambda: FixedChunkPolicy(1), audio)]
            )
            return
        self.topology = PartitionTopology(
            [FRAMES_PARTITION, PARTITION],
            [
                Connection(CLIENT, FRAMES_PARTITION, EDGE, lambda: CatchUpChunkPolicy(PREFILL_MAX_FRAMES), audio),
                Connection(
                    FRAMES_PARTITION,
                    PARTITION,
                    FRAMES_EDGE,
                    lambda: CatchUpChunkPolicy(PREFILL_MAX_FRAMES),
                    consumer_walk=frames_walk,
                ),
            ],
        )

    def create_partition(self, name: str) -> Partition:
        if self.config.prefill and name == FRAMES_PARTITION:
            return FramesPartition()
        if name != PARTITION:
            raise KeyError(f"tiny_duplex has partitions {self.topology.partitions}, not {name!r}")
        return TinyDuplexPartition(self.config, FRAMES_EDGE if self.config.prefill else EDGE)


class TinyDuplexPrefillModel(TinyDuplexModel):
    """`tiny_duplex` with `prefill=True`, to serve by path: `--model models.tiny_duplex:TinyDuplexPrefillModel`."""

    name = "tiny_duplex_prefill"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"prefill": True, **kwargs})
