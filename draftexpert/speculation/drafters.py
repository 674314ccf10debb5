"""Drafters: cheaper configurations of the target's own weights (self-speculation), never a
separate model.

- `shared+top-r` (training-free): the shared experts plus the router's top-r routed experts.
- `DraftExpert` (Eq. 5): y^d_l = S_l(h) + g_{l,e1} E_{l,e1}(h) + γ_l E^d_l(h), e1 = argmax_e R_l(h)_e,
  with one accelerator-resident draft expert E^d_l per MoE layer.

The gate weight of a routed expert a drafter runs is the **target's** weight for it (Eq. 4),
truncated to the r experts the drafter keeps — never renormalised over those r:
  V2 (softmax, greedy):  g_{l,e} = softmax(R_l(h))_e · routed_scaling_factor   (no renormalisation;
                         the same value a top-r softmax router gives).
  V3 (sigmoid, noaux_tc): g_{l,e} = σ(R_l(h))_e / Σ_{e' ∈ TopK_l(h)} σ(R_l(h))_{e'} · routed_scaling_factor,
                         the sum over the target's top-k set (chosen with the correction bias), so
                         g_{l,e1} is the number the full MoE multiplies E_{l,e1} by.
Hence the drafter's e1 term equals the target's e1 term and the missing routed residual
m* = y* − S − g_{l,e1} E_{l,e1} (Eq. 6) is exactly the target's other k − 1 terms; the
distillation trainer uses this same definition.

The draft expert runs fused with the shared expert: the widened shared MLP has the draft
expert's gate/up rows appended and γ_l · its down columns appended, which computes
S_l(h) + γ_l E^d_l(h) in one pair of matmuls (silu(g)·u is row-wise, down sums over rows). A zero
draft expert adds rows that contribute exactly 0, so DraftExpert(0) is shared+top-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftPath:
    """How a drafter runs each MoE layer: `r` routed experts (of the router's top-k, best
    first) and, when `shared` has the layer, a widened shared expert (gate_up [2·(I_s+I_d), H],
    down [H, I_s+I_d]) that carries the draft expert."""

    name: str
    r: int
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def shared_for(self, layer: int, weights: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shared.get(layer) or (weights["shared_gate_up"], weights["shared_down"])


def top_r(r: int, top_k: int) -> DraftPath:
    """shared + top-r: the training-free drafter."""
    if not 1 <= r < top_k:
        raise ValueError(f"r must be in 1..{top_k - 1} (the target uses top-{top_k}); got {r}")
    return DraftPath(f"top-{r}", r)


@dataclass
class DraftExperts:
    """One draft expert per MoE layer: gate_up [2·I_d, H] (gate rows then up rows, like the
    routed experts), down [H, I_d], and its scale γ_l (a scalar; fixed at 1 unless trained)."""

    gate_up: dict[int, torch.Tensor]
    down: dict[int, torch.Tensor]
    gamma: dict[int, float]

    @property
    def intermediate(self) -> int:
        return next(iter(self.down.values())).shape[1]

    @classmethod
    def zeros(cls, moe_layers: list[int], hidden: int, intermediate: int, dtype=torch.float32) -> DraftExperts:
        """Untrained: every weight 0, γ = 1 — DraftExpert reduces to shared + top-1."""
        return cls(
            {i: torch.zeros(2 * intermediate, hidden, dtype=dtype) for i in moe_layers},
            {i: torch.zeros(hidden, intermediate, dtype=dtype) for i in moe_layers},
            dict.fromkeys(moe_layers, 1.0),
        )

    @classmethod
    def random(
        cls,
        moe_layers: list[int],
        hidden: int,
        intermediate: int,
        seed: int = 0,
        std: float = 0.02,
        dtype=torch.float32,
    ) -> DraftExperts:
        """Random N(0, std²) weights (tests: a draft expert that changes the draft path)."""
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *shape: (torch.randn(*shape, generator=g) * std).to(dtype)  # noqa: E731
        return cls(
            {i: rnd(2 * intermediate, hidden) for i in moe_layers},
            {i: rnd(hidden, intermediate) for i in moe_layers},
            dict.fromkeys(moe_layers, 1.0),
        )


def draftexpert(model, experts: DraftExperts) -> DraftPath:
    """shared + top-1 + γ·draft expert (Eq. 5), the draft expert fused into the shared MLP."""
    shared = {}
    for i in range(len(model.layers)):
        if i not in experts.gate_up:
            continue
        d_gate, d_up = experts.gate_up[i].chunk(2, dim=0)
        shared[i] = model.widen_shared(i, d_gate, d_up, experts.down[i] * experts.gamma[i])  # the model's storage
    missing = [i for i in range(model.cfg.layers) if model.cfg.is_moe(i) and i not in shared]
    if missing:
        raise ValueError(f"draft experts are missing for MoE layers {missing}")
    return DraftPath("draftexpert", 1, shared)


def make_draft_path(
    model, method: str, r: int = 1, experts: DraftExperts | None = None, draft_intermediate: int | None = None
) -> DraftPath:
    """`top-r` → shared + top-r; `draftexpert` → shared + top-1 + the given draft experts
    (zeros of `draft_intermediate` rows — default the routed experts' — when none are given)."""
    cfg = model.cfg
    if method == "top-r":
        return top_r(r, cfg.top_k)
    if method == "draftexpert":
        if experts is None:
            moe = [i for i in range(cfg.layers) if cfg.is_moe(i)]
            experts = DraftExperts.zeros(moe, cfg.hidden, draft_intermediate or cfg.moe_inter)
        return draftexpert(model, experts)
    raise ValueError(f"unknown drafter {method!r}; known: top-r, draftexpert")
