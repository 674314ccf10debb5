"""Expert-offload runtime: every store and the streaming loader give the transformers model's
logits (1e-4, fp32) and greedy tokens; the ledger counts loads; bad files give clear errors."""

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from baselines.ar import AROffloadDecoder
from bench.cells.cell import Cell
from bench.cells.decoders import make_decoder
from draftexpert.engines.llamacpp import ExpertPages
from draftexpert.engines.torch_engine import TorchEngine, layer_experts
from draftexpert.runtime import gguf_decode
from draftexpert.runtime.checkpoint import write_dense_counterpart
from draftexpert.runtime.ggml_kernel import KernelError, expert_mlp, q4_0_linear, quantize_q4_0, resolve_kernel
from draftexpert.runtime.gguf_decode import decode
from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.gguf_layout import ExpertFileError
from draftexpert.runtime.ledger import Ledger
from draftexpert.runtime.loader import (
    Checkpoint,
    CheckpointError,
    build_model,
    convert_experts,
    fill_host_pool,
    load_config,
    pool_dtype,
    routed_experts,
)
from draftexpert.runtime.model import KVCache
from draftexpert.speculation.drafters import make_draft_path
from draftexpert.speculation.round import SpecConfig, SpeculativeDecoder

REPO = Path(__file__).resolve().parents[1]
COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_shared_experts=2,
    num_experts_per_tok=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A folder on a file system that takes O_DIRECT (tmpfs does not): the repo's work/ if /tmp refuses."""
    d = tmp_path_factory.mktemp("odirect")
    probe = d / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return d
    except OSError:
        d = REPO / "work" / "pytest-odirect"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d


@pytest.fixture(scope="module", params=["v2", "v3"])
def checkpoint(request, disk):
    """A random tiny model saved in several safetensors shards, plus its f32 GGUF expert file."""
    torch.manual_seed(0)
    if request.param == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**COMMON, topk_method="greedy")).eval()
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, norm_topk_prob=True, routed_scaling_factor=2.5)).eval()
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    folder = disk / f"ckpt-{request.param}"
    model.save_pretrained(folder, max_shard_size="300KB")
    assert len(list(folder.glob("*.safetensors"))) > 2  # the loader must stitch shards
    return model, folder, convert_experts(folder, disk / f"{request.param}-f32.gguf", "f32")


PROMPTS = [
    torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 12, 2, 5, 9, 16, 4, 11, 20)
]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' prompt logits and 64-token greedy continuation (to EOS, as generate stops) per prompt."""
    hf = checkpoint[0]
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            out.append(
                (
                    hf(ids[None]).logits[0],
                    hf.generate(ids[None], max_new_tokens=64, do_sample=False)[0, len(ids) :].tolist(),
                )
            )
    return out


