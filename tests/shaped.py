"""Checkpoints shaped like the real models, written on the spot: DeepSeek-V2-Lite's and Moonlight's
config.json (routing: 64 routed + 2 shared experts, top-6, first layer dense, MLA without q_lora;
V2's softmax / V3's sigmoid + correction bias, normalised, scaled) at small dimensions — 3 layers,
hidden 64, a few hundred tokens of vocabulary — with random weights. DS gets a byte-level BPE
tokenizer.json; ML a `tiktoken.model` and tokenizer_config.json only, as Moonlight ships (its own
tokenizer class is never run)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from bench.cells import registry
from bench.tiny.tokenizer import train_tokenizer

WORDS = (
    "the model routes each token to six experts and the shared experts see every token while a draft "
    "expert learns what the omitted experts add so that verification accepts more tokens per load"
).split()
SMALL = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=2048,
)


def texts(n: int = 400) -> list[str]:
    return [" ".join(WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]) + f" {i}." for i in range(n)]


def write_tiktoken(tok, folder: Path) -> int:
    """A trained byte-level BPE as Moonlight ships its tokenizer: `tiktoken.model` (base64 bytes,
    rank = id, specials excluded) and tokenizer_config.json (specials after the ranks); returns the
    number of ranks."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tok.all_special_tokens)
    plain = sorted((i, t) for t, i in tok.get_vocab().items() if t not in special)
    lines = []
    for rank, (_, t) in enumerate(plain):
        lines.append(base64.b64encode(bytes(decode[c] for c in t)).decode() + f" {rank}")
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n_plain = len(plain)
    names = ["<|bos|>", "<|eos|>", "<|pad|>"]
    conf = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
        "added_tokens_decoder": {
            str(len(plain) + k): {"content": n, "special": True, "lstrip": False, "rstrip": False}
            for k, n in enumerate(names)
        },
        "bos_token": names[0],
        "eos_token": names[1],
        "pad_token": names[2],
        "chat_template": tok.chat_template,
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))
    for f in ("tokenizer.json", "special_tokens_map.json"):
        (folder / f).unlink(missing_ok=True)
    return n_plain


def write_shaped(model: str, folder: Path, seed: int = 0) -> Path:
    """`model` ("ds" or "ml") shaped checkpoint in `folder` (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(iter(texts()), folder, vocab_size=400)
    facts = json.loads((registry.FACTS_DIR / f"{model}.json").read_text())
    keep = {k: v for k, v in facts.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    keep.pop("rope_scaling", None)  # yarn's factor 40 at 2,048 positions: not what a small model needs
    cfg_cls, model_cls = (
        (DeepseekV2Config, DeepseekV2ForCausalLM) if model == "ds" else (DeepseekV3Config, DeepseekV3ForCausalLM)
    )
    if model == "ds":
        vocab, bos, eos = len(tok), tok.bos_token_id, tok.eos_token_id
    else:  # tiktoken: the ranks first, the specials after them
        n_plain = write_tiktoken(tok, folder)
        vocab, bos, eos = n_plain + 3, n_plain, n_plain + 1
    cfg = cfg_cls(**(keep | SMALL | {"vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos}))
    torch.manual_seed(seed)
    m = model_cls(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.02)  # Moonlight's bias is learned: not zero
        for name, b in m.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.02)
    m.save_pretrained(folder)
    conf = json.loads((folder / "config.json").read_text())
    for k in ("scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"):
        conf.setdefault(k, facts[k])  # transformers drops some of the V3 keys on save; the checkpoints carry them
    (folder / "config.json").write_text(json.dumps(conf, indent=1))
    return folder
