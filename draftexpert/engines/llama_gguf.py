"""llama.cpp model files (GGUF, architecture deepseek2) for a checkpoint: the target and its drafters.

A model is two GGUF splits in llama.cpp's split format (`<prefix>-00001-of-00002.gguf`, …):
  split 1, the head:  metadata, tokenizer and every non-routed weight;
  split 2, experts:   the routed experts — the flash store's own expert file (`gguf_experts`),
                      linked, so both engines read the same expert bytes.
A drafter is another head over the same expert split (a symlink to the same file), so drafter
and verifier share one copy of the experts in storage and in the page cache, as the torch
engine's drafter and verifier share one expert store:
  shared+top-r   the target's own files loaded with `deepseek2.expert_used_count = r` (kv_overrides);
  DraftExpert    a head whose shared expert carries the draft expert as extra rows (γ folded into
                 its down columns), zero-padded to whole `n_ff_exp` blocks because llama.cpp sizes
                 the shared expert as n_ff_exp · expert_shared_count (zero rows add exactly 0);
                 `expert_shared_count` raised to match and `expert_used_count = 1`.

The metadata follows llama.cpp's converter (`convert_hf_to_gguf.py`, DeepseekV2Model): MLA as MQA
with one KV head, `kv_b_proj` split into `attn_k_b` (transposed) and `attn_v_b` for absorption,
`q_lora_rank = 0` when the checkpoint has none (llama.cpp otherwise requires it), the gating
function written explicitly (sigmoid for V3, softmax for V2). Weight types: `f32`; `f16` (every
matrix f16); `q4_0` (every matrix whose rows are whole 32-weight blocks in Q4_0, bit-identical to
llama.cpp's quantiser). Norms, biases and the router stay f32 in every type, as llama.cpp's own
quantiser keeps them.

The engine feeds token ids from the Hugging Face tokenizer, so llama.cpp's tokenizer is never
used to encode; the vocabulary is written so the file is complete (pre-tokenizer `gpt-2` for the
byte-level BPE the tiny models use — verified to give the same ids).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from draftexpert.runtime.checkpoint import load_tokenizer
from draftexpert.runtime.gguf_checksums import add_tensor, finish_atomic
from draftexpert.runtime.gguf_layout import ARCH, PARTS, TYPES, qtype_of
from draftexpert.runtime.loader import Checkpoint, load_config

N_SPLITS = 2


def split_name(prefix: Path, index: int) -> Path:
    """llama.cpp's split naming: `<prefix>-0000i-of-0000n.gguf` (i from 1)."""
    return prefix.with_name(f"{prefix.name}-{index:05d}-of-{N_SPLITS:05d}.gguf")


def _encode(arr: np.ndarray, qtype: str, keep_f32: bool):
    """(data, raw_dtype or None) for one tensor under the file's weight type."""
    if keep_f32 or arr.ndim < 2 or qtype == "f32":
        return arr.astype(np.float32), None
    if qtype == "f16":
        return arr.astype(np.float16), None
    if qtype == "bf16" or arr.shape[-1] % 32:
        return arr.astype(np.float32), None  # no bf16 head weights; a partial Q4_0 block stays f32
    return gguf.quants.quantize(arr.astype(np.float32), qtype_of(qtype)), qtype_of(qtype)


def _vocab(tok, vocab_size: int):
    """(tokens, token types) as llama.cpp's converter builds them for a BPE tokenizer."""
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _metadata(w, cfg, folder: Path, qtype: str, shared_count: int, used_count: int) -> None:
    c = cfg
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)  # MLA decompresses from one latent KV "head"
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q4_0": 2}[qtype])
    w.add_vocab_size(c.vocab_size)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_q_lora_rank(c.q_lora_rank or 0)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_shared_count(shared_count)
    w.add_expert_used_count(used_count)
    w.add_expert_weights_scale(float(c.routed_scaling_factor))
    v3 = getattr(c, "scoring_func", "softmax") == "sigmoid" or c.model_type == "deepseek_v3"
    if v3 and c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if getattr(c, "n_group", None):
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if key in rope:
                add(rope[key])
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    tok = load_tokenizer(folder)  # a tiktoken.model (Moonlight) too: byte-level BPE either way
    tokens, types = _vocab(tok, c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # token ids come from the Python tokenizer: llama.cpp never pre-tokenizes here
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True)
    if not special.merges:  # no tokenizer.json (tiktoken): the merges the converter derived from the ranks
        merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
        special.merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special.add_to_gguf(w)


