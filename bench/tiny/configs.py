"""Shapes of the embedded tiny targets. Routing structure is DeepSeek-V2-Lite's / Moonlight's
exactly (64 routed + 2 shared experts, top-6, first layer dense, MLA with q_lora_rank null);
only the dimensions are small. Why these dimensions: see `models/<name>/README.md`.

hidden 96, moe_intermediate 96: one routed expert is 3·96·96 = 27,648 parameters, 54 KiB in bf16
(15 KiB in Q4_0); a decoded token loads 6 per MoE layer × 5 MoE layers = 30 experts = 1.6 MiB bf16.
Routed experts: 5·64 = 320 experts = 8.8M of 9.8M parameters (18.7 MiB bf16, so a target and its
draft experts stay under 20 MiB and travel to an accelerator machine). The routed experts carry
46% of what a token reads (DeepSeek-V2-Lite: 55%, Moonlight: 52%; `bench params`): the vocabulary
(4,096, tied embeddings) and attention (4 heads, kv_lora 32) are what keep it from more. Every
dimension is a multiple of 32, Q4_0's block. The shape before (hidden 256, moe_intermediate 128,
36.7M parameters, 70 MiB) trained at ~1,500 tokens/s on this 2-core machine class against ~6,000
for this one (2 threads, batch 8 × 512).
"""

from __future__ import annotations

from transformers import DeepseekV2Config, DeepseekV3Config

COMMON = dict(
    vocab_size=4096,
    hidden_size=96,
    intermediate_size=384,  # the dense first layer
    moe_intermediate_size=96,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    initializer_range=0.02,
)


def ds_tiny() -> DeepseekV2Config:
    """DeepSeek-V2 routing: softmax over 64 experts, greedy top-6, no renormalisation, routed output
    scaled by DeepSeek-V2's 16.0. (V2-Lite ships 1.0; at this size and scale 1 the routed experts
    carried Σ top-6 weights ≈ 0.24 of a token — routed output norm below the shared experts' — so a
    shared+top-1 draft was accepted 79% at K = 4, far from the paper's 22.5%. Moonlight's routing
    gives its routed experts 2.446 per token; V2's 16 × ≈0.24 gives ≈ 3.8.)"""
    return DeepseekV2Config(
        **COMMON,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )


def ml_tiny() -> DeepseekV3Config:
    """Moonlight routing: sigmoid scores + correction bias choose the top-6 (one group), weights
    are the un-biased sigmoid scores, normalised, times the routed scaling factor 2.446."""
    cfg = DeepseekV3Config(
        **COMMON,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
    )
    return cfg


TINY_CONFIGS = {"ds-tiny": ds_tiny, "ml-tiny": ml_tiny}

# transformers' DeepseekV3Config drops these on save; llama.cpp's converter needs scoring_func
# (without it llama.cpp routes with softmax). Written back into config.json after saving.
V3_KEYS_TO_KEEP = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
