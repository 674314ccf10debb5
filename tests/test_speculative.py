"""Exact self-speculative decoding (Algorithm 1): greedy tokens equal AR offload's for every drafter,
store, K_max, controller and prefetch setting (float64, so a multi-token verify pass and one-token
steps cannot round apart); the speculative sampler's token distribution is the target's; the
prefetch and unique-expert accounting add up and match a brute-force recount from transformers."""

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from baselines.ar import AROffloadDecoder
from draftexpert.engines.torch_engine import TorchEngine
from draftexpert.runtime.ggml_kernel import KernelError
from draftexpert.runtime.loader import build_model, convert_experts
from draftexpert.runtime.model import KVCache, from_hf_model
from draftexpert.runtime.oracle import belady_loads
from draftexpert.speculation.drafters import DraftExperts, DraftPath, draftexpert, top_r
from draftexpert.speculation.round import SpecConfig, SpeculativeDecoder
from tests.test_controller import priced

# Weights large enough (initializer_range 0.3) that routed experts move the logits: a drafter that
# drops experts then disagrees with the target often (top-1 acceptance ~0.5, checked below).
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
    initializer_range=0.3,
)
MOE_LAYERS = [1, 2]
DRAFTERS = ["top-1", "top-2", "top-3", "de-zero", "de-random"]


def hf_model(version: str, **over):
    torch.manual_seed(0)
    if version == "v2":
        m = DeepseekV2ForCausalLM(DeepseekV2Config(**{**COMMON, **over}, topk_method="greedy"))
    else:
        m = DeepseekV3ForCausalLM(
            DeepseekV3Config(**{**COMMON, **over}, norm_topk_prob=True, routed_scaling_factor=2.5)
        )
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    m.set_experts_implementation("eager")  # the grouped-mm kernel takes no float64
    return m.eval().double()


@pytest.fixture(scope="module")
def odirect_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    probe = d / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:  # tmpfs refuses O_DIRECT
        d = Path(__file__).resolve().parents[1] / "work" / "pytest-spec"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    return d


@pytest.fixture(scope="module", params=["v2", "v3"])
def models(request, odirect_dir):
    """{store: lean float64 model} over one random checkpoint: resident, host (cg) and flash (mn, f32 GGUF)."""
    hf = hf_model(request.param)
    folder = odirect_dir / request.param
    hf.save_pretrained(folder)
    gguf = convert_experts(folder, odirect_dir / f"{request.param}.gguf", "f32")
    out = {
        "resident": from_hf_model(hf),
        "host": build_model(folder, "host", dtype=torch.float64),
        "flash": build_model(folder, "flash", dtype=torch.float64, gguf_path=gguf),
    }
    yield hf, out
    for m in out.values():
        m.experts.close()


def drafter(model, name: str):
    if name.startswith("top-"):
        return top_r(int(name[4:]), model.cfg.top_k)
    if name == "de-zero":
        de = DraftExperts.zeros(MOE_LAYERS, model.cfg.hidden, 24, dtype=torch.float64)
    else:
        de = DraftExperts.random(MOE_LAYERS, model.cfg.hidden, 24, seed=1, std=0.3, dtype=torch.float64)
    return draftexpert(model, de)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ar_tokens(model, ids, n=24):
    return AROffloadDecoder(TorchEngine(model)).generate(ids, n).tokens