# `make gpu-check` sets cuda: the same exactness on the GPU (the cg path: pinned pool, copy stream, events).
DEVICE = os.environ.get("DRAFTEXPERT_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("store", ["resident", "host", "flash", "flash-odirect"])
def test_every_store_matches_transformers(checkpoint, reference, store):
    """10 prompts: prompt logits within 1e-4, and identical 64-token greedy continuations (the flash
    store with either staging)."""
    hf, folder, gguf = checkpoint
    store, _, staging = store.partition("-")
    lean = build_model(folder, store, device=DEVICE, gguf_path=gguf, staging=staging or "demand")
    for ids, (ref_logits, want) in zip(PROMPTS, reference):
        assert (lean.forward(ids, KVCache.for_model(lean, 128)).cpu() - ref_logits).abs().max() < 1e-4
        out = AROffloadDecoder(TorchEngine(lean)).generate(ids.tolist(), 64, hf.generation_config.eos_token_id)
        assert out.tokens == want
    lean.experts.close()


def test_ledger_counts_cold_loads(checkpoint):
    _, folder, gguf = checkpoint
    lean = build_model(folder, "flash", gguf_path=gguf)
    out = AROffloadDecoder(TorchEngine(lean)).generate(PROMPTS[1].tolist(), 8)
    led = out.stats["ledger"]
    ar = led["by_phase"]["ar"]
    # cold setting: every decode step loads each MoE layer's top-k (one token: all unique)
    assert ar["forwards"] == 7 and ar["requested"] == ar["loads"] == 7 * 2 * 4
    expert_bytes = 3 * 64 * 32 * 4  # gate_up, down of one f32 expert
    assert ar["bytes"] == ar["loads"] * expert_bytes
    assert 0 < ar["stall_s"] < ar["wall_s"]
    assert set(led["per_layer"]) == {"1", "2"}
    lean.experts.close()


def test_demand_staging_reads_every_expert_whole_and_leaves_nothing_cached(checkpoint):
    """Default flash staging: a step's experts are all requested before any is waited for, each read
    whole (its two ranges), and after every AR step and every round no page of the file is cached
    (the cold setting: the next load reads the disk); prefetches no forward used leave with the round."""
    _, folder, gguf = checkpoint
    lean = build_model(folder, "flash", gguf_path=gguf)
    pages, events = ExpertPages(gguf), []
    file = lean.experts.file
    advise, read = file.advise, file.read_expert_cached
    file.advise = lambda layer, e: (events.append(("advise", layer, e)), advise(layer, e))[1]  # noqa: E731
    file.read_expert_cached = lambda layer, e: (events.append(("read", layer, e)), read(layer, e))[1]  # noqa: E731
    lean.experts.fetch(1, [3, 5, 7])
    assert events == [("advise", 1, e) for e in (3, 5, 7)] + [("read", 1, e) for e in (3, 5, 7)]
    assert pages.cached_pages() > 0  # read through the page cache ...
    lean.experts.end_forward()
    assert pages.cached_pages() == 0  # ... and dropped after the step
    AROffloadDecoder(TorchEngine(lean)).generate(PROMPTS[1].tolist(), 4)
    assert pages.cached_pages() == 0
    lean.experts.begin_block()
    lean.experts.prefetch(2, [1, 2, 3])  # readahead nothing will wait for
    lean.experts.end_block()
    assert pages.cached_pages() == 0 and not lean.experts.inflight
    path = make_draft_path(lean, "top-r", r=1)
    SpeculativeDecoder(TorchEngine(lean, path), SpecConfig(k_max=3)).generate(PROMPTS[1].tolist(), 8)
    assert pages.cached_pages() == 0
    pages.close()
    lean.experts.close()


def test_cache_keeps_experts_between_forwards(checkpoint):
    _, folder, gguf = checkpoint
    lean = build_model(folder, "host", gguf_path=gguf, cache_experts=32)  # every expert fits
    AROffloadDecoder(TorchEngine(lean)).generate(PROMPTS[2].tolist(), 16)
    s = lean.experts.ledger.summary()["total"]
    assert s["loads"] <= 32 and s["hits"] > 0


def test_quantised_store_equals_model_with_dequantised_experts(checkpoint, disk):
    """Q4_0 / bf16 files: the runtime computes exactly the model whose experts are the file's values."""
    hf, folder, _ = checkpoint
    for qtype in ("q4_0", "bf16"):
        gguf = convert_experts(folder, disk / f"{folder.name}-{qtype}.gguf", qtype)
        lean = build_model(folder, "flash", gguf_path=gguf)
        f = ExpertFile(gguf)
        ref_model = type(hf)(hf.config).eval()
        ref_model.load_state_dict(hf.state_dict())
        for layer in f.layers:
            exp = ref_model.model.layers[layer].mlp.experts
            for e in range(exp.gate_up_proj.shape[0]):
                gu, dn = f.dequantize(f.read_expert(layer, e), "cpu", torch.float32)
                exp.gate_up_proj.data[e], exp.down_proj.data[e] = gu, dn
        ids = PROMPTS[2]
        with torch.no_grad():
            ref = ref_model(ids[None]).logits[0]
        assert (lean.forward(ids, KVCache(lean.cfg, 64)) - ref).abs().max() < 1e-4
        f.close()
        lean.experts.close()


def test_q4_0_dequantisers_agree_with_the_gguf_reference():
    """ggml's dequantize_row_q4_0 (the store's fast path) and the torch fallback both equal the gguf
    package's reference dequantisation, bit for bit, on random blocks (random scales included)."""
    rows, cols = 64, 256
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
    blocks[..., :2] = rng.normal(0, 0.02, (rows, cols // 32)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    buf = bytearray(blocks.tobytes())
    want = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_0).copy())
    assert torch.equal(decode(buf, 0, len(buf), "q4_0", (rows, cols), "cpu", torch.float32, use_ggml=False), want)
    if gguf_decode._Q4_0 is None:
        pytest.skip("llama-cpp-python is not installed: no ggml dequantiser to compare")
    assert torch.equal(decode(buf, 0, len(buf), "q4_0", (rows, cols), "cpu", torch.float32), want)


def test_truncated_and_corrupt_gguf_name_the_file(checkpoint, disk):
    _, _, gguf = checkpoint
    cut = disk / "truncated.gguf"
    data = gguf.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExpertFileError, match="truncated"):
        ExpertFile(cut)
    junk = disk / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(ExpertFileError, match="junk.gguf"):
        ExpertFile(junk)
    with pytest.raises(ExpertFileError, match="no such expert file"):
        ExpertFile(disk / "absent.gguf")


