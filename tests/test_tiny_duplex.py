"""`tiny_duplex`: batched KV-cache decoding across calls (pure: no NATS, hand-made inputs)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import numpy as np
import pytest

from models.registry import get_model
from models.tiny_duplex import (
    FRAME,
    TinyDuplexConfig,
    TinyDuplexModel,
    TinyDuplexPartition,
    resolve_device,
)
from shared.runtime.errors import Overloaded
from shared.sdk.chunking import Chunk, FixedChunkPolicy, Item
from shared.sdk.model import CallInfo, Output, StepInput


@pytest.fixture(scope="module")
def torch() -> ModuleType:
    """Imported by the tests that use it, not at collection: torch's import takes 2 s of CPU,
    in every pytest process that collects this module."""
    return importlib.import_module("torch")


WINDOW, VOCAB = 8, 64
SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab": VOCAB, "window": WINDOW, "max_calls": 6, "device": "cpu"}
ATOL = 1e-4


def partition(**overrides: object) -> TinyDuplexPartition:
    p = TinyDuplexModel(**{**SMALL, **overrides}).create_partition("Duplex")
    assert isinstance(p, TinyDuplexPartition)
    return p


def frames_for(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, (n, FRAME)).astype(np.float32)


def pcm16(frame: np.ndarray) -> np.ndarray:
    return np.round(frame * 32767).astype("<i2")


def step_input(cid: str, *frames: np.ndarray, last: bool = False) -> StepInput:
    return StepInput(cid, {"audio_in": Chunk([Item(f) for f in frames], first_seq=0, last=last)})


def test_topology_and_registry() -> None:
    model = get_model("tiny_duplex")
    assert isinstance(model, TinyDuplexModel) and model.name == "tiny_duplex"
    assert model.topology.partitions == ["Duplex"]
    conn = model.client_edges()["audio_in"]
    assert conn.to_partition == "Duplex"
    assert conn.limits is not None
    assert (conn.limits.item_size, conn.limits.unit, conn.limits.sample_rate) == (1280, "samples", 16000)
    policy = conn.chunk_policy_factory()
    assert isinstance(policy, FixedChunkPolicy) and policy.chunk_size == 1
    assert model.default_stream() == "audio_in"
    with pytest.raises(KeyError):
        model.create_partition("Talker")


def test_importing_the_model_does_not_import_torch() -> None:
    code = (
        "import sys; from models.tiny_duplex import TinyDuplexModel; "
        "TinyDuplexModel().client_edges(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TinyDuplexConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="window"):
        TinyDuplexConfig(window=0)


def test_device_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEXBUS_DEVICE", "cpu")
    assert resolve_device(None) == "cpu"
    monkeypatch.setenv("DUPLEXBUS_DEVICE", "not-a-device")
    assert resolve_device("cpu") == "cpu"  # the model kwarg wins over the environment
    with pytest.raises(RuntimeError):
        resolve_device(None)


@pytest.mark.parametrize("gather_mode", ["auto", "range", "gather"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-slots", "sparse-slots"])
def test_batched_equals_unbatched_for_different_cache_lengths(torch: ModuleType, gather_mode: str, sparse: bool) -> None:
    """Calls that joined at different times (lengths 1..window, some wrapped) in one pass."""
    batched, single = partition(max_calls=12), partition(max_calls=12)
    batched.net.gather_mode = gather_mode
    joins = {"a": 0, "b": 3, "c": 7, "d": 12, "e": 13}  # by step 20: a and b wrapped, e short
    data = {cid: frames_for(i, 25) for i, cid in enumerate(joins)}
    for t in range(20):
        live = [cid for cid, j in joins.items() if j <= t]
        for cid in live:
            if joins[cid] == t:
                for p in (batched, single):
                    p.open_call(CallInfo(cid))
                    if sparse:  # an idle call between each two live ones: slots 0, 2, 4, ...
                        p.open_call(CallInfo(f"idle-{cid}"))
        if t % 2:
            live.reverse()  # rows not in slot order
        x = np.stack([data[cid][t - joins[cid]] for cid in live])
        tok_b, hid_b = batched.forward(live, x, batched=True)
        tok_s, hid_s = single.forward(live, x, batched=False)
        assert tok_b == tok_s
        torch.testing.assert_close(hid_b, hid_s, atol=ATOL, rtol=ATOL)
    assert [batched.frames_of(c) for c in joins] == [20, 17, 13, 8, 7]
    assert [batched.slot_of(c) for c in joins] == ([0, 2, 4, 6, 8] if sparse else [0, 1, 2, 3, 4])

    # and through the Partition API: the same emissions, in the same order
    batch = [step_input(cid, pcm16(data[cid][20 - joins[cid]])) for cid in joins]
    out_b, out_s = batched.step(batch), single.step_unbatched(batch)
    assert out_b == out_s
    assert [(o.cid, o.data["frame"]) for o in out_b if isinstance(o, Output)] == [
        ("a", 20),
        ("b", 17),
        ("c", 13),
        ("d", 8),
        ("e", 7),
    ]


def test_cached_decoding_matches_the_full_sequence_with_a_sliding_window(torch: ModuleType) -> None:
    p = partition()
    p.open_call(CallInfo("a"))
    x = frames_for(1, 3 * WINDOW + 5)
    tokens, hidden = [], []
    for f in x:
        tok, hid = p.forward(["a"], f[None])
        tokens += tok
        hidden.append(hid)
    with torch.inference_mode():
        ref_hidden, _ = p.net.sequence(torch.from_numpy(x))
        ref_tokens = p.net.head(ref_hidden).argmax(-1).tolist()
    assert tokens == ref_tokens and len(set(tokens)) > 3  # the tokens follow the input
    torch.testing.assert_close(torch.cat(hidden), ref_hidden, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("gather_mode", ["auto", "range", "gather"])
def test_per_call_state_is_isolated(torch: ModuleType, gather_mode: str) -> None:
    """A call's outputs do not depend on which calls share its batches or used its slot before."""
    alone, shared = partition(), partition()
    shared.net.gather_mode = gather_mode
    alone.open_call(CallInfo("a"))
    a = frames_for(7, 20)
    ref = [alone.forward(["a"], f[None]) for f in a]

    shared.open_call(CallInfo("x"))
    shared.forward(["x"], frames_for(8, 1))
    shared.close_call("x")  # "a" reuses the dirty slot of "x"
    shared.open_call(CallInfo("a"))
    shared.open_call(CallInfo("b"))
    b = frames_for(9, 40)
    shared.prefill("b", b[:5])  # "b" is ahead of "a": "a" rides padded rows
    for t in range(20):
        cids = ["b", "a"] if t % 3 else ["a"]
        if t == 5:
            shared.open_call(CallInfo("c"))
        if t >= 5 and t < 15:
            cids.append("c")
        if t == 15:
            shared.close_call("c")
        x = np.stack([a[t] if c == "a" else b[5 + t] for c in cids])
        tokens, hidden = shared.forward(cids, x)
        i = cids.index("a")
        assert tokens[i] == ref[t][0][0]
        torch.testing.assert_close(hidden[i], ref[t][1][0], atol=ATOL, rtol=ATOL)


