"""Fig. 1a: parameter breakdown, routed experts vs every other weight, from `bench params --json`
outputs (results/params/<model>.json). Pure: reads result files, writes a table and a figure."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from paper_figs.output import save  # noqa: E402


def load(params_dir: Path, order: list[str] | None = None) -> pd.DataFrame:
    rows = [json.loads(p.read_text()) for p in sorted(params_dir.glob("*.json"))]
    df = pd.DataFrame(rows).set_index("model")
    return df.loc[[m for m in order if m in df.index]] if order else df


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _size(gib: float) -> str:
    return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"


def table(df: pd.DataFrame) -> str:
    """Markdown: params (B), routed share, GiB at bf16 and Q4_0."""
    lines = [
        "| model | total params | routed params | routed share | routed bf16 | non-routed bf16 | routed Q4_0 "
        "| non-routed Q4_0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, r in df.iterrows():
        lines.append(
            f"| {m} | {_count(r.total)} | {_count(r.routed_experts)} | {100 * r.routed_share:.1f}% | "
            f"{_size(r.routed_gib_bf16)} | {_size(r.non_routed_gib_bf16)} | {_size(r.routed_gib_q4_0)} | "
            f"{_size(r.non_routed_gib_q4_0)} |"
        )
    return "\n".join(lines) + "\n"


def figure(df: pd.DataFrame, out_stem: Path) -> list[Path]:
    fig, axes = plt.subplots(1, len(df), figsize=(3.2 * len(df), 3.2), squeeze=False)
    for ax, (m, r) in zip(axes[0], df.iterrows()):
        vals = [r.routed_gib_bf16, r.non_routed_gib_bf16]
        unit = "GiB"
        if max(vals) < 1:
            vals, unit = [v * 1024 for v in vals], "MiB"
        bars = ax.bar(["routed\nexperts", "everything\nelse"], vals, color=["#c44e52", "#4c72b0"])
        ax.bar_label(
            bars,
            labels=[
                f"{vals[0]:.1f} {unit}\n{100 * r.routed_share:.1f}%",
                f"{vals[1]:.1f} {unit}\n{100 * (1 - r.routed_share):.1f}%",
            ],
            fontsize=8,
        )
        ax.set_title(f"{m}: {_count(r.total)} params", fontsize=9)
        ax.set_ylabel(f"bf16 {unit}")
        ax.set_ylim(0, max(vals) * 1.3)
    fig.suptitle("Fig. 1a — weights by kind (from config.json alone)", fontsize=10)
    return save(fig, out_stem)