def test_bad_checkpoints_are_refused_clearly(checkpoint, disk):
    _, folder, _ = checkpoint
    broken = disk / "broken"
    shutil.copytree(folder, broken, dirs_exist_ok=True)
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=shard.name):
        build_model(broken, "resident")
    other = disk / "llama"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="not supported"):
        build_model(other, "resident")
    with pytest.raises(CheckpointError, match="no config.json"):
        build_model(disk / "nowhere", "resident")


def test_odirect_refusal_is_explained(checkpoint, monkeypatch):
    _, _, gguf = checkpoint
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ExpertFileError, match="does not support direct I/O"):
        ExpertFile(gguf)


def test_temperature_sampling_is_seeded(checkpoint):
    _, folder, _ = checkpoint
    lean = build_model(folder, "resident")
    a = AROffloadDecoder(TorchEngine(lean), temperature=0.8, seed=3).generate(PROMPTS[0].tolist(), 16).tokens
    b = AROffloadDecoder(TorchEngine(lean), temperature=0.8, seed=3).generate(PROMPTS[0].tolist(), 16).tokens
    c = AROffloadDecoder(TorchEngine(lean), temperature=0.8, seed=4).generate(PROMPTS[0].tolist(), 16).tokens
    assert a == b and a != c


def test_staging_budget_keeps_raw_experts_in_dram(checkpoint):
    _, folder, gguf = checkpoint
    lean = build_model(folder, "flash", gguf_path=gguf, staging_budget_bytes=1 << 30)
    dec = AROffloadDecoder(TorchEngine(lean))
    first = dec.generate(PROMPTS[1].tolist(), 8)
    second = dec.generate(PROMPTS[1].tolist(), 8)
    assert first.tokens == second.tokens
    a, b = first.stats["ledger"]["total"], second.stats["ledger"]["total"]
    assert a["bytes"] > 0 and b["bytes"] == 0 and b["loads"] == a["loads"]  # loaded from DRAM, not the file
    lean.experts.close()