def speculative(model, path, cfg: SpecConfig, trace=None) -> SpeculativeDecoder:
    """The round on the torch engine, the drafter `path` of `model`."""
    return SpeculativeDecoder(TorchEngine(model, path, cfg.draft_cache), cfg, trace=trace)


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_and_k_is_exact(models, name):
    """The grid of the bar on the resident store: K_max ∈ {1,2,4,8} × controller × prefetch × cache."""
    model = models[1]["resident"]
    ids = prompt(0, 9)
    ref = ar_tokens(model, ids)
    path = drafter(model, name)
    for k in (1, 2, 4, 8):
        for truncate in (False, True):
            for prefetch in (False, True):
                cfg = SpecConfig(
                    k_max=k,
                    truncate=truncate,
                    prefetch=prefetch,
                    tau=0.9,
                    budget=2,
                    draft_cache="own" if prefetch else "shared",
                )
                got = speculative(model, path, cfg).generate(ids, 24)
                assert got.tokens == ref, (name, cfg)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    store=st.sampled_from(["resident", "host", "flash"]),
    name=st.sampled_from(DRAFTERS),
    k=st.sampled_from([1, 2, 4, 8]),
    truncate=st.booleans(),
    prefetch=st.booleans(),
    tau=st.floats(0.0, 1.0),
    budget=st.integers(0, 8),
    budget_mode=st.sampled_from(["fixed", "cache"]),
    draft_cache=st.sampled_from(["shared", "own"]),
    seed=st.integers(0, 10_000),
    n=st.integers(1, 20),
    cache_experts=st.sampled_from([0, 0, 5]),
)
def test_speculative_greedy_equals_ar_offload(
    models, store, name, k, truncate, prefetch, tau, budget, budget_mode, draft_cache, seed, n, cache_experts
):
    model = models[1][store]
    if store != "resident":  # cold, or a small LRU cache carried across rounds
        model.experts.capacity = cache_experts
        model.experts.cache.clear()
    ids = prompt(seed, n)
    ref = ar_tokens(model, ids)
    cfg = SpecConfig(
        k_max=k,
        truncate=truncate,
        prefetch=prefetch,
        tau=tau,
        budget=budget,
        budget_mode=budget_mode,
        draft_cache=draft_cache,
    )
    got = speculative(model, drafter(model, name), cfg).generate(ids, 24)
    assert got.tokens == ref
    s = got.stats
    assert s["accepted"] <= s["drafted"] and len(got.tokens) == 24


def test_drafters_are_not_trivially_accepted(models):
    """The exactness tests above must be able to fail: the drafters disagree with the target."""
    model = models[1]["resident"]
    acc = {}
    for name in ("top-1", "top-3", "de-random"):
        outs = [
            speculative(model, drafter(model, name), SpecConfig(k_max=4, truncate=False)).generate(prompt(s, 8), 24)
            for s in range(4)
        ]
        acc[name] = sum(o.stats["accepted"] for o in outs) / sum(o.stats["drafted"] for o in outs)
    assert 0.1 < acc["top-1"] < 0.9 and acc["top-1"] < acc["top-3"], acc
    assert acc["de-random"] < 0.95, acc


def test_zero_draft_expert_is_shared_top1(models):
    model = models[1]["resident"]
    ids = torch.tensor(prompt(3, 10))
    a, b = KVCache.for_model(model, 16), KVCache.for_model(model, 16)
    la = model.forward(ids, a, path=top_r(1, model.cfg.top_k))
    lb = model.forward(ids, b, path=drafter(model, "de-zero"))
    assert torch.allclose(la, lb, atol=1e-12, rtol=0)
    lc = model.forward(ids, KVCache.for_model(model, 16), path=drafter(model, "de-random"))
    assert (lc - la).abs().max() > 1e-3  # a non-zero draft expert does change the draft path


def test_drafter_keeps_the_targets_gate_weights(models):
    """shared + top-k as a 'drafter' (r = k) is the target itself; top-r runs the first r of the
    target's top-k with the target's weights (V3: normalised over the top-k set, not over r)."""
    model = models[1]["resident"]
    ids = torch.tensor(prompt(4, 6))
    full = model.forward(ids, KVCache.for_model(model, 8))
    as_path = model.forward(ids, KVCache.for_model(model, 8), path=DraftPath("top-k", model.cfg.top_k))
    assert torch.equal(full, as_path)


