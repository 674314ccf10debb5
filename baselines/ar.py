"""AR offload: the paper's baseline and the denominator of every speed-up. Plain autoregressive
decoding on an `Engine` (the torch runtime or llama.cpp) — every token's routed experts are
staged the way that engine stages them, so every load is paid and counted by its ledger. Each
step is a round of its own: the cold setting drops what it staged before the next."""

from __future__ import annotations

import time

import torch

from draftexpert.decoding import DecodeOutput, Engine, check_context, sample


class AROffloadDecoder:
    """`Decoder` contract; `stats["ledger"]` holds the engine's counters for the prompt."""

    name = "ar"

    def __init__(self, engine: Engine, temperature: float = 0.0, seed: int = 0):
        self.engine, self.temperature, self.seed = engine, temperature, seed

    def close(self) -> None:
        self.engine.close()

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def positions(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return prompt_tokens + max_new_tokens

    def decode_one_token(self, token: int) -> torch.Tensor:
        """One AR step: logits [V] of the next position."""
        self.engine.begin_round()
        try:
            return self.engine.decode_one_token(token)
        finally:
            self.engine.end_round()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        eng = self.engine
        gen = torch.Generator().manual_seed(self.seed) if self.temperature > 0 else None
        need = self.positions(len(prompt_ids), max_new_tokens)
        check_context(need, self.context_length, len(prompt_ids), max_new_tokens)
        eng.start(need)
        t0 = time.perf_counter()
        tokens = [sample(eng.prefill(prompt_ids), self.temperature, gen)]
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            tokens.append(sample(self.decode_one_token(tokens[-1]), self.temperature, gen))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1, stats=eng.stats())