def test_prefetch_then_fetch_never_deadlocks(checkpoint):
    _, folder, gguf = checkpoint
    lean = build_model(folder, "flash", gguf_path=gguf, io_threads=2)
    store = lean.experts
    assert store.prefetch(1, list(range(16))) == list(range(16))  # more loads in flight than staging buffers
    assert store.prefetch(1, [0, 1]) == []  # in flight already: not started twice
    got = store.fetch(2, [3, 5, 7])  # another layer while layer 1 is still loading
    assert len(got) == 3
    got = store.fetch(1, [0, 15])  # prefetched: waited for, not reloaded
    assert len(got) == 2 and not store.inflight.keys() - {(1, e) for e in range(16)}
    store.close()


def test_the_host_pool_is_one_exact_buffer_filled_from_the_shards(checkpoint, tmp_path):
    """cg's host pool: one buffer of exactly the routed experts' bytes, in the checkpoint's dtype, filled
    expert by expert (per-expert tensors) or layer by layer (fused gate_up_proj) — the same numbers."""
    _, folder, _ = checkpoint
    ckpt, cfg = Checkpoint(folder), load_config(folder)
    layers = range(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    stored = ckpt.dtype(f"model.layers.{layers[0]}.mlp.experts.0.gate_proj.weight")
    assert pool_dtype(ckpt, cfg, torch.float32) == stored and pool_dtype(ckpt, cfg, torch.bfloat16) == torch.bfloat16
    pool = fill_host_pool(ckpt, cfg, stored)
    E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert pool.nbytes == len(layers) * E * 3 * H * inter * stored.itemsize  # exact: no rounding, no padding
    expected = {layer: (gu, dn) for layer, gu, dn in routed_experts(ckpt, cfg)}
    for layer in layers:
        assert pool.gate_up[layer].data_ptr() >= pool.flat.data_ptr()  # views of the one buffer
        assert torch.equal(pool.gate_up[layer], expected[layer][0])
        assert torch.equal(pool.down[layer], expected[layer][1])
    fused = {k: ckpt.get(k) for k in ckpt.keys() if ".mlp.experts." not in k}
    for layer in layers:
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = expected[layer][0].contiguous()
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = expected[layer][1].contiguous()
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    again = fill_host_pool(Checkpoint(tmp_path / "fused"), cfg, stored)
    assert torch.equal(again.flat, pool.flat)
    if DEVICE == "cuda":  # page-locked in place, exact size
        again.pin()
        assert again.flat.is_pinned()
        again.unpin()


def test_bf16_compute_is_the_same_model_on_every_store(tiny_checkpoint):
    """--dtype bf16: the host pool keeps the checkpoint's dtype and converts on the accelerator after the
    copy, so cg's AR is the resident model's AR in bf16, token for token."""
    ids = [1, 5, 9, 13, 17, 21, 25]
    out = {}
    for platform, dtype in (("cg", "bf16"), ("resident", "bf16"), ("resident", "fp32")):
        dec, _, cfg = make_decoder(
            Cell(
                method="ar",
                platform=platform,
                device="cpu" if platform == "cg" else None,
                dtype=dtype,
                max_new_tokens=24,
            ),
            tiny_checkpoint,
        )
        out[platform, dtype] = dec.generate(ids, 24).tokens
        assert cfg.method_args.get("dtype") == (None if dtype == "fp32" else "bf16")  # fp32 cells keep their keys
        dec.close()
    assert out["cg", "bf16"] == out["resident", "bf16"]


def test_a_block_forward_reads_back_once_per_moe_layer(checkpoint, monkeypatch):
    """Host syncs on the hot path: a multi-token forward reads the routing back once per MoE layer (what
    to fetch), never per expert; the engine's expert sets once per call, for all layers."""
    _, folder, _ = checkpoint
    model = build_model(folder, "host")
    calls = {"tolist": 0, "nonzero": 0, "item": 0}
    for name in calls:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    cache = KVCache.for_model(model, 16)
    model.forward(torch.arange(1, 9), cache, phase="verify")
    moe_layers = model.cfg.layers - model.cfg.first_dense
    assert calls == {"tolist": moe_layers, "nonzero": 0, "item": 0}, calls
    calls.update(tolist=0)
    assert layer_experts(model.last_routing) and calls["tolist"] == 1
    model.experts.close()


@pytest.mark.parametrize("store", ["host", "flash"])
def test_a_bounded_working_set_stays_exact_and_within_its_bytes(checkpoint, store):
    """--working-set: a round keeps at most that many bytes of experts on the accelerator (the least
    recently used dropped, reloaded on demand; prefetch holds back) — the same tokens, more loads."""
    _, folder, gguf = checkpoint
    conf = SpecConfig(k_max=4, truncate=False, prefetch=True)
    runs = {}
    for budget in (0, 12):  # 12 experts: below one round's union, above one layer's block of 5 × top-4
        model = build_model(folder, store, gguf_path=gguf, dtype=torch.float64)
        one = 3 * model.cfg.hidden * model.cfg.moe_inter * 8
        model.experts.working_set_bytes = budget * one
        dec = SpeculativeDecoder(TorchEngine(model, make_draft_path(model, "top-r", r=1)), conf)
        out = [dec.generate(ids.tolist(), 24) for ids in PROMPTS[:4]]
        runs[budget] = (
            [o.tokens for o in out],
            sum(o.stats["ledger"]["total"]["loads"] for o in out),
            model.experts.peak_block_bytes / one,
        )
        dec.close()
    (free_tokens, free_loads, free_peak), (tokens, loads, peak) = runs[0], runs[12]
    assert tokens == free_tokens and free_peak > 12 >= peak and loads > free_loads, (free_peak, peak, free_loads, loads)


def test_the_ledger_times_gpu_waits_with_their_events():
    """On CUDA the compute stream waits on a copy's event (the host does not block): the ledger adds
    done − needed of each wait (never negative) to the forward's and the layer's stall when it ends."""

    class Event:  # the two methods of torch.cuda.Event the ledger uses, with a clock in ms
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, end):
            return end.t - self.t

    ledger, syncs = Ledger(), []
    ledger._sync = lambda: syncs.append(1)
    ledger.record_gpu_wait(3, Event(0.0), Event(9.0))  # outside a forward: not counted
    with ledger.forward("verify", 4):
        ledger.record(3, 6, 6, 100, 0.0)
        ledger.record_gpu_wait(3, Event(10.0), Event(12.5))  # the copy landed 2.5 ms after it was needed
        ledger.record_gpu_wait(4, Event(20.0), Event(19.0))  # landed before: no stall
    rec = ledger.forwards[-1]
    assert rec.stall_s == pytest.approx(0.0025) and rec.per_layer[3]["stall_s"] == pytest.approx(0.0025)
    assert rec.per_layer[4]["stall_s"] == 0 and len(syncs) == 2  # clocks synchronised at start and end


