"""A target checkpoint in a local Hugging Face folder (never the network): loading it, and the
fingerprint of its weights — the identity results and draft experts are paired with."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from draftexpert.runtime.loader import Checkpoint, CheckpointError, load_config


def load_target(folder: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local folder in Hugging Face format, in eval mode."""
    folder = Path(folder)
    if not list(folder.glob("*.safetensors")):
        raise CheckpointError(
            f"{folder} holds no *.safetensors weights "
            f"(only {', '.join(sorted(p.name for p in folder.iterdir())) or 'nothing'})"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, safetensors' own
        raise CheckpointError(
            f"the weights in {folder} could not be loaded by transformers "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); is a shard truncated?"
        ) from None
    return model.eval(), load_tokenizer(folder)


TIKTOKEN_FILE = "tiktoken.model"  # Moonlight's tokenizer: tiktoken BPE ranks, one "base64 rank" a line
# Moonlight's pre-tokenizer (tokenization_moonshot.py): Han runs, cased words with their contractions,
# 1–3 digits, punctuation, newlines, spaces.
MOONSHOT_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file (`<base64 token> <rank>` per line) without the tiktoken package; a bad
    line is named."""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path}:{n} is not a tiktoken line (`<base64 token> <rank>`)") from None
    return ranks


def tiktoken_tokenizer(folder: Path):
    """A fast tokenizer built from the folder's `tiktoken.model` (Moonlight ships one with its own
    Python class, `trust_remote_code`): byte-level BPE over the ranks (transformers' own converter),
    Moonlight's pre-tokenizer, and the special tokens, BOS / EOS and chat template of its
    tokenizer_config.json — no code from the checkpoint runs."""
    folder = Path(folder)
    conf_path = folder / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}

    class _Ranks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):
            return read_tiktoken_ranks(path)

    vocab, merges = _Ranks(str(folder / TIKTOKEN_FILE)).extract_vocab_merges_from_model(str(folder / TIKTOKEN_FILE))
    tk = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    if hasattr(tk.model, "ignore_merges"):
        tk.model.ignore_merges = True
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(MOONSHOT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    added = sorted(((int(i), t) for i, t in conf.get("added_tokens_decoder", {}).items()), key=lambda x: x[0])
    special = {i: t["content"] if isinstance(t, dict) else t for i, t in added}
    for i, content in special.items():
        if i != tk.get_vocab_size():
            raise CheckpointError(
                f"{conf_path}: added token {content!r} has id {i}, but the vocabulary has "
                f"{tk.get_vocab_size()} entries before it (ids must follow {TIKTOKEN_FILE}'s ranks)"
            )
        tk.add_special_tokens([AddedToken(content, special=True, normalized=False)])

    def token(key):
        v = conf.get(key)
        return v.get("content") if isinstance(v, dict) else v

    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=token("bos_token"),
        eos_token=token("eos_token"),
        pad_token=token("pad_token"),
        unk_token=token("unk_token"),
        chat_template=conf.get("chat_template"),
        model_max_length=conf.get("model_max_length", 1 << 30),
    )


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, offline: transformers' own loading (tokenizer.json /
    tokenizer_config.json); a folder holding `tiktoken.model` and no tokenizer.json (Moonlight) gets
    `tiktoken_tokenizer` unless `trust_remote_code` asks for the checkpoint's own class instead."""
    folder = Path(folder)
    if (folder / TIKTOKEN_FILE).exists() and not (folder / "tokenizer.json").exists() and not trust_remote_code:
        return tiktoken_tokenizer(folder)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"the tokenizer in {folder} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"the folder needs tokenizer.json / tokenizer_config.json (or {TIKTOKEN_FILE}) beside config.json"
        ) from None


def _fingerprint_cache() -> Path:
    root = os.environ.get("DRAFTEXPERT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "draftexpert") / "fingerprints.json"


def weights_fingerprint(folder: Path) -> str:
    """sha256 over the folder's safetensors files (names and bytes, in name order). Hashing a
    16B checkpoint takes a minute, so the digest is cached per machine, keyed by the folder and
    every shard's name, size and mtime: a rewritten shard is hashed again."""
    folder = Path(folder).resolve()
    shards = sorted(folder.glob("*.safetensors"))
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in shards]
    cache = _fingerprint_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(folder))
    if entry and entry.get("shards") == stamp:
        return entry["sha256"]
    h = hashlib.sha256()
    for p in shards:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    known[str(folder)] = {"shards": stamp, "sha256": digest}
    try:  # best effort: a read-only home only costs the hash next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest


def write_dense_counterpart(folder: Path, out: Path) -> Path:
    """The dense counterpart of an MoE checkpoint (Fig. 4's dense half), written to `out`, one
    shard per layer: each MoE layer's routed experts replaced by ONE always-selected FFN of the
    active routed width k · I, so a token moves and computes what an AR step of the MoE does
    (same bytes, same FLOPs), while a block of L tokens reuses those weights instead of touching a
    union of experts. Attention, norms, shared experts, dense layers, head: the target's own.
    The dense FFN is the target's routed experts 0 … k−1 side by side (down_proj scaled by 1/k):
    a timing counterpart with the MoE's shapes, not a trained model."""
    cfg, ckpt = load_config(folder), Checkpoint(folder)
    k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    by_layer: dict[int | None, list[str]] = {}
    for name in ckpt.keys():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        by_layer.setdefault(layer, []).append(name)
    for layer, names in by_layer.items():
        p = f"model.layers.{layer}.mlp."
        tensors = {n: ckpt.get(n) for n in names if ".mlp.experts." not in n}
        if p + "gate.weight" in tensors:  # an MoE layer: one expert, one router row
            tensors[p + "gate.weight"] = torch.zeros_like(tensors[p + "gate.weight"][:1])
            bias = p + "gate.e_score_correction_bias"
            if bias in tensors:
                tensors[bias] = torch.zeros_like(tensors[bias][:1])
            if p + "experts.gate_up_proj" in ckpt.where:  # fused [E, 2I, H] / [E, H, I]
                gu, dn = ckpt.get(p + "experts.gate_up_proj")[:k], ckpt.get(p + "experts.down_proj")[:k]
                gate, up = gu[:, :inter].reshape(k * inter, -1), gu[:, inter:].reshape(k * inter, -1)
                down = torch.cat(list(dn), 1)
            else:
                gate = torch.cat([ckpt.get(f"{p}experts.{e}.gate_proj.weight") for e in range(k)])
                up = torch.cat([ckpt.get(f"{p}experts.{e}.up_proj.weight") for e in range(k)])
                down = torch.cat([ckpt.get(f"{p}experts.{e}.down_proj.weight") for e in range(k)], 1)
            tensors |= {
                p + "experts.0.gate_proj.weight": gate,
                p + "experts.0.up_proj.weight": up,
                p + "experts.0.down_proj.weight": (down.float() / k).to(down.dtype),
            }
        shard(f"model-{'head' if layer is None else f'layer{layer:03d}'}.safetensors", tensors)
    raw = json.loads((Path(folder) / "config.json").read_text())
    raw |= {
        "n_routed_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": k * inter,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out
