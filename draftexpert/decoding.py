"""The one contract every decoding method plugs into (as Spec-Bench's): a `Decoder` turns prompt
token ids into emitted token ids plus timings and its own counters. The runner (bench/) times
nothing itself and knows no method; metrics are computed afterwards from the records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class DecodeOutput:
    tokens: list[int]  # emitted after the prompt, EOS included when it was emitted; tokens[0] from prefill
    prefill_s: float  # wall seconds of the prompt forward
    decode_s: float  # wall seconds from the end of prefill to the last emitted token
    stats: dict = field(default_factory=dict)  # method counters: drafted, accepted, rounds, ledger …

    @property
    def decode_tps(self) -> float:
        """decode TPS = (new tokens − 1) / decode seconds: tokens[0] comes from the prefill's
        logits, every later token from the decode phase that `decode_s` times."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


class Decoder(Protocol):
    name: str

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        ...

    def close(self) -> None:
        """Release what the decoder holds open (expert files, llama.cpp contexts)."""