def test_the_dense_counterpart_moves_an_ar_steps_bytes_for_any_block(checkpoint, tmp_path):
    """Fig. 4's dense half: each MoE layer's routed experts become one FFN of the active routed
    width, offloaded through the same store — a one-token forward moves what the MoE's moves, and
    a block of L tokens moves no more (the MoE's union grows)."""
    folder = checkpoint[1]
    moe, dense = build_model(folder, "host"), build_model(write_dense_counterpart(folder, tmp_path / "dense"), "host")
    k, moe_layers = COMMON["num_experts_per_tok"], COMMON["num_hidden_layers"] - COMMON["first_k_dense_replace"]
    assert dense.cfg.n_experts == 1 and dense.cfg.moe_inter == k * COMMON["moe_intermediate_size"]

    def cold_forward(model, L):
        model.experts.cache.clear()
        logits = model.forward(torch.arange(5, 5 + L), KVCache.for_model(model, 16), phase="verify")
        assert torch.isfinite(logits).all()
        return model.experts.ledger.forwards[-1]

    one = cold_forward(moe, 1)
    assert one.loads == k * moe_layers
    for L in (1, 3, 8):
        rec = cold_forward(dense, L)
        assert (rec.loads, rec.bytes) == (moe_layers, one.bytes)
    assert cold_forward(moe, 8).bytes > one.bytes


