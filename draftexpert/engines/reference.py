"""Reference decoding: the target's plain greedy decoding through transformers' own model class
(DeepseekV2ForCausalLM / DeepseekV3ForCausalLM) with its KV cache. This is the oracle that every
speculative decoder's output must equal token for token; it is not the AR-offload baseline
(which runs on the expert-offload runtime and pays for expert movement).
"""

from __future__ import annotations

import time

import torch

from draftexpert.decoding import DecodeOutput, check_context, check_finite


def prefill(model, input_ids: torch.Tensor):
    """input_ids [1, T] → (logits of the last position [1, V], cache)."""
    out = model(input_ids=input_ids, use_cache=True)
    return out.logits[:, -1], out.cache if hasattr(out, "cache") else out.past_key_values


def decode_one_token(model, token: torch.Tensor, cache):
    """token [1, 1] → (logits [1, V], cache advanced by one position)."""
    out = model(input_ids=token, cache=cache, use_cache=True)
    return out.logits[:, -1], out.cache if hasattr(out, "cache") else out.past_key_values


class ReferenceDecoder:
    """Greedy decoding with transformers; `generate` follows the `Decoder` contract."""

    name = "reference"

    def __init__(self, model):
        self.model = model.eval()
        self.context_length = model.config.max_position_embeddings

    def positions(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return prompt_tokens + max_new_tokens

    def close(self) -> None:
        """Nothing held open: the weights are ordinary tensors."""

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        check_context(
            self.positions(len(prompt_ids), max_new_tokens), self.context_length, len(prompt_ids), max_new_tokens
        )
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        t0 = time.perf_counter()
        logits, cache = prefill(self.model, ids)
        token = check_finite(logits).argmax(-1, keepdim=True)  # [1, 1]
        t1 = time.perf_counter()
        tokens = [int(token)]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            logits, cache = decode_one_token(self.model, token, cache)
            token = check_finite(logits).argmax(-1, keepdim=True)
            tokens.append(int(token))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1)
