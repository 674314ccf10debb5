"""The speculative round's settings, one frozen dataclass handed down whole (no torch: the CLI reads
its defaults at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_MODES = ("fixed", "cache")
DRAFT_CACHES = ("shared", "own")
CONTROLLERS = ("paper", "cost")  # the stop rule: Eq. 14 (τ, B), or priced from measured costs


@dataclass(frozen=True)
class SpecConfig:
    k_max: int = 4
    tau: float = 0.6  # confidence threshold τ
    budget: int = 24  # B: layer-experts a token may add to the verify set when unconfident
    budget_mode: str = "fixed"  # fixed | cache
    truncate: bool = True  # False: the fixed-K ablation
    prefetch: bool = True
    draft_cache: str = "shared"  # shared | own (the torch engine; llama.cpp's drafter always has its own)
    controller: str = "paper"  # paper (Eq. 14) | cost (`controller.CostController`: K, 0 included, by price)
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be ≥ 1, got {self.k_max}")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget_mode must be 'fixed' or 'cache', got {self.budget_mode!r}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller must be 'paper' or 'cost', got {self.controller!r}")
        if self.draft_cache not in DRAFT_CACHES:
            raise ValueError(f"draft_cache must be 'shared' or 'own', got {self.draft_cache!r}")

    @property
    def positions(self) -> int:
        """The most positions one round adds to a KV cache: x_0 and K_max drafts (a last round may
        draft past the end)."""
        return self.k_max + 1
