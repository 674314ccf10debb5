"""Evaluation of a tiny target on the corpus's validation split: perplexity against the unigram
baseline of the same tokenizer, per-layer expert usage, and greedy continuations.

  perplexity          = exp(mean next-token cross-entropy over the evaluated tokens)
  unigram perplexity  = exp(−mean log p_uni(token)), p_uni = (count_train(t) + 1) / (N_train + V)
                        (add-one smoothing; counts from train.bin, evaluated on the same tokens)
  usage share_{l,i}   = tokens routed to expert i in layer l / (tokens · top-k)
  usage entropy_l     = −Σ_i share_{l,i} log share_{l,i} / log E      (1 = perfectly even)
  max share × uniform = max_i share_{l,i} · E                         (1 = even; the bar is ≤ 3)
  routed weight sum   = mean over tokens of Σ_{e ∈ TopK} g_{l,e} (the scaling factor included)
  routed : shared     = mean_t ‖y_l − S_l(h)‖ / mean_t ‖S_l(h)‖: how much of each token the routed
                        experts carry against the shared experts (a top-1 draft misses k − 1 of them)
  repeated 4-grams    = of a greedy continuation's token 4-grams, the share equal to an earlier one
                        in the same continuation (0 = never repeats itself; a loop tends to 1)
  shared opening      = the most prompts whose continuations begin with the same 4 tokens
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.suites import prompts as suites
from draftexpert.engines.reference import ReferenceDecoder

NEAR_TIE = 0.05  # a top-1 margin p(1st) − p(2nd) below which a drafter's argmax agrees little better than a coin


def windows(data: np.ndarray, seq_len: int, limit: int | None) -> list[np.ndarray]:
    """`limit` non-overlapping windows of seq_len + 1 tokens spread evenly over the whole split
    (the split is ordered by source, so its first windows would all be one source); all when None."""
    avail = (len(data) - 1) // seq_len
    n = min(avail, limit) if limit else avail
    stride = avail // n
    return [
        np.asarray(data[i * stride * seq_len : i * stride * seq_len + seq_len + 1], dtype=np.int64) for i in range(n)
    ]


def unigram_logprobs(train: np.ndarray, vocab: int) -> np.ndarray:
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab).astype(np.float64)
    return np.log((counts + 1) / (counts.sum() + vocab))


@torch.inference_mode()
def evaluate(
    model, val: np.ndarray, train: np.ndarray, seq_len: int = 512, limit: int | None = None, batch: int = 4
) -> dict:
    cfg = model.config
    n_experts = cfg.n_routed_experts
    taps: list[torch.Tensor] = []
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    weight_sum, routed_norm, shared_norm = (torch.zeros(len(moes), dtype=torch.float64) for _ in range(3))

    def routed(j):  # the router's choice (usage) and weights
        def fn(gate, inputs, output):
            taps.append(output[2])
            weight_sum[j] += output[1].sum().item()

        return fn

    def carried(j):  # how much of each token the routed experts carry, against the shared experts
        def fn(moe, inputs, output):
            h = inputs[0].reshape(-1, inputs[0].shape[-1])
            shared = moe.shared_experts(h)
            routed_norm[j] += (output.reshape(-1, h.shape[-1]) - shared).norm(dim=-1).sum().item()
            shared_norm[j] += shared.norm(dim=-1).sum().item()

        return fn

    handles = [moe.gate.register_forward_hook(routed(j)) for j, moe in enumerate(moes)]
    handles += [moe.register_forward_hook(carried(j)) for j, moe in enumerate(moes)]
    uni = unigram_logprobs(train, cfg.vocab_size)
    nll = uni_nll = 0.0
    n_tok = 0
    usage = torch.zeros(len(moes), n_experts, dtype=torch.float64)
    try:
        ws = windows(val, seq_len, limit)
        for i in range(0, len(ws), batch):
            x = torch.from_numpy(np.stack(ws[i : i + batch]))
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
            uni_nll -= float(uni[x[:, 1:].numpy()].sum())
            n_tok += x[:, 1:].numel()
            for layer, idx in enumerate(taps):
                usage[layer] += torch.bincount(idx.reshape(-1), minlength=n_experts).double()
            taps.clear()
    finally:
        for h in handles:
            h.remove()
    share = usage / usage.sum(1, keepdim=True)
    entropy = -(share * share.clamp_min(1e-12).log()).sum(1) / math.log(n_experts)
    return {
        "sequences": len(ws),
        "seq_len": seq_len,
        "tokens": n_tok,
        "perplexity": math.exp(nll / n_tok),
        "unigram_perplexity": math.exp(uni_nll / n_tok),
        "usage_entropy": entropy.tolist(),
        "max_share_x_uniform": (share.max(1).values * n_experts).tolist(),
        "min_share_x_uniform": (share.min(1).values * n_experts).tolist(),
        "experts_used": (usage > 0).sum(1).tolist(),
        "usage_share": share.tolist(),
        "routed_weight_sum": (weight_sum / n_tok).tolist(),
        "routed_to_shared_norm": (routed_norm / shared_norm).tolist(),
    }


CONTINUATION_PROMPTS = [
    ("chat", "chat", "What is a Python decorator?"),
    ("chat", "chat", "How do I create a table in PostgreSQL?"),
    ("code", "raw", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("code", "raw", "import os\n\n\ndef list_files(path):\n"),
    ("prose", "raw", "The kernel scheduler decides"),
    ("prose", "raw", "To be, or not to be,"),
]


@torch.inference_mode()
def continuations(model, tokenizer, max_new_tokens: int = 48) -> list[dict]:
    """Greedy continuations of chat (through the chat template), code and prose prompts."""
    dec = ReferenceDecoder(model)
    out = []
    for kind, how, text in CONTINUATION_PROMPTS:
        if how == "chat":
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        toks = dec.generate(ids, max_new_tokens, tokenizer.eos_token_id).tokens
        out.append(
            {
                "kind": kind,
                "prompt": text,
                "continuation": tokenizer.decode(toks, skip_special_tokens=True),
                "distinct_tokens": len(set(toks)),
                "tokens": len(toks),
            }
        )
    return out


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Share of the n-grams of `tokens` that already occurred earlier in `tokens`."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


REPETITION_PER_SUITE = 2  # prompts per benchmark suite (6 suites → 12 prompts)


@torch.inference_mode()
def repetition(model, tokenizer, max_new_tokens: int = 64, per_suite: int = REPETITION_PER_SUITE) -> dict:
    """Greedy AR continuations of the first `per_suite` prompts of every benchmark suite, through the
    chat template as the benchmarks render them: does the model follow its prompt or fall into one
    loop? (Acceptance measured on a loop is not the acceptance the paper measures.)"""
    dec = ReferenceDecoder(model)
    rows = []
    for p in suites.load(limit=per_suite):
        ids = suites.render_prompt(tokenizer, p["prompt"])
        toks = dec.generate(ids, max_new_tokens, tokenizer.eos_token_id).tokens
        # how sure the target is of each token it emitted: the positions α is measured on
        logits = model(input_ids=torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :].float()
        top2 = logits.softmax(-1).topk(2, dim=-1).values
        rows.append(
            {
                "id": p["id"],
                "tokens": len(toks),
                "repeated_4gram_share": repeated_ngram_share(toks),
                "opening": tokenizer.decode(toks[:4]),
                "opening_ids": toks[:4],
                "top1_prob_sum": top2[:, 0].sum().item(),
                "near_ties": int((top2[:, 0] - top2[:, 1] < NEAR_TIE).sum()),
            }
        )
    openings = Counter(tuple(r["opening_ids"]) for r in rows if len(r["opening_ids"]) == 4)
    top, count = openings.most_common(1)[0] if openings else ((), 0)
    return {
        "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "mean_repeated_4gram_share": float(np.mean([r["repeated_4gram_share"] for r in rows])),
        "max_shared_opening": count,
        "most_shared_opening": tokenizer.decode(list(top)),
        "top1_prob": sum(r["top1_prob_sum"] for r in rows) / max(1, sum(r["tokens"] for r in rows)),
        "near_tie_share": sum(r["near_ties"] for r in rows) / max(1, sum(r["tokens"] for r in rows)),
        "rows": rows,
    }


def load_split(data_dir: Path, split: str) -> np.ndarray:
    """A split's token ids: `<split>.bin` (uint16) or `<split>.u32.bin` (a vocabulary past 65,535)."""
    wide = data_dir / f"{split}.u32.bin"
    if wide.exists():
        return np.memmap(wide, dtype=np.uint32, mode="r")
    path = data_dir / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `bench data corpus` then `bench data tokenize`")
    return np.memmap(path, dtype=np.uint16, mode="r")