def head_tensors(folder: Path, cfg, draft=None):
    """(gguf name, float array [numpy order], keep f32) for every non-routed weight; with `draft`
    (DraftExperts) each MoE layer's shared expert carries the draft expert (module docstring)."""
    ckpt = Checkpoint(folder)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    n_ff = cfg.moe_intermediate_size
    for key in ckpt.keys():
        if (
            ".mlp.experts." in key
            or key.startswith("model.layers.")
            and int(key.split(".")[2]) >= cfg.num_hidden_layers
        ):
            continue  # routed experts live in split 2; MTP layers are not decoded
        t = ckpt.get(key).float()
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else None
        if key.endswith("kv_b_proj.weight"):  # [H·(nope+v), r_kv] → k_b [H, r_kv, nope] (transposed), v_b [H, v, r_kv]
            kv_b = t.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            yield f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy(), False
            yield f"blk.{layer}.attn_v_b.weight", v_b.contiguous().numpy(), False
            continue
        if draft is not None and layer in draft.gate_up and ".mlp.shared_experts." in key:
            t = _widened_shared(key, t, draft, layer, n_ff)
        if key.endswith("e_score_correction_bias"):
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{folder}: no llama.cpp deepseek2 tensor for checkpoint weight {key}")
        keep = key.endswith(("mlp.gate.weight", ".bias")) or t.ndim < 2  # router, bias, norms: f32
        yield name, t.numpy(), keep


def _widened_shared(key: str, t: torch.Tensor, draft, layer: int, n_ff: int) -> torch.Tensor:
    """The shared expert's gate/up [I_s, H] with the draft expert's rows appended (down [H, I_s]:
    γ·columns appended), zero-padded so I_s + I_d is a whole number of n_ff_exp blocks."""
    inter = draft.intermediate
    pad = -inter % n_ff
    d_gate, d_up = draft.gate_up[layer].float().chunk(2, dim=0)
    if key.endswith("gate_proj.weight"):
        return torch.cat([t, d_gate, t.new_zeros(pad, t.shape[1])])
    if key.endswith("up_proj.weight"):
        return torch.cat([t, d_up, t.new_zeros(pad, t.shape[1])])
    down = draft.down[layer].float() * draft.gamma[layer]
    return torch.cat([t, down, t.new_zeros(t.shape[0], pad)], dim=1)


def extra_shared(draft, n_ff: int) -> int:
    """Shared-expert blocks the draft expert adds: ⌈I_d / n_ff_exp⌉."""
    return -(-draft.intermediate // n_ff)


def write_head(folder: Path, path: Path, qtype: str, draft=None) -> Path:
    """Split 1 of a model (the target's, or a DraftExpert drafter's when `draft` is given), atomically."""
    if qtype not in TYPES:
        raise ValueError(f"unsupported weight type {qtype!r}; choose one of {', '.join(TYPES)}")
    cfg = load_config(folder)
    n_ff = cfg.moe_intermediate_size
    shared = cfg.n_shared_experts + (extra_shared(draft, n_ff) if draft is not None else 0)
    tensors = list(head_tensors(folder, cfg, draft))
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, 0)
    w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, N_SPLITS)
    w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(tensors) + len(PARTS) * n_moe)
    w.add_string("draftexpert.content", "head" if draft is None else "draftexpert drafter head")
    _metadata(w, cfg, folder, qtype, shared, used_count=1 if draft is not None else cfg.num_experts_per_tok)
    digests: dict[str, str] = {}
    try:
        for name, arr, keep in tensors:
            data, raw = _encode(arr, qtype, keep)
            add_tensor(w, digests, name, data, raw)
        return finish_atomic(w, tmp, path, digests)
    finally:
        tmp.unlink(missing_ok=True)  # written and renamed, or abandoned: no half file stays


def link_experts(prefix: Path, expert_file: Path) -> Path:
    """Split 2 of the model at `prefix`: a symlink to the expert file (one inode, one page cache)."""
    link = split_name(prefix, 2)
    if link.is_symlink() or link.exists():
        if link.resolve() == expert_file.resolve():
            return link
        link.unlink()
    os.symlink(os.path.relpath(expert_file, link.parent), link)
    return link
