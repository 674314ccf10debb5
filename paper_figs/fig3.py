"""Fig. 3: the drafter's cumulative unique routed layer-experts vs draft length, per drafter, from
run records (fixed K, no truncation). Pure: reads records, writes a table and a figure.

  unique(j) = Σ_rounds draft_unique_at[j] / Σ_rounds drafted_at[j]
              (layer-experts the drafter had run when it proposed its j-th token, mean over rounds)
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs.output import save  # noqa: E402


def curve(records: list[dict]) -> list[float]:
    k = max(len(r["drafted_at"]) for r in records)
    n = [sum(r["drafted_at"][j] for r in records) for j in range(k)]
    u = [sum(r["draft_unique_at"][j] for r in records) for j in range(k)]
    return [u[j] / n[j] for j in range(k) if n[j]]


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
