"""Fig. 2: the top-r acceptance–cheapness trade-off under cold expert offload, with DraftExpert's
point beside it. Pure: reads a method comparison (`bench compare --set table2`, the rows of
`draftexpert.metrics.aggregate`) and formats a table and a figure, the paper's values beside ours.

Per drafter (shared+top-r, r = 1, 2, 3, fixed K, no prefetch; DraftExpert):
  acceptance                 α = accepted / drafted
  draft latency × top-1      draft_forward_s / top-1's draft_forward_s (seconds per draft forward)
  speed-up over the target   AR's ar_forward_s / draft_forward_s (one target step vs one draft step)
The paper averages over draft lengths; ours are at the comparison's K_max (Table 3's K = 4).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paper_figs.output import require, save  # noqa: E402
from paper_figs.paper import FIG2 as PAPER  # noqa: E402

DRAFTERS = ("top-1", "top-2", "top-3")
NEEDED = ("acceptance", "draft_forward_s")


def points(result: dict) -> dict[str, dict]:
    """{drafter: {acceptance, draft_latency_x_top1, speedup_over_target}} from a comparison."""
    rows = result["methods"]
    missing = [m for m in ("ar", *DRAFTERS) if m not in rows]
    if missing:
        raise ValueError(f"Fig. 2 needs the comparison's rows {', '.join(missing)} (bench compare --set table2)")
    for name, row in rows.items():
        require(row, ("ar_forward_s",) if name == "ar" else NEEDED, f"Fig. 2: row {name!r}")
    top1, target = rows["top-1"]["draft_forward_s"], rows["ar"]["ar_forward_s"]
    out = {}
    for name in (*DRAFTERS, "draftexpert"):
        if name not in rows:
            continue
        d = rows[name]["draft_forward_s"]
        out[name] = {
            "acceptance": rows[name]["acceptance"],
            "draft_latency_x_top1": d / top1 if d and top1 else None,
            "speedup_over_target": target / d if d and target else None,
        }
    return out


def _f(v, fmt):
    return "—" if v is None else format(v, fmt)


def table(p: dict[str, dict]) -> str:
    lines = [
        "| drafter | acceptance | paper | draft latency × top-1 | speed-up over the target | paper |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in p.items():
        paper = PAPER.get(name, {})
        lines.append(
            f"| {name} | {_f(r['acceptance'], '.0%')} | {_f(paper.get('acceptance'), '.0%')} | "
            f"{_f(r['draft_latency_x_top1'], '.2f')}× | {_f(r['speedup_over_target'], '.2f')}× | "
            f"{_f(paper.get('speedup_over_target'), '.1f')}{'×' if paper else ''} |"
        )
    return "\n".join(lines) + "\n"


def figure(per_model: dict[str, dict[str, dict]], out_stem: Path, source: str) -> list[Path]:
    """Acceptance and the drafter's speed-up over the target vs r, one line per model, the paper's
    values dashed; DraftExpert as a star at r = 1 (its footprint is top-1's)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    r = [1, 2, 3]
    for ax, key, label in (
        (axes[0], "acceptance", "acceptance α"),
        (axes[1], "speedup_over_target", "draft speed-up over the target (×)"),
    ):
        ax.plot(r, [PAPER[d][key] for d in DRAFTERS], "k--", marker="s", ms=4, label="paper (DS-V2-Lite, Fig. 2)")
        for model, p in per_model.items():
            line = ax.plot(r, [p[d][key] for d in DRAFTERS], marker="o", ms=4, label=f"{model} shared+top-r")[0]
            if "draftexpert" in p and p["draftexpert"][key] is not None:
                ax.plot(
                    [1],
                    [p["draftexpert"][key]],
                    marker="*",
                    ms=12,
                    ls="none",
                    color=line.get_color(),
                    label=f"{model} DraftExpert",
                )
        ax.set_xticks(r, [f"top-{i}" for i in r])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    fig.suptitle("Fig. 2: top-r acceptance vs cheapness under cold offload (ours: K = 4)", fontsize=10)
    return save(fig, out_stem, source)
