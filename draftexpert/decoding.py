"""The two contracts of the suite.

`Decoder` — what every decoding method plugs into (as Spec-Bench's): prompt token ids in, emitted
token ids plus timings and the method's counters out. The runner (bench/) times nothing itself and
knows no method; metrics are computed afterwards from the records (`draftexpert.metrics`).

`Engine` — what a decoder needs of the thing that runs the model (vLLM's proposer / scorer split,
llama.cpp's `common_speculative_draft`): the frozen target with its KV cache, the drafter beside it,
and where the routed experts are. AR offload (`baselines.ar`) and the speculative round
(`draftexpert.speculation.round`) are written once over it; the torch runtime
(`draftexpert.engines.torch_engine`) and llama.cpp (`draftexpert.engines.llamacpp`) implement it.
Logits cross it as torch tensors ([V] for one position, [T, V] for a block), expert sets as
{(layer, expert)}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

Key = tuple[int, int]  # (layer, expert)


@dataclass
class DecodeOutput:
    tokens: list[int]  # emitted after the prompt, EOS included when it was emitted; tokens[0] from prefill
    prefill_s: float  # wall seconds of the prompt forward
    decode_s: float  # wall seconds from the end of prefill to the last emitted token
    stats: dict = field(default_factory=dict)  # counters only (draftexpert.metrics): rounds, drafted, ledger …


class ContextOverflow(ValueError):
    """A prompt and its new tokens need more positions than the model's context holds."""


class NonFiniteLogits(ValueError):
    """The model produced NaN / inf logits: damaged weights or expert file, never a token."""


def check_context(needed: int, context: int, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a sequence before decoding it, not when the KV cache runs out half-way."""
    if needed > context:
        extra = needed - prompt_tokens - max_new_tokens
        raise ContextOverflow(
            f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens"
            + (f" + {extra} for speculation (K_max + 1)" if extra > 0 else "")
            + f" = {needed} positions exceed the model's context of {context}"
        )


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            "the model produced non-finite logits (NaN/inf): its weights or expert file are "
            "damaged — `bench convert --verify` checks the expert file; no record was written"
        )
    return logits


class Decoder(Protocol):
    name: str
    context_length: int  # the most positions one sequence may occupy (the model's / engine's context)

    def positions(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Positions a sequence of this length occupies while it is decoded (`check_context`)."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput: ...

    def close(self) -> None:
        """Release what the decoder holds open (expert files, llama.cpp contexts)."""


class Engine(Protocol):
    """Target, drafter and expert residency of one engine. Positions count from the prompt's first
    token; "round" = one draft → verify round (or one AR step): what it moves is staged until
    `end_round`, and the cold setting drops it there."""

    name: str  # the drafter's name (top-r, draftexpert), "ar" without one
    ledger: object  # the engine's `Ledger`: every forward's requests, loads, bytes, stall
    context_length: int  # positions its KV cache(s) can hold

    def start(self, capacity: int) -> None:
        """A new sequence: empty KV cache(s) with room for `capacity` positions, ledger reset, experts cold."""

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """The target over the prompt; logits [V] of its last position."""

    def prefill_draft(self, ids: list[int]) -> None:
        """The drafter over the prompt, when it keeps a KV cache of its own (else nothing)."""

    def decode_one_token(self, token: int) -> torch.Tensor:
        """The target over one token (AR); logits [V] of the next position."""

    @property
    def draft_length(self) -> int:
        """Positions in the drafter's KV cache (what it has consumed of the committed tokens)."""

    def draft_lengths(self) -> dict[str, int]:
        """`draft_length` of each drafter `select_drafter` takes (`--method auto`): one left out of rounds
        lags behind the committed tokens, and its next draft forward consumes them first."""

    def draft_forward(self, ids: list[int]) -> torch.Tensor:
        """The drafter consumes `ids`; logits [V] of its last position."""

    def draft_ran(self) -> set[Key]:
        """Layer-experts the last draft forward ran."""

    def predicted(self) -> set[Key]:
        """Ê: the draft router's top-k (the target's k, chosen by the target's rule) at every MoE
        layer for the last token the drafter consumed — its verify position's predicted experts."""

    def resident(self) -> set[Key]:
        """Layer-experts on the accelerator now (cached or staged this round), none pending."""

    def prefetch(self, keys: set[Key]) -> set[Key]:
        """Start non-blocking loads of `keys`; return the ones a load was issued for."""

    def verify(self, start: int, ids: list[int]) -> torch.Tensor:
        """The target over `ids` at positions start …; logits [len(ids), V]."""

    def routed(self) -> set[Key]:
        """Layer-experts the target's last forward routed over all its positions."""

    def commit(self, length: int) -> None:
        """Keep positions < length in the target's KV cache, and in the drafter's at most those."""

    def begin_round(self) -> None: ...

    def end_round(self) -> None: ...

    def stats(self) -> dict:
        """The engine's counters for the sequence: {"ledger": …, …}."""

    def close(self) -> None: ...


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32 on the host (T = 1 at greedy: the draft's confidence). Sampling
    and acceptance run on the CPU with CPU generators whatever the engine's device: one random
    stream on every device, and a CPU generator never meets a CUDA tensor in `multinomial`
    (the logits' copy is V floats, and the token is needed on the host anyway)."""
    return torch.softmax(logits.float().cpu() / (temperature if temperature > 0 else 1.0), dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """logits [V] → token: argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    check_finite(logits)
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, temperature), 1, generator=generator))
