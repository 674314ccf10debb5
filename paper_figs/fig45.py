"""Figs. 4–5: verify cost and unique experts vs block length — the curves
`draftexpert.metrics.verify_sweep_curves` derives from the sweep's rows (`bench.sweep.verify_sweep`).
Pure: formats curves into a table and a figure.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs.output import save  # noqa: E402


def table(c: dict[str, list[float]]) -> str:
    lines = ["| block length L | unique layer-experts | L · unique(1) | verify cost ×AR |", "|---|---|---|---|"]
    for L, u, lin, cost in zip(c["length"], c["unique"], c["linear"], c["cost"]):
        lines.append(f"| {L} | {u:.1f} | {lin:.0f} | {cost:.2f} |")
    return "\n".join(lines) + "\n"


def figure(per_model: dict[str, dict], out_stem: Path) -> list[Path]:
    fig, (ax4, ax5) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, c in per_model.items():
        ax4.plot(c["length"], c["cost"], marker="o", ms=3, label=name)
        line = ax5.plot(c["length"], c["unique"], marker="o", ms=3, label=name)[0]
        ax5.plot(c["length"], c["linear"], ls=":", color=line.get_color(), lw=1)
    ax4.set_xlabel("verify block length L")
    ax4.set_ylabel("verify forward cost (× one AR step)")
    ax4.set_title("Fig. 4: verify cost vs block length", fontsize=9)
    ax5.set_xlabel("verify block length L")
    ax5.set_ylabel("unique routed layer-experts |U(B)|")
    ax5.set_title("Fig. 5: unique experts vs block length (dotted: L · AR)", fontsize=9)
    for ax in (ax4, ax5):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, out_stem)