def test_flash_store_decodes_into_reused_buffers_only_once_nothing_holds_them(checkpoint):
    """The CPU flash store decodes each load into a buffer of its `ExpertBuffers`: a dropped
    expert's memory is the next load's (glibc would keep it, fragmented, outside the plan), an
    expert — or any view of it — still held is never overwritten, and the pool is the peak of
    live experts. The weights are those of a fresh decode."""
    _, folder, gguf = checkpoint
    model = build_model(folder, "flash", gguf_path=gguf, dtype=torch.float32)
    store, ref = model.experts, ExpertFile(gguf, staging_buffers=1)
    fresh = lambda key: ref.dequantize(ref.read_expert(*key), "cpu", torch.float32)  # noqa: E731
    held = store.fetch(1, [0, 1])  # kept: must never be reused
    view = store.fetch(1, [2])[0][1][:3]  # only a view of expert 2's down kept: its buffers stay taken
    ptrs = {t.data_ptr() for w in held for t in w}
    for e in range(3, 16):  # one at a time, each dropped at once: one pair of buffers serves them all
        ((gu, dn),) = store.fetch(2, [e])
        assert torch.equal(gu, fresh((2, e))[0]) and torch.equal(dn, fresh((2, e))[1])
        assert not ptrs & {gu.data_ptr(), dn.data_ptr()}
        del gu, dn
    assert all(torch.equal(a, b) for w, e in zip(held, [0, 1]) for a, b in zip(w, fresh((1, e))))
    assert torch.equal(view, fresh((1, 2))[1][:3])
    gu, dn = (t.nbytes for t in held[0])
    # one buffer per expert (gate_up and down are views of it): experts 0 and 1 held, 2 held by the view of its
    # down, one buffer reused 13 times
    assert store.buffers.nbytes == 4 * (gu + dn)
    del held, view
    store.fetch(1, list(range(4)))  # four live at once: the freed buffers serve them, one gate_up more
    assert store.buffers.nbytes == 4 * (gu + dn) and store.buffers.in_use_bytes() == 0
    ref.close()
    model.experts.close()


@pytest.mark.parametrize("store", ["host", "flash"])
def test_a_bounded_round_counts_its_loads_in_flight(checkpoint, store):
    """With a working-set bound, what a round holds — finished experts and the loads in flight,
    prefetches and a verify layer's demand loads alike — stays within it plus one layer's demand
    loads (the store drops the round's older experts to make room for them before they start)."""
    _, folder, gguf = checkpoint
    model = build_model(folder, store, gguf_path=gguf, dtype=torch.float64)
    s = model.experts
    one = 3 * model.cfg.hidden * model.cfg.moe_inter * 8
    s.working_set_bytes = 17 * one  # above one verify layer's 16 experts (5 × top-4, at most E), below a round's union
    held, start = [], s._start

    def counted(key, demand=True):
        if s.block is not None and s._one_expert:
            held.append(s.block_bytes + (len(s.inflight) + 1) * s._one_expert)
        return start(key, demand)

    s._start = counted
    dec = SpeculativeDecoder(
        TorchEngine(model, make_draft_path(model, "top-r", r=1)), SpecConfig(k_max=4, truncate=False, prefetch=True)
    )
    for ids in PROMPTS[:3]:
        dec.generate(ids.tolist(), 16)
    dec.close()
    # the budget, and at most one verify layer's demand loads beside it (what the plan counts besides
    # the bound: prefetches in flight cannot be dropped), never more
    layer = min(model.cfg.n_experts, 5 * model.cfg.top_k) * one
    assert held and max(held) <= s.working_set_bytes + layer, (max(held) / one, len(held))
    assert s.peak_block_bytes <= s.working_set_bytes


