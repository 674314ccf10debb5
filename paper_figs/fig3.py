"""Fig. 3: the drafter's cumulative unique routed layer-experts vs draft length, per drafter (fixed
K, no truncation): the curves `draftexpert.metrics.derive` gives as `draft_unique_curve`
(layer-experts the drafter had run when it proposed its j-th token, mean over rounds). Pure:
formats curves into a table and a figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs import paper
from paper_figs.output import save  # noqa: E402


def table(curves: dict[str, list[float]]) -> str:
    k = max(len(c) for c in curves.values())
    lines = ["| drafter | " + " | ".join(f"j={j + 1}" for j in range(k)) + " |", "|---" * (k + 1) + "|"]
    for name, c in curves.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in c) + " |")
    return "\n".join(lines) + "\n"


def paper_points(model: str, moe_layers: int) -> dict[str, float]:
    """The paper's Table 3 (K = 4) drafter unique layer-experts of the real model of the same
    routing, scaled from its 26 MoE layers to `moe_layers` (the curves count over all layers)."""
    return {name: v[0] * moe_layers / paper.MOE_LAYERS for name, v in paper.TABLE3.get(paper.real(model), {}).items()}


def figure(
    curves: dict[str, list[float]],
    out_stem: Path,
    title: str,
    paper_at_k4: dict[str, float] | None = None,
    source: str | None = None,
) -> list[Path]:
    """One curve per drafter; `paper_at_k4`: the paper's points at j = 4, hollow, in each drafter's colour."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, c in curves.items():
        line = ax.plot(range(1, len(c) + 1), c, marker="o", ms=3, label=name)[0]
        if paper_at_k4 and name in paper_at_k4:
            ax.plot([4], [paper_at_k4[name]], marker="D", ms=8, mfc="none", ls="none", color=line.get_color())
    if paper_at_k4:
        ax.plot(
            [], [], marker="D", mfc="none", ls="none", color="0.3", label="paper, Table 3 (K = 4, per-layer scaled)"
        )
    ax.set_xlabel("draft length j")
    ax.set_ylabel("cumulative unique layer-experts (drafter)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save(fig, out_stem, source)
