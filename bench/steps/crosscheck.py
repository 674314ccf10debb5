"""Cross-check of the two engines: the torch runtime and llama.cpp, same checkpoint, greedy.

For each prompt both engines decode greedily and tap the router at every position they evaluate
(prompt positions from the prefill, then each fed token). Compared:
  tokens          the emitted sequences; `first_divergence` = index of the first differing token
  expert sets     per (position, MoE layer), the set of top-k experts, over the positions whose
                  inputs are identical in both runs (the prompt and the generated prefix before
                  any divergence — after it the two runs see different text)
A mismatch carries its margin in the torch run — the logit gap between the top two tokens, or
the router-score gap between the k-th and (k+1)-th expert — so a near-tie (a numerical flip, not
a bug) is told apart from a real disagreement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench.suites.prompts import render_prompt
from draftexpert.engines.llamacpp import LlamaModel
from draftexpert.runtime.checkpoint import load_tokenizer
from draftexpert.runtime.loader import build_model
from draftexpert.runtime.model import KVCache, router_scores


def _torch_run(model, ids: list[int], n: int, eos: int | None):
    """(tokens, routing [{layer: experts}] per position, router gaps [{layer: gap}] per position,
    logit gap per emitted token). The router gap is the gap between the k-th and (k+1)-th
    selection score of the runtime's own rule (`router_scores`: V2 softmax probability; V3
    sigmoid + correction bias, group-limited), from the model's router-logit tap."""
    cache = KVCache.for_model(model, len(ids) + n + 1)
    biases = {i: L["bias"] for i, L in enumerate(model.layers) if "gate" in L}
    routing, router_gaps, logit_gaps = [], [], []
    model.router_logits = {}

    def step(x: list[int]) -> int:
        logits = model.forward(torch.tensor(x), cache, phase="ar")[-1]
        gaps = {}
        for layer, z in model.router_logits.items():
            top = torch.topk(router_scores(z.float(), model.cfg, biases[layer])[1], model.cfg.top_k + 1, dim=-1).values
            gaps[layer] = (top[:, -2] - top[:, -1]).tolist()  # [T]
        for t in range(len(x)):
            routing.append({layer: set(idx[t].tolist()) for layer, idx in model.last_routing.items()})
            router_gaps.append({layer: g[t] for layer, g in gaps.items()})
        top2 = torch.topk(logits.float(), 2).values
        logit_gaps.append(float(top2[0] - top2[1]))
        return int(logits.argmax())

    try:
        tokens = [step(ids)]
        while len(tokens) < n and tokens[-1] != eos:
            tokens.append(step(tokens[-1:]))
    finally:
        model.router_logits = None
    return tokens, routing, router_gaps, logit_gaps


def _llama_run(lm, ids: list[int], n: int, eos: int | None):
    lm.reset()
    routing = []

    def step(x: list[int]) -> int:
        logits = lm.eval(x)
        for t in range(len(x)):
            routing.append({layer: set(idx[t].tolist()) for layer, idx in lm.topk.items()})
        return int(logits[-1].argmax())

    tokens = [step(ids)]
    while len(tokens) < n and tokens[-1] != eos:
        tokens.append(step(tokens[-1:]))
    return tokens, routing


def crosscheck(
    folder: Path,
    prompts: list[dict],
    head: Path,
    max_new_tokens: int = 32,
    threads: int = 1,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> dict:
    tok = load_tokenizer(folder)
    model = build_model(folder, "resident")
    lm = LlamaModel(head, 2048, threads, kv_type="f32")  # the torch engine's cache is f32
    rows = []
    for p in prompts:
        ids = render_prompt(tok, p["prompt"])
        t_tokens, t_routing, t_gaps, gaps = _torch_run(model, ids, max_new_tokens, tok.eos_token_id)
        l_tokens, l_routing = _llama_run(lm, ids, max_new_tokens, tok.eos_token_id)
        div = next((i for i, (a, b) in enumerate(zip(t_tokens, l_tokens)) if a != b), None)
        if div is None and len(t_tokens) != len(l_tokens):
            div = min(len(t_tokens), len(l_tokens))
        same_inputs = len(ids) + (len(t_tokens) - 1 if div is None else div)  # positions fed identical text
        mismatches = []
        for pos in range(min(same_inputs, len(t_routing), len(l_routing))):
            for layer, experts in t_routing[pos].items():
                if l_routing[pos].get(layer) != experts:
                    mismatches.append({"position": pos, "layer": layer, "router_gap": t_gaps[pos][layer]})
        rows.append(
            {
                "prompt_id": p["id"],
                "tokens": len(t_tokens),
                "tokens_equal": t_tokens == l_tokens,
                "first_divergence": div,
                "logit_gap_at_divergence": gaps[div] if div is not None else None,
                "positions_compared": same_inputs,
                "layer_positions": same_inputs * len(t_routing[0]),
                "expert_set_mismatches": len(mismatches),
                "mismatches": mismatches,
            }
        )
        log(
            f"{p['id']}: tokens {'equal' if div is None else f'diverge at {div}'}, "
            f"expert sets {same_inputs * len(t_routing[0]) - len(mismatches)}/{same_inputs * len(t_routing[0])} equal"
        )
    lm.close()
    return {
        "prompts": len(rows),
        "token_mismatches": sum(not r["tokens_equal"] for r in rows),
        "layer_positions": sum(r["layer_positions"] for r in rows),
        "expert_set_mismatches": sum(r["expert_set_mismatches"] for r in rows),
        "rows": rows,
    }
