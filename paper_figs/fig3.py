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

from paper_figs.output import save  # noqa: E402


def table(curves: dict[str, list[float]]) -> str:
    k = max(len(c) for c in curves.values())
    lines = ["| drafter | " + " | ".join(f"j={j + 1}" for j in range(k)) + " |", "|---" * (k + 1) + "|"]
    for name, c in curves.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in c) + " |")
    return "\n".join(lines) + "\n"


def figure(curves: dict[str, list[float]], out_stem: Path, title: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, marker="o", ms=3, label=name)
    ax.set_xlabel("draft length j")
    ax.set_ylabel("cumulative unique layer-experts (drafter)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save(fig, out_stem)
