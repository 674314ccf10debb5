"""The confidence–expansion controller (Eq. 12–14): whether the drafter may keep proposing.

Û_i = Û_{i−1} ∪ Ê_{·,i} is the predicted verifier set once v_i is kept (Eq. 12); the marginal
expansion of v_i is Δ_i = |Ê_{·,i} \\ Û_{i−1}| (Eq. 13) — with `budget_mode="cache"` only the new
experts that are not already on the accelerator count (B_i = B + |new ∩ resident|). The round
stops before appending v_i when the draft is unconfident about it *and* it would widen the
verify pass by more than the budget (Eq. 14):

    stop  ⇔  q_i < τ  ∧  Δ_i > B_i
"""

from __future__ import annotations

Key = tuple[int, int]  # (layer, expert)


def expansion(predicted: set[Key], kept: set[Key], resident: set[Key] | None = None) -> int:
    """Δ_i: the layer-experts v_i's position adds to Û_{i−1} (`kept`), less those on the
    accelerator when `resident` is given (budget mode "cache")."""
    new = predicted - kept
    return len(new - resident) if resident is not None else len(new)


def stop(confidence: float, delta: int, tau: float, budget: int) -> bool:
    """Eq. 14: stop before v_i when q_i < τ and Δ_i > B."""
    return confidence < tau and delta > budget