def test_sliding_window_keeps_memory_bounded(torch: ModuleType) -> None:
    p = partition()
    pool, size = p.pool.data_ptr(), p.kv_pool_bytes
    p.open_call(CallInfo("long"))
    x = frames_for(3, 1)
    window = WINDOW
    for t in range(10 * window):
        (out,) = p.step([step_input("long", pcm16(x[0]))])
        assert isinstance(out, Output) and out.data["frame"] == t and 0 <= out.data["token"] < VOCAB
    assert p.pool.data_ptr() == pool and p.kv_pool_bytes == size
    assert tuple(p.pool.shape) == (6, 2, 2, 4, window, 16)
    assert torch.isfinite(p.pool).all()
    assert p.close_call("long") == {"frames": 10 * window}


def test_close_frees_the_slot_and_a_full_pool_is_overloaded() -> None:
    p = partition(max_calls=2)
    p.open_call(CallInfo("a"))
    p.open_call(CallInfo("b"))
    p.open_call(CallInfo("a"))  # opening twice is a no-op, not a second slot
    with pytest.raises(Overloaded, match="2 KV cache slots") as err:
        p.open_call(CallInfo("c"))
    assert err.value.status == 503
    p.step([step_input("a", pcm16(frames_for(0, 1)[0])), step_input("b", pcm16(frames_for(1, 1)[0]))])
    slot = p.slot_of("a")
    assert p.close_call("a") == {"frames": 1}
    assert p.free_slots == 1
    p.open_call(CallInfo("c"))
    assert p.slot_of("c") == slot and p.frames_of("c") == 0
    assert p.close_call("a") == {"frames": 0}  # already closed
    p.drop_call("b")
    assert p.free_slots == 1
    with pytest.raises(KeyError, match="not open"):
        p.step([step_input("b", pcm16(frames_for(1, 1)[0]))])