# -- accounting -----------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["host", "flash"])
def test_prefetch_and_unique_accounting(models, store, monkeypatch):
    """issued = hits + waste; hits + misses = verifier experts not resident at verify start; the
    verify pass loads exactly the misses; unique counts equal a brute-force recount — verify from
    transformers' own router, draft from the store's fetch calls."""
    hf, ms = models
    model = ms[store]
    model.experts.capacity = 0
    model.experts.cache.clear()
    fetched = []
    real_fetch = model.experts.fetch_iter  # `fetch` goes through it too
    monkeypatch.setattr(
        model.experts,
        "fetch_iter",
        lambda layer, es, phase="ar": fetched.append((phase, layer, list(es))) or real_fetch(layer, es, phase),
    )
    trace = []
    ids = prompt(5, 12)
    dec = speculative(model, top_r(2, model.cfg.top_k), SpecConfig(k_max=4, tau=0.5, budget=4), trace=trace)
    real_verify = dec.verify
    monkeypatch.setattr(dec, "verify", lambda *a: fetched.append(("verify-starts", None, [])) or real_verify(*a))
    out = dec.generate(ids, 32)
    s, pf = out.stats, out.stats["ledger"]["prefetch"]
    assert pf["issued"] > 0 and pf["hits"] > 0 and pf["misses"] > 0
    assert pf["hits"] + pf["waste"] == pf["issued"]
    verify_fwds = [f for f in model.experts.ledger.forwards if f.phase == "verify"]
    assert len(verify_fwds) == len(trace) == s["rounds"]
    for rnd, fwd in zip(trace, verify_fwds):
        not_resident = rnd["needed"] - rnd["resident"]
        hits, misses = rnd["prefetched"] & rnd["needed"], rnd["needed"] - rnd["resident"] - rnd["prefetched"]
        assert len(hits) + len(misses) == len(not_resident)
        assert fwd.loads == len(misses) and fwd.requested == len(rnd["needed"])
    assert s["verify_unique"] == sum(len(r["needed"]) for r in trace)
    # brute force, verify side: transformers' router over each verify block, position by position
    taps = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: taps.append(o[2]))  # (logits, weights, top-k indices)
        for layer in hf.model.layers[1:]
    ]
    try:
        seq = ids + out.tokens
        for rnd in trace:
            taps.clear()
            with torch.no_grad():
                hf(torch.tensor([seq[: rnd["start"]] + rnd["block"]]))
            brute = set()
            for layer, idx in zip(MOE_LAYERS, taps):
                idx = idx.reshape(-1, model.cfg.top_k)[rnd["start"] :]
                brute |= {(layer, e) for e in idx.unique().tolist()}
            assert brute == rnd["needed"]
    finally:
        for h in hooks:
            h.remove()
    # brute force, draft side: what the store was asked for between verify passes
    rounds, cur = [], set()
    for phase, layer, es in fetched:
        if phase == "verify-starts":
            rounds.append(cur)
            cur = set()
        elif phase == "draft":
            cur |= {(layer, e) for e in es}
    assert rounds == [r["touched"] for r in trace]
    assert s["draft_unique"] == sum(len(r) for r in rounds)


# -- sampling -------------------------------------------------------------------------------


