"""AR offload: the paper's baseline and the denominator of every speed-up. Plain autoregressive
decoding on the expert-offload runtime — every token's routed experts come through the store,
so every load is paid and counted by the ledger."""
from __future__ import annotations

import time

import torch

from draftexpert.decoding import DecodeOutput
from draftexpert.model import KVCache, MoEModel


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """logits [V] → token: argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def prefill(model: MoEModel, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """ids [T] → logits of the last position [V]."""
    return model.forward(ids, cache, phase="prefill")[-1]


def decode_one_token(model: MoEModel, token: int, cache: KVCache) -> torch.Tensor:
    """one token → logits [V] of the next position."""
    return model.forward(torch.tensor([token]), cache, phase="ar")[-1]


class AROffloadDecoder:
    """`Decoder` contract; `stats["ledger"]` holds the expert runtime's counters for the prompt."""

    name = "ar"

    def __init__(self, model: MoEModel, temperature: float = 0.0, seed: int = 0, max_len: int = 2048):
        self.model, self.temperature, self.seed, self.max_len = model, temperature, seed, max_len

    def close(self) -> None:
        self.model.experts.close()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        ledger = self.model.experts.ledger
        ledger.reset()
        gen = torch.Generator().manual_seed(self.seed) if self.temperature > 0 else None
        cache = KVCache.for_model(self.model, min(self.max_len, len(prompt_ids) + max_new_tokens))
        t0 = time.perf_counter()
        tokens = [sample(prefill(self.model, torch.tensor(prompt_ids), cache), self.temperature, gen)]
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            tokens.append(sample(decode_one_token(self.model, tokens[-1], cache), self.temperature, gen))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1, stats={"ledger": ledger.summary()})
