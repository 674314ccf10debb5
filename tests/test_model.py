"""The lean MoE forward equals transformers' DeepseekV2/V3 on the same weights: logits within
1e-4 (fp32) for prefill, token-by-token decoding and multi-token blocks after a crop, and the
same greedy tokens as `generate`."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from draftexpert.runtime.experts import HostStore
from draftexpert.runtime.model import KVCache, ModelConfig, MoEModel, from_hf_model, route, router_scores
from draftexpert.speculation.drafters import DraftExperts, draftexpert, top_r

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
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
CASES = {
    "v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(**COMMON, topk_method="greedy")),
    "v2-yarn-qlora": lambda: DeepseekV2ForCausalLM(
        DeepseekV2Config(**{**COMMON, "q_lora_rank": 24}, max_position_embeddings=2048, rope_scaling=YARN)
    ),
    "v3-bias": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(**COMMON, norm_topk_prob=True, routed_scaling_factor=2.5)
    ),
    # group-limited: 4 groups of 4 experts, each token's top-4 from its best 2 groups
    "v3-groups": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(**{**COMMON, "n_group": 4, "topk_group": 2}, norm_topk_prob=True, routed_scaling_factor=2.5)
    ),
}


@pytest.fixture(params=list(CASES))
def pair(request):
    torch.manual_seed(0)
    m = CASES[request.param]().eval()
    if request.param.startswith("v3"):
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)  # a trained model's bias is not zero
    return m, from_hf_model(m)


def test_logits_match_transformers(pair):
    hf, lean = pair
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = KVCache(lean.cfg, 64)
    assert (lean.forward(ids[0], cache) - ref).abs().max() < 1e-4  # prefill
    cache = KVCache(lean.cfg, 64)
    steps = [lean.forward(ids[0, :5], cache)] + [lean.forward(ids[0, i : i + 1], cache) for i in range(5, 12)]
    assert (torch.cat(steps) - ref).abs().max() < 1e-4  # decode one token at a time
    cache.crop(8)  # reject the last 4, then verify them again as one block
    assert cache.length == 8
    assert (lean.forward(ids[0, 8:12], cache) - ref[8:12]).abs().max() < 1e-4


def test_greedy_tokens_match_generate(pair):
    hf, lean = pair
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    want = hf.generate(ids, max_new_tokens=48, do_sample=False)[0, 10:].tolist()
    cache = KVCache(lean.cfg, 64)
    logits, got = lean.forward(ids[0], cache), []
    for _ in range(48):
        got.append(int(logits[-1].argmax()))
        logits = lean.forward(torch.tensor([got[-1]]), cache)
    assert got == want


def test_routing_taps_report_topk_per_moe_layer(pair):
    hf, lean = pair
    lean.forward(torch.tensor([1, 2, 3]), KVCache(lean.cfg, 8))
    assert sorted(lean.last_routing) == [1, 2]
    assert all(t.shape == (3, 4) for t in lean.last_routing.values())


def test_route_top_r():
    cfg2 = ModelConfig.from_hf(DeepseekV2Config(**COMMON))
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    w, idx = route(logits, cfg2, 2)
    s = logits.softmax(-1)
    assert torch.equal(idx.sort(-1).values, s.topk(2, -1).indices.sort(-1).values)
    assert torch.allclose(w, s.gather(-1, idx))  # V2: no renormalisation, scale 1
    cfg3 = ModelConfig.from_hf(DeepseekV3Config(**COMMON, norm_topk_prob=True, routed_scaling_factor=2.5))
    bias = torch.zeros(16)
    bias[7] = 10.0  # the bias alone forces expert 7 into every token's choice ...
    w, idx = route(logits, cfg3, 3, bias)
    assert (idx == 7).any(-1).all()
    assert torch.allclose(w.sum(-1), torch.full((5,), 2.5))  # ... but weights are un-biased, normalised, scaled
    chosen = logits.sigmoid().gather(-1, idx)
    assert torch.allclose(w, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_group_limited_routing_changes_the_choice():
    """The group step of `router_scores` is live (the v3-groups case above would pass without it
    otherwise): on random router logits some tokens' top-4 differ with and without it, and every
    chosen expert lies in one of the token's best 2 groups."""
    cfg = ModelConfig.from_hf(DeepseekV3Config(**{**COMMON, "n_group": 4, "topk_group": 2}, norm_topk_prob=True))
    flat = ModelConfig.from_hf(DeepseekV3Config(**COMMON, norm_topk_prob=True))
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(6)) * 0.05
    grouped, plain = route(logits, cfg, 4, bias)[1], route(logits, flat, 4, bias)[1]
    assert (grouped.sort(-1).values != plain.sort(-1).values).any(-1).sum() > 0
    s, choice = router_scores(logits, cfg, bias)
    best = (s + bias).view(64, 4, 4).topk(2, -1).values.sum(-1).topk(2, -1).indices  # [T, 2] groups
    assert ((grouped // 4)[:, :, None] == best[:, None, :]).any(-1).all()


def test_cache_bounds():
    cfg = ModelConfig.from_hf(DeepseekV2Config(**COMMON))
    cache = KVCache(cfg, 4)
    with pytest.raises(ValueError):
        cache.crop(1)  # nothing to crop yet


def test_unsupported_routing_is_refused():
    with pytest.raises(ValueError, match="group_limited_greedy"):
        ModelConfig.from_hf(DeepseekV2Config(**COMMON, topk_method="group_limited_greedy"))


def _host_model(hf):
    """The lean model over a HostStore: the compiled step fetches through the store (in its op)."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    moe = [i for i in range(hf.config.num_hidden_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in sd]
    return MoEModel(
        hf.config,
        sd,
        HostStore(
            {i: sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] for i in moe},
            {i: sd[f"model.layers.{i}.mlp.experts.down_proj"] for i in moe},
        ),
    )


@pytest.mark.parametrize("store", ["resident", "host"])
@pytest.mark.parametrize("case", ["v2-yarn-qlora", "v3-bias"])
def test_compiled_decode_step_matches_eager(case, store):
    """compile_decode(): the one-token step through torch.compile (one graph; resident experts indexed
    in it, host experts through the store in the op) gives the eager step's logits (1e-4), experts, loads and greedy
    tokens, also on draft paths (top-2, DraftExpert) and after a crop (speculation's pattern)."""
    torch.manual_seed(0)
    hf = CASES[case]().eval()
    make = from_hf_model if store == "resident" else _host_model
    eager, compiled = make(hf), make(hf).compile_decode()
    assert compiled._indexed == (store == "resident")
    moe = [i for i in range(eager.cfg.layers) if eager.cfg.is_moe(i)]
    de = DraftExperts.random(moe, eager.cfg.hidden, 24, seed=3, std=0.1)
    paths = {2: top_r(2, eager.cfg.top_k), 5: draftexpert(eager, de)}
    compiled_paths = {2: paths[2], 5: draftexpert(compiled, de)}
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4))
    ce, cc = KVCache.for_model(eager, 40), KVCache.for_model(compiled, 40)
    assert cc.max_len == 256  # rounded up: few distinct shapes for the compiled step
    eager.forward(ids, ce), compiled.forward(ids, cc)
    tok = int(ids[-1])
    for step in range(12):
        le = eager.forward(torch.tensor([tok]), ce, path=paths.get(step % 6))
        lc = compiled.forward(torch.tensor([tok]), cc, path=compiled_paths.get(step % 6))
        assert (le - lc).abs().max() < 1e-4
        assert eager.last_fetched == compiled.last_fetched
        fe, fc = eager.experts.ledger.forwards[-1], compiled.experts.ledger.forwards[-1]
        assert (fe.requested, fe.loads, fe.bytes) == (fc.requested, fc.loads, fc.bytes)
        if step == 6:
            ce.crop(ce.length - 3), cc.crop(cc.length - 3)
        tok = int(le[-1].argmax())