def chi2_p(observed: list[int], expected: list[float]) -> float:
    """Upper-tail p-value of Pearson's χ² (Wilson–Hilferty normal approximation; cells with
    expected counts < 5 are pooled)."""
    obs, exp, po, pe = [], [], 0, 0.0
    for o, e in sorted(zip(observed, expected), key=lambda t: t[1]):
        po, pe = po + o, pe + e
        if pe >= 5:
            obs.append(po)
            exp.append(pe)
            po, pe = 0, 0.0
    if pe > 0 and exp:
        obs[-1] += po
        exp[-1] += pe
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    k = len(obs) - 1
    z = ((chi2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_speculative_sampling_matches_the_target_distribution():
    """Vocabulary of 6: the exact joint distribution of tokens 2–3 under the target (enumerated)
    against 1,200 speculative samples (top-1 drafter, K_max = 2, T = 1); a sampler that emits the
    drafter's tokens unchecked must fail the same test."""
    hf = hf_model("v2", vocab_size=6)
    model = from_hf_model(hf)
    ids, T, N = [1, 4, 2], 1.0, 1200  # the unchecked control fails at p ~ 1e-28 by N = 1000

    def dist(prefix):
        cache = KVCache.for_model(model, 8)
        return torch.softmax(model.forward(torch.tensor(prefix), cache)[-1] / T, -1)

    p0 = dist(ids)
    exact = {}
    for a in range(6):
        p1 = dist(ids + [a])
        for b in range(6):
            p2 = dist(ids + [a, b])
            for c in range(6):
                exact[(b, c)] = exact.get((b, c), 0.0) + float(p0[a] * p1[b] * p2[c])
    cells = sorted(exact)
    dec = speculative(
        model, top_r(1, model.cfg.top_k), SpecConfig(k_max=2, truncate=False, prefetch=False, temperature=T)
    )
    counts = dict.fromkeys(cells, 0)
    draft_only = dict.fromkeys(cells, 0)
    for seed in range(N):
        dec.cfg = SpecConfig(k_max=2, truncate=False, prefetch=False, temperature=T, seed=seed)
        toks = dec.generate(ids, 3).tokens
        counts[tuple(toks[1:3])] += 1
        g = torch.Generator().manual_seed(seed)  # negative control: the drafter's own samples
        dec.engine.start(8)
        d = dec.draft(ids + toks[:1], 2, g)
        draft_only[tuple(d.tokens)] += 1
    expected = [exact[c] * N for c in cells]
    assert chi2_p([counts[c] for c in cells], expected) > 1e-3
    assert chi2_p([draft_only[c] for c in cells], expected) < 1e-6


@pytest.fixture(scope="module", params=["v2", "v3"])
def ggml_models(request, odirect_dir):
    """{flash, resident} lean models over one random checkpoint's Q4_0 experts, computed by ggml's kernels
    on the Q4_0 blocks (`--expert-kernel ggml`); the rest of the model in float64."""
    hf = hf_model(request.param)
    folder = odirect_dir / f"{request.param}-q4"
    hf.save_pretrained(folder)
    gguf = convert_experts(folder, odirect_dir / f"{request.param}-q4.gguf", "q4_0")
    out = {s: build_model(folder, s, dtype=torch.float64, gguf_path=gguf, kernel="ggml") for s in ("flash", "resident")}
    for s in ("flash", "resident"):  # --head-type q4_0: the MLPs and LM head on ggml's kernels too
        out[f"{s}-q4head"] = build_model(
            folder, s, dtype=torch.float64, gguf_path=gguf, kernel="ggml", head_type="q4_0"
        )
    out["folder"] = folder
    yield out
    out.pop("folder")
    for m in out.values():
        m.experts.close()


@pytest.mark.parametrize("name", DRAFTERS)
def test_ggml_expert_kernel_is_exact(ggml_models, name):
    """Experts computed on their Q4_0 blocks: a verify block computes what one-token steps do, so every
    drafter's tokens equal AR's, on the flash store and on the resident bound (which decode the same)."""
    flash, resident = ggml_models["flash"], ggml_models["resident"]
    assert flash.experts.kernel == "ggml" and all(t.dtype == torch.uint8 for t in resident.experts.gate_up.values())
    for seed in (0, 1):
        ids = prompt(seed, 9)
        ref = ar_tokens(flash, ids)
        assert ar_tokens(resident, ids) == ref
        for model in (flash, resident):
            for k, truncate, prefetch in ((4, False, False), (8, True, True), (2, True, False)):
                cfg = SpecConfig(k_max=k, truncate=truncate, prefetch=prefetch, tau=0.9, budget=2)
                assert speculative(model, drafter(model, name), cfg).generate(ids, 24).tokens == ref, (name, k)


@pytest.mark.parametrize("name", DRAFTERS)
def test_q4_0_head_is_exact(ggml_models, name):
    """--head-type q4_0 (shared experts, dense MLP and LM head as Q4_0 blocks on ggml's kernels): a
    different model from the float head's, and every drafter's tokens still equal its AR, on the
    flash store and the resident bound (which decode the same)."""
    flash, resident, float_head = ggml_models["flash-q4head"], ggml_models["resident-q4head"], ggml_models["flash"]
    L = flash.layers
    assert flash.lm_head.dtype == L[0]["dense_gate_up"].dtype == L[1]["shared_down"].dtype == torch.uint8
    ids = prompt(0, 9)
    q4, fp = (TorchEngine(m) for m in (flash, float_head))
    for eng in (q4, fp):
        eng.start(16)
    assert not torch.allclose(q4.prefill(ids), fp.prefill(ids), atol=1e-6)  # the head is quantised
    for seed in (0, 1):
        ids = prompt(seed, 9)
        ref = ar_tokens(flash, ids)
        assert ar_tokens(resident, ids) == ref
        for model in (flash, resident):
            for k, truncate, prefetch in ((4, False, False), (8, True, True)):
                cfg = SpecConfig(k_max=k, truncate=truncate, prefetch=prefetch, tau=0.9, budget=2)
                assert speculative(model, drafter(model, name), cfg).generate(ids, 24).tokens == ref, (name, k)


def test_q4_0_head_refuses_compile(ggml_models):
    with pytest.raises(KernelError, match="--compile"):
        ggml_models["resident-q4head"].compile_decode()


def test_ggml_expert_kernel_refuses_what_it_cannot_compute(ggml_models, odirect_dir):
    """Only Q4_0 experts (an f32 file is refused before loading)."""
    folder = ggml_models["folder"]
    f32 = convert_experts(folder, odirect_dir / f"{folder.name}-f32.gguf", "f32")
    with pytest.raises(KernelError, match="f32 experts"):
        build_model(folder, "flash", gguf_path=f32, kernel="ggml")


def test_compiled_step_with_the_ggml_kernel_is_exact(ggml_models, odirect_dir):
    """--compile with the ggml expert kernel: the compiled one-token step (experts through the op
    `draftexpert::routed_experts`, outside the graph) gives the eager flash model's AR tokens and
    loads, and DraftExpert on it still emits exactly those tokens (its verify runs eager)."""
    folder, eager = ggml_models["folder"], ggml_models["flash"]
    compiled = build_model(
        folder, "flash", dtype=torch.float64, gguf_path=odirect_dir / f"{folder.name}.gguf", kernel="ggml"
    ).compile_decode()
    ids = prompt(0, 9)
    ref = ar_tokens(eager, ids)
    loads = eager.experts.ledger.summary()["total"]["loads"]
    assert ar_tokens(compiled, ids) == ref
    assert compiled.experts.ledger.summary()["total"]["loads"] == loads
    cfg = SpecConfig(k_max=4, truncate=True, prefetch=True, tau=0.9, budget=2)
    assert speculative(compiled, drafter(compiled, "de-random"), cfg).generate(ids, 24).tokens == ref
    # a longer sequence needs a bigger cache (a new static shape): compiled when the engine starts, not
    # inside the decode's timing
    ar = AROffloadDecoder(TorchEngine(compiled))
    long = prompt(1, 300)
    ar.engine.start(ar.positions(len(long), 8))
    assert (ar.engine.cache.max_len, id(None)) in compiled._warm and ar.engine.cache.max_len == 512
    compiled_frames = counters["frames"]["ok"]
    ar.generate(long, 8)
    assert counters["frames"]["ok"] == compiled_frames
    compiled.experts.close()


@pytest.mark.parametrize("store", ["host", "flash"])
@pytest.mark.parametrize("name", ["top-1", "de-random"])
def test_cost_controller_is_exact_whatever_it_decides(models, store, name):
    """Calibrating on its own measurements, then priced so that every round is an AR step, then so
    that every round drafts to K_max: greedy tokens equal AR's throughout."""
    model = models[1][store]
    model.experts.capacity = 0
    model.experts.cache.clear()
    dec = speculative(model, drafter(model, name), SpecConfig(k_max=4, controller="cost"))
    for seed in range(3):
        ids = prompt(seed, 8)
        assert dec.generate(ids, 24).tokens == ar_tokens(model, ids)
    ar = priced(load_s=1.0, draft_s=1.0, verify_s=1e-3, accept=0.01)
    dec.ctl.costs, dec.ctl.acc = ar.costs, ar.acc
    ids = prompt(7, 8)
    out = dec.generate(ids, 24)
    assert out.tokens == ar_tokens(model, ids) and out.stats["cost_ar_rounds"] >= 10
    free = priced(load_s=1e-9, draft_s=1e-9, verify_s=1.0, accept=0.99)
    dec.ctl.costs, dec.ctl.acc = free.costs, free.acc
    out = dec.generate(ids, 24)
    assert out.tokens == ar_tokens(model, ids) and out.stats["cost_ar_rounds"] == 0 and out.stats["truncated"] == 0


@pytest.mark.parametrize("store", ["host", "flash"])
def test_auto_is_exact_whichever_drafter_each_round_takes(models, store):
    """`--method auto`: rounds go to DraftExpert, top-1, top-2 or AR by price (calibration, then the
    priced choice, then each drafter forced in turn): greedy tokens equal AR's throughout, and every
    choice is counted."""
    model = models[1][store]
    model.experts.capacity = 0
    model.experts.cache.clear()
    names = ["de-random", "top-1", "top-2"]
    engine = TorchEngine(model, drafters={n: drafter(model, n) for n in names})
    dec = SpeculativeDecoder(engine, SpecConfig(k_max=4, controller="cost"), drafters=names)
    seen: dict[str, int] = {}
    for seed in range(3):
        ids = prompt(seed, 8)
        out = dec.generate(ids, 24)
        assert out.tokens == ar_tokens(model, ids)
        assert 0 < sum(out.stats["auto_rounds"].values()) <= out.stats["rounds"]  # a round with no room to draft: none
        for k, v in out.stats["auto_rounds"].items():
            seen[k] = seen.get(k, 0) + v
    assert set(names) <= set(seen)  # calibration drafts with each drafter
    for forced in [*names, None]:
        dec.choice.choose = lambda *_, forced=forced: forced
        ids = prompt(11, 8)
        out = dec.generate(ids, 24)
        assert out.tokens == ar_tokens(model, ids), forced
        assert set(out.stats["auto_rounds"]) == {forced or "ar"}
    with pytest.raises(ValueError, match="shared"):
        TorchEngine(model, draft_cache="own", drafters={"top-1": drafter(model, "top-1")})


@pytest.mark.parametrize("store", ["flash"])
def test_under_auto_only_the_drafters_named_prefetch(models, store):
    """`prefetching`: a round of a drafter outside it prefetches nothing (auto's top-r, as the sweep's
    fixed top-r); one inside it prefetches its predicted verify experts; tokens equal AR's either way."""
    model = models[1][store]
    model.experts.capacity = 0
    model.experts.cache.clear()
    names = ["de-random", "top-1"]
    engine = TorchEngine(model, drafters={n: drafter(model, n) for n in names})
    trace: list = []
    dec = SpeculativeDecoder(engine, SpecConfig(k_max=4, controller="cost"), trace, drafters=names,
                             prefetching={"de-random"})  # fmt: skip
    for forced in names:
        dec.choice.choose = lambda *_, forced=forced: forced
        trace.clear()
        ids = prompt(5, 8)
        assert dec.generate(ids, 24).tokens == ar_tokens(model, ids)
        prefetched = sum(len(r["prefetched"]) for r in trace)
        assert (prefetched > 0) == (forced == "de-random"), forced


@pytest.mark.parametrize("store", ["host", "flash"])
def test_the_oracle_replays_what_the_store_was_asked_and_bounds_what_it_moved(models, store, monkeypatch):
    """The ledger's trace is the store's fetch calls, in order; Belady's MIN on it with the run's peak
    memory never loads more than the run moved (on demand + prefetched), with an LRU cache that
    outlives a sequence, with a round's working set, with and without prefetch."""
    model = models[1][store]
    fetched = []
    real_fetch = model.experts.fetch_iter
    monkeypatch.setattr(
        model.experts,
        "fetch_iter",
        lambda layer, es, phase="ar": fetched.append((layer, list(es))) or real_fetch(layer, es, phase),
    )
    try:
        for cache, make in [
            (8, lambda: AROffloadDecoder(TorchEngine(model))),
            (8, lambda: AROffloadDecoder(TorchEngine(model))),  # starts with the last run's cache
            (0, lambda: speculative(model, top_r(2, model.cfg.top_k), SpecConfig(k_max=4, tau=0.5, budget=4))),
            (6, lambda: speculative(model, drafter(model, "de-random"), SpecConfig(k_max=4, prefetch=False))),
        ]:
            model.experts.capacity = cache
            fetched.clear()
            out = make().generate(prompt(7, 10), 20)
            led = out.stats["ledger"]
            oracle, moved = led["oracle"], led["total"]["loads"] + led["prefetch"]["issued"]
            ledger = model.experts.ledger
            assert ledger.trace == [tuple((layer, e) for e in es) for layer, es in fetched]
            assert oracle["requested"] == sum(p["requested"] for ph, p in led["by_phase"].items() if ph != "prefill")
            assert oracle["capacity"] >= cache and 0 < oracle["loads"]
            decode_moved = moved - led["by_phase"]["prefill"]["loads"]
            assert oracle["loads"] <= decode_moved, (cache, oracle, decode_moved)
            again = belady_loads(ledger.trace, oracle["capacity"], ledger.trace_decode, ledger.initial)
            assert again == oracle["loads"]
    finally:
        model.experts.capacity = 0
        model.experts.cache.clear()
