"""Figs. 4–5: verify cost and unique experts vs block length — the curves
`draftexpert.metrics.verify_sweep_curves` derives from the sweep's rows (`bench.steps.sweep.verify_sweep`),
and Fig. 4's dense half: the same sweep over the model's dense counterpart (`dense_cost`).
The paper's Fig. 4 is drawn without numbers; its Table 4 gives the fixed-K = 4 verify cost, a
block of K + 1 = 5 tokens, marked at L = 5. Pure: formats curves into a table and a figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs import paper  # noqa: E402
from paper_figs.output import require, save  # noqa: E402

DENSE_LABEL = (
    "dense counterpart: each MoE layer's routed experts replaced by one always-selected FFN of the "
    "active routed width (k · I, the target's experts 0…k−1 side by side; a timing counterpart, not a "
    "trained model), offloaded through the same Q4_0 flash store, cold"
)
PAPER_BLOCK = 5  # Table 4's fixed K = 4: the verify forward covers x_0 and 4 drafts
COLUMNS = ("length", "unique", "linear", "cost")


def paper_costs(model: str) -> tuple[float, float] | None:
    """(CG, MN) fixed-K verify cost × one AR step for the real model of the same routing (Table 4)."""
    t = paper.TABLE4.get(paper.real(model), {}).get("fixed-k")
    return (t[0], t[1]) if t else None


def paper_note(model: str) -> str:
    p = paper_costs(model)
    return (
        "no numbers for Figs. 4–5; Table 4's fixed K = 4 verify (5 tokens): "
        f"{p[1]:.2f}× one AR step on MN, {p[0]:.2f}× on CG ({paper.real(model).upper()})."
        if p
        else "none."
    )


def table(c: dict[str, list[float]]) -> str:
    require(c, COLUMNS, "Figs. 4–5 curves")
    dense = c.get("dense_cost")
    lines = [
        "| block length L | unique layer-experts | L · unique(1) | verify cost ×AR |"
        + (" dense verify cost ×step |" if dense else ""),
        "|---|---|---|---|" + ("---|" if dense else ""),
    ]
    for i, (L, u, lin, cost) in enumerate(zip(*(c[k] for k in COLUMNS))):
        lines.append(f"| {L} | {u:.1f} | {lin:.0f} | {cost:.2f} |" + (f" {dense[i]:.2f} |" if dense else ""))
    return "\n".join(lines) + "\n"


def figure(per_model: dict[str, dict], out_stem: Path, source: str) -> list[Path]:
    """Fig. 4 (MoE solid, dense counterpart dashed, the paper's Table 4 points hollow) and Fig. 5."""
    fig, (ax4, ax5) = plt.subplots(1, 2, figsize=(10, 4))
    marked = False
    for name, c in per_model.items():
        require(c, COLUMNS, f"Figs. 4–5 curves of {name}")
        line = ax4.plot(c["length"], c["cost"], marker="o", ms=3, label=f"{name} MoE")[0]
        if c.get("dense_cost"):
            ax4.plot(
                c["length"],
                c["dense_cost"],
                marker="s",
                ms=3,
                ls="--",
                color=line.get_color(),
                label=f"{name} dense counterpart",
            )
        p = paper_costs(name)
        if p:
            ax4.plot([PAPER_BLOCK], [p[1]], marker="D", ms=8, mfc="none", ls="none", color=line.get_color())
            ax4.plot([PAPER_BLOCK], [p[0]], marker="^", ms=8, mfc="none", ls="none", color=line.get_color())
            marked = True
        line = ax5.plot(c["length"], c["unique"], marker="o", ms=3, label=name)[0]
        ax5.plot(c["length"], c["linear"], ls=":", color=line.get_color(), lw=1)
    if marked:
        ax4.plot([], [], marker="D", mfc="none", ls="none", color="0.3", label="paper Table 4, fixed K = 4, MN")
        ax4.plot([], [], marker="^", mfc="none", ls="none", color="0.3", label="paper Table 4, fixed K = 4, CG")
    ax4.axhline(1.0, color="0.6", lw=0.8)
    ax4.set_xlabel("verify block length L")
    ax4.set_ylabel("verify forward cost (× its own one-token step)")
    ax4.set_title("Fig. 4: dense vs MoE verification, offloaded (measured)", fontsize=9)
    ax5.set_xlabel("verify block length L")
    ax5.set_ylabel("unique routed layer-experts |U(B)|")
    ax5.set_title("Fig. 5: unique experts vs L (dotted: L · AR step; paper: no values)", fontsize=9)
    for ax in (ax4, ax5):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, out_stem, source)
