"""Figs. 4–5: verify cost and unique experts vs block length, from the sweep's rows
(`bench.sweep.verify_sweep`). Pure: reads rows, writes a table and a figure.

  unique(L)    = mean over (prompt, start) of Σ_l |∪ top-k over the block|
  cost ×AR(L)  = mean over (prompt, start) of wall(L) / wall(1)   (L = 1 is one AR step)
  linear(L)    = L · unique(1)   (no overlap between the block's positions: the upper bound)
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs.output import save  # noqa: E402


def curves(rows: list[dict]) -> dict[str, list[float]]:
    """{"length", "unique", "linear", "cost"}: one value per block length, ascending."""
    base = {(r["prompt"], r["start"]): r["wall_s"] for r in rows if r["length"] == 1}
    by_len = defaultdict(list)
    for r in rows:
        by_len[r["length"]].append(r)
    lengths = sorted(by_len)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    unique = [mean([r["unique"] for r in by_len[L]]) for L in lengths]
    return {"length": lengths, "unique": unique, "linear": [L * unique[0] for L in lengths],
            "cost": [mean([r["wall_s"] / base[(r["prompt"], r["start"])] for r in by_len[L]]) for L in lengths]}


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
