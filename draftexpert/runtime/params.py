"""Parameter breakdown of a DeepseekV2/V3 MoE from its config alone (the paper's Fig. 1a).

Counts follow the tensors of transformers' DeepseekV2/V3 classes (and of the checkpoints):
  attention (MLA), per layer:
    q:  q_lora_rank null → q_proj  H · n_h·(d_nope + d_rope)
        else             → q_a_proj H·r_q + q_a_layernorm r_q + q_b_proj r_q · n_h·(d_nope + d_rope)
    kv_a_proj_with_mqa H·(r_kv + d_rope) + kv_a_layernorm r_kv + kv_b_proj r_kv · n_h·(d_nope + d_v)
    o_proj n_h·d_v · H
  dense MLP (layers < first_k_dense_replace): 3 · H · I
  MoE layer: routed experts E · 3 · H · I_moe; shared experts 3 · H · (n_shared · I_moe);
             router E · H (+ E correction-bias entries for V3's noaux_tc)
  norms: 2·H per layer + H final; embedding V·H; lm_head V·H unless tied.
Bytes: bf16 = 2 B/param. Q4_0 = 18 B per 32 weights (4.5 bits) for every matrix, vectors kept
f32 (4 B) as llama.cpp keeps norms; real GGUF files may keep a few matrices at higher precision.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 1 << 30
Q4_0_BYTES_PER_WEIGHT = 18 / 32


@dataclass
class Breakdown:
    embedding: int = 0
    lm_head: int = 0
    attention: int = 0
    dense_mlp: int = 0
    shared_experts: int = 0
    router: int = 0
    norms: int = 0
    routed_experts: int = 0
    vectors: int = 0  # of the above, 1-D tensors (norms, router bias): kept f32 in Q4_0 files
    routed_expert_params_each: int = 0
    n_routed_experts_total: int = 0  # MoE layers × experts per layer

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp + self.shared_experts
                + self.router + self.norms + self.routed_experts)

    @property
    def non_routed(self) -> int:
        return self.total - self.routed_experts

    def summary(self) -> dict:
        """Counts, shares and sizes; `*_gib_bf16` = params · 2 / 2^30,
        `*_gib_q4_0` = (matrix params · 18/32 + vector params · 4) / 2^30."""
        nr_vec = self.vectors
        out = {k: v for k, v in asdict(self).items()}
        out.update({
            "total": self.total,
            "non_routed": self.non_routed,
            "routed_share": self.routed_experts / self.total,
            "routed_gib_bf16": 2 * self.routed_experts / GIB,
            "non_routed_gib_bf16": 2 * self.non_routed / GIB,
            "routed_gib_q4_0": self.routed_experts * Q4_0_BYTES_PER_WEIGHT / GIB,
            "non_routed_gib_q4_0": ((self.non_routed - nr_vec) * Q4_0_BYTES_PER_WEIGHT + 4 * nr_vec) / GIB,
            "routed_expert_mib_bf16": 2 * self.routed_expert_params_each / (1 << 20),
            "routed_expert_mib_q4_0": self.routed_expert_params_each * Q4_0_BYTES_PER_WEIGHT / (1 << 20),
        })
        return out


def is_moe_layer(cfg: dict, layer: int) -> bool:
    return (cfg.get("n_routed_experts") is not None and layer >= cfg.get("first_k_dense_replace", 0)
            and layer % cfg.get("moe_layer_freq", 1) == 0)


def breakdown(cfg: dict) -> Breakdown:
    """Parameter counts of a DeepseekV2/V3 config (a config.json as a dict)."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    d_nope, d_rope, d_v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r_q, r_kv = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    b = Breakdown()
    b.embedding = V * H
    b.lm_head = 0 if cfg.get("tie_word_embeddings") else V * H
    b.norms = H  # final norm
    q_out = nh * (d_nope + d_rope)
    attn = H * (r_kv + d_rope) + r_kv * nh * (d_nope + d_v) + nh * d_v * H
    attn_vec = r_kv
    if r_q:
        attn += H * r_q + r_q * q_out
        attn_vec += r_q
    else:
        attn += H * q_out
    v3_bias = cfg.get("topk_method") == "noaux_tc" or cfg.get("model_type") == "deepseek_v3"
    for layer in range(L):
        b.attention += attn + attn_vec
        b.norms += 2 * H
        b.vectors += attn_vec + 2 * H
        if is_moe_layer(cfg, layer):
            E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            b.routed_experts += E * 3 * H * I
            b.n_routed_experts_total += E
            b.shared_experts += 3 * H * cfg.get("n_shared_experts", 0) * I
            b.router += E * H + (E if v3_bias else 0)
            b.vectors += E if v3_bias else 0
            b.routed_expert_params_each = 3 * H * I
        else:
            b.dense_mlp += 3 * H * cfg["intermediate_size"]
    b.vectors += H
    return b


class WontFit(ValueError):
    """A model that cannot be held where a platform puts it; raised before anything is loaded."""


def available_host_bytes() -> int | None:
    """MemAvailable (what can be allocated without swapping), or None where /proc/meminfo is absent."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(cfg: dict, store: str, device: str, dtype_bytes: int) -> dict:
    """What a lean model over `store` holds, checked against this machine before loading:
    non-routed weights on `device`; routed experts on it too (resident), in host memory (host,
    platform cg), or on storage (flash: only the round's staged experts are in memory). Raises
    WontFit with the numbers and what to do instead."""
    b = breakdown(cfg)
    need = {"device": b.non_routed * dtype_bytes, "host": 0}
    if store == "resident":
        need["device"] += b.routed_experts * dtype_bytes
    elif store == "host":
        need["host"] = b.routed_experts * dtype_bytes
    what = {"resident": "every weight", "host": "the routed-expert pool (platform cg)"}.get(store, "the non-routed weights")
    if device == "cpu":  # the accelerator is the CPU: one memory holds both
        need = {"device": 0, "host": need["device"] + need["host"]}
        what = "every weight (the CPU is the accelerator here)" if store != "flash" else what
    have = available_host_bytes()
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    if have is not None and need["host"] > 0.9 * have:
        raise WontFit(f"{what} at {8 * dtype_bytes}-bit weights needs {gib(need['host'])} of host memory, "
                      f"but {gib(have)} is available: use --platform mn (experts read from storage), or a machine "
                      "with more memory")
    if device != "cpu" and need["device"]:
        import torch

        free, _ = torch.cuda.mem_get_info()
        if need["device"] > 0.9 * free:
            raise WontFit(f"the weights kept on the GPU need {gib(need['device'])} but {gib(free)} is free: use "
                          "--platform cg or mn (routed experts off the GPU)")
    return need
