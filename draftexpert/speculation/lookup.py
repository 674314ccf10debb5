"""Prompt lookup: a drafter with no forward (prompt lookup decoding, Saxena 2023; llama.cpp's n-gram
lookup; transformers' `prompt_lookup_num_tokens`).

The last n committed tokens (n = max_ngram, then down to min_ngram) are looked up in the committed
sequence (prompt + output so far); at the most recent earlier match, the up to k tokens that
followed it are the proposal. Nothing is computed and no expert is read: the verify block's union
is all the experts it costs, loaded on demand by the verify pass (as fixed-K top-r without prefetch).
The most recent match is taken (transformers takes the first): output that repeats itself repeats
what it said last.
"""

from __future__ import annotations

from dataclasses import dataclass

PLD_TOKENS = 10  # tokens proposed at most (prompt lookup decoding's reference setting)


def lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `context` (n from max_ngram down to min_ngram) that occurs earlier; [] when none does."""
    if k < 1 or max_ngram < min_ngram or min_ngram < 1:
        return []
    size = len(context)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = context[size - n :]
        for start in range(size - n - 1, -1, -1):  # the match must end before the suffix itself starts
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup's settings (`--pld-max-ngram`; its proposal length is the round's K_max)."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 ≤ min_ngram ≤ max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, context: list[int], k: int) -> list[int]:
        return lookup(context, k, self.max_ngram, self.min_ngram)
