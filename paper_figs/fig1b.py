"""Fig. 1b: where AR-offload decode time goes — loading experts vs computing — per platform,
from AR run records (`bench run --method ar`). Pure: reads records, writes a table and a figure.

Per cell (platform, expert type), over all its records: loading / compute / other ms per token,
loading share, MiB and experts moved per token and decode TPS, as `draftexpert.metrics.aggregate`
derives them from the records' summed counters (the formulas are there).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from draftexpert import metrics  # noqa: E402
from paper_figs import paper  # noqa: E402
from paper_figs.output import require, save  # noqa: E402

COLUMNS = (
    "model",
    "platform",
    "expert_type",
    "device",
    "prompts",
    "loading_ms_per_token",
    "compute_ms_per_token",
    "other_ms_per_token",
    "loading_share",
    "mib_per_token",
    "decode_tps",
)


def paper_share(platform: str) -> str:
    """What the paper says of AR's loading share on a platform (Fig. 1b has no values)."""
    dominant = f"> {paper.FIG1B_DOMINANT_SHARE:.0%} (Fig. 1b: loading dominates)"
    return dominant + (
        f"; {paper.MN_DS_OFFLOAD_SHARE:.0%} implied by AR {paper.TABLE2[('ds', 'mn')]['ar']} vs "
        f"resident {paper.RESIDENT_MN_DS_TPS} TPS"
        if platform == "mn"
        else ""
    )


def breakdown(records: pd.DataFrame, config_hashes: set[str] | None = None) -> pd.DataFrame:
    """Per-cell time breakdown; only records of the cells in `config_hashes` when given (a run
    folder can hold cells of other machines or other weights)."""
    require(records, ("method", "method_args", "config_hash", "model", "platform"), "Fig. 1b: the record table")
    df = records[records["method"] == "ar"].copy()
    if config_hashes is not None:
        df = df[df["config_hash"].isin(config_hashes)]
    df["expert_type"] = df["method_args"].map(lambda a: a.get("expert_type", "—") if isinstance(a, dict) else "—")
    df["device"] = df["method_args"].map(lambda a: a.get("device", "?") if isinstance(a, dict) else "?")
    keys = ["model", "platform", "expert_type", "device"]
    rows = []
    for cell, g in df.groupby(keys, sort=False):
        a = metrics.aggregate(g.to_dict("records"))
        rows.append(
            {
                **dict(zip(keys, cell)),
                "prompts": a["prompts"],
                **{
                    k: a[k]
                    for k in (
                        "loading_ms_per_token",
                        "compute_ms_per_token",
                        "other_ms_per_token",
                        "loading_share",
                        "mib_per_token",
                        "loads_per_token",
                        "decode_tps",
                    )
                },
            }
        )
    out = pd.DataFrame(rows)
    return out.sort_values(["model", "platform", "expert_type"], ascending=[True, False, True], ignore_index=True)


def table(b: pd.DataFrame) -> str:
    require(b, COLUMNS, "Fig. 1b: the breakdown")
    lines = [
        "| model | platform | experts as | device | prompts | loading ms/tok | compute ms/tok | other ms/tok "
        "| loading share | MiB/tok | decode tok/s | paper loading share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in b.itertuples():
        lines.append(
            f"| {r.model} | {r.platform} | {r.expert_type} | {r.device} | {r.prompts} | "
            f"{r.loading_ms_per_token:.2f} | {r.compute_ms_per_token:.2f} | {r.other_ms_per_token:.2f} | "
            f"{100 * r.loading_share:.0f}% | {r.mib_per_token:.2f} | {r.decode_tps:.1f} | "
            f"{paper_share(r.platform)} |"
        )
    return "\n".join(lines) + "\n"


def figure(b: pd.DataFrame, out_stem: Path, source: str) -> list[Path]:
    """Stacked ms per token per cell, its loading share above; the paper's statement (> 50 %,
    MN 29 % implied) printed under the title."""
    require(b, COLUMNS, "Fig. 1b: the breakdown")
    labels = [f"{r.platform}\n{r.expert_type}\n({r.device})" for r in b.itertuples()]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(b), 3.4))
    ax.bar(labels, b.loading_ms_per_token, color="#c44e52", label="expert loading (stall)")
    ax.bar(labels, b.compute_ms_per_token, bottom=b.loading_ms_per_token, color="#4c72b0", label="compute")
    ax.bar(
        labels,
        b.other_ms_per_token,
        bottom=b.loading_ms_per_token + b.compute_ms_per_token,
        color="#aaaaaa",
        label="other (sampling, Python)",
    )
    for i, r in enumerate(b.itertuples()):
        total = r.loading_ms_per_token + r.compute_ms_per_token + r.other_ms_per_token
        paper_says = f"paper > {paper.FIG1B_DOMINANT_SHARE:.0%}" + (
            f", {paper.MN_DS_OFFLOAD_SHARE:.0%} implied" if r.platform == "mn" else ""
        )
        ax.text(i, total, f"{100 * r.loading_share:.0f}% loading\n({paper_says})", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per decoded token")
    ax.set_title(
        f"Fig. 1b — AR-offload decode time ({', '.join(sorted(set(b.model)))}, measured)\n"
        "paper: loading dominates on both platforms; MN share implied by Tables 1–2",
        fontsize=8,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, (b.loading_ms_per_token + b.compute_ms_per_token + b.other_ms_per_token).max() * 1.5)
    return save(fig, out_stem, source)