def test_prefill_leaves_the_cache_as_steps_would(torch: ModuleType) -> None:
    stepped, prefilled = partition(), partition()
    x = frames_for(4, 2 * WINDOW + 3)
    for p in (stepped, prefilled):
        p.open_call(CallInfo("a"))
    step_tokens = [stepped.forward(["a"], f[None])[0][0] for f in x[:-1]]
    pre_tokens, _ = prefilled.prefill("a", x[:-1])
    assert pre_tokens == step_tokens and prefilled.frames_of("a") == stepped.frames_of("a")
    tok_s, hid_s = stepped.forward(["a"], x[-1:])
    tok_p, hid_p = prefilled.forward(["a"], x[-1:])
    assert tok_s == tok_p
    torch.testing.assert_close(hid_s, hid_p, atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="fresh call"):
        prefilled.prefill("a", x[:2])


def test_step_chunks_of_several_items_empty_chunks_and_pcm16_scaling() -> None:
    p, ref = partition(), partition()
    x = frames_for(5, 3)
    for q in (p, ref):
        q.open_call(CallInfo("a"))
        q.open_call(CallInfo("b"))
    # a catch-up chunk of three items runs as three rounds; "b" has one item
    out = p.step([step_input("a", *(pcm16(f) for f in x)), step_input("b", pcm16(x[0]))])
    out += p.step([StepInput("a", {"audio_in": Chunk([], first_seq=3, last=True)}, inputs_ended=True)])
    assert [(o.cid, o.data["frame"]) for o in out if isinstance(o, Output)] == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]
    expected = [ref.forward(["a"], (pcm16(f).astype(np.float32) / 32768.0)[None])[0][0] for f in x]
    assert [o.data["token"] for o in out if isinstance(o, Output) and o.cid == "a"] == expected
    assert p.step([StepInput("a", {})]) == []


def test_default_sizes(torch: ModuleType) -> None:
    batched, single = (TinyDuplexModel(device="cpu", max_calls=2).create_partition("Duplex") for _ in range(2))
    assert isinstance(batched, TinyDuplexPartition) and isinstance(single, TinyDuplexPartition)
    assert tuple(batched.pool.shape) == (2, 4, 2, 4, 1024, 64)
    x = frames_for(2, 2)
    for p in (batched, single):
        p.open_call(CallInfo("a"))
        p.open_call(CallInfo("b"))
        p.prefill("b", frames_for(6, 40))
    tokens, hidden = batched.forward(["a", "b"], x)
    tokens_u, hidden_u = single.forward(["a", "b"], x, batched=False)
    assert hidden.shape == (2, 256) and all(0 <= t < 256 for t in tokens)
    assert tokens == tokens_u
    torch.testing.assert_close(hidden, hidden_u, atol=ATOL, rtol=ATOL)
    assert batched.close_call("b") == {"frames": 41}


def test_partition_capacity_is_its_kv_pool() -> None:
    part = TinyDuplexModel(max_calls=3).create_partition("Duplex")
    assert part.capacity() == 3