def _q4_0_expert(H: int, inter: int, seed: int = 0):
    """A random Q4_0 expert as the ggml kernel takes it (uint8 rows of blocks) and dequantised (fp32)."""
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        nb = rows * cols // 32
        raw = np.zeros((nb, 18), np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(rng.standard_normal(nb) * 0.05).tobytes(), np.uint8).reshape(nb, 2)
        raw[:, 2:] = rng.integers(0, 256, (nb, 16))
        raw = raw.reshape(rows, cols // 32 * 18)
        return torch.from_numpy(raw), decode(
            bytearray(raw.tobytes()), 0, raw.size, "q4_0", (rows, cols), "cpu", torch.float32
        )

    (gu, gu_f), (dn, dn_f) = matrix(2 * inter, H), matrix(H, inter)
    return gu, dn, gu_f, dn_f


def test_ggml_expert_kernel_is_row_invariant_and_close_to_the_dequantised_mlp():
    """Each output row is what that row alone gives (one row or a block, one thread or several: verify =
    one-token steps), and within Q8_0 activation rounding of the fp32 MLP of the dequantised weights."""
    H, inter = 64, 32
    gu, dn, gu_f, dn_f = _q4_0_expert(H, inter)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(0))
    y = expert_mlp(x, gu, dn)
    assert torch.equal(torch.cat([expert_mlp(x[i : i + 1], gu, dn) for i in range(40)]), y)
    assert torch.equal(expert_mlp(x[:5], gu, dn), y[:5])
    g, u = F.linear(x, gu_f).chunk(2, dim=-1)
    want = F.linear(F.silu(g) * u, dn_f)
    err = ((y - want).norm() / want.norm()).item()
    assert 0 < err < 0.03  # Q8_0 rounding of the activations: near, never identical
    assert expert_mlp(x.double(), gu, dn).dtype == torch.float64


def test_q4_0_linear_is_row_invariant_and_close_to_the_float_matmul():
    """`--head-type q4_0`'s matmul: a float matrix quantised (gguf's quantiser) and multiplied on its
    blocks gives each row what that row alone gives, near the float product; a row length that is
    not whole blocks is refused."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(80, 64, generator=g), torch.randn(12, 64, generator=g)
    q = quantize_q4_0(w)
    assert q.dtype == torch.uint8 and q.shape == (80, 64 // 32 * 18)
    assert torch.equal(quantize_q4_0(w, rows_at_once=7), q)  # rows are quantised on their own
    y = q4_0_linear(x, q)
    assert torch.equal(torch.cat([q4_0_linear(x[i : i + 1], q) for i in range(12)]), y)
    want = x @ w.T
    assert 0 < ((y - want).norm() / want.norm()).item() < 0.1  # Q4_0 weights, Q8_0 activations
    with pytest.raises(KernelError, match="whole 32-weight blocks"):
        quantize_q4_0(torch.randn(4, 48))


def test_ggml_expert_kernel_refusals():
    """No backward (distillation keeps the dequantising kernel), Q4_0 on a CPU only."""
    gu, dn, _, _ = _q4_0_expert(64, 32)
    with pytest.raises(KernelError, match="no backward"):
        expert_mlp(torch.randn(1, 64, requires_grad=True), gu, dn)
    with pytest.raises(KernelError, match="Q4_0 experts on the CPU"):
        resolve_kernel("ggml", "bf16", "cpu")
    with pytest.raises(KernelError, match="Q4_0 experts on the CPU"):
        resolve_kernel("ggml", "q4_0", "cuda")
    with pytest.raises(KernelError, match="is not one of"):
        resolve_kernel("fast", "q4_0", "cpu")
    assert resolve_kernel("auto", "q4_0", "cpu") == "ggml"
    assert resolve_kernel("auto", "bf16", "cpu") == resolve_kernel("auto", "q4_0", "cuda") == "dequant"
