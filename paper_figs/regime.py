"""The paper's regime, measured: speed-up over AR vs the storage read bandwidth (a real kernel cap,
`bench compare --set regime`), with AR's loading share on a second axis and the physical limit
(read bandwidth ÷ bytes moved per emitted token) beside every throughput. Pure: formats the rows
`bench compare` derived (`draftexpert.metrics`) into a table and a figure.

The paper's marks: its DS speed-ups on MN (1.52×) and CG (1.36×), Table 2. MN is placed at the
bandwidth where our AR's loading share equals the paper's MN loading share as the paper's own
numbers give it, 1 − 10.18 / 14.36 = 0.29 (Flash-staged AR vs resident AR TPS, §5); the paper
states no loading share for CG, so CG is a level, not a point.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import math

import matplotlib.pyplot as plt  # noqa: E402

from draftexpert import metrics  # noqa: E402
from paper_figs import paper  # noqa: E402
from paper_figs.output import require, save  # noqa: E402

PAPER_SPEEDUP = {p: paper.TABLE2[("ds", p)]["speedup"] for p in ("mn", "cg")}  # DS rows of the paper's Table 2
PAPER_MN_LOADING_SHARE = paper.MN_DS_OFFLOAD_SHARE  # Flash-staged vs resident AR
TOP_R = ("top-1", "top-2", "top-3", "top-3-k8")
DE_LONG = "draftexpert-k8"  # DraftExpert with K = 8 and no truncation (prefetch on)
DE_COST = "draftexpert-cost"  # DraftExpert with the cost controller
AUTO = ("auto", "auto-k8")  # each round's drafter (or AR) chosen by price, K_max 4 and 8
FIXED = ("top-1", "top-2", "top-3", "top-3-k8", "draftexpert", DE_LONG, "pld")  # the fixed settings of the sweep


def rows(res: dict) -> list[dict]:
    """One row per cap: AR, the best shared+top-r and DraftExpert, with their physical limits."""
    out = []
    for cell in res["caps"]:
        m, bw = cell["methods"], cell["read_bw"]
        cap = f"the regime's cell at {bw / 1e6:.0f} MB/s" if bw else "the regime's uncapped cell"
        require(m, ("ar", "draftexpert"), f"{cap}: methods")
        for label in ("ar", "draftexpert"):
            require(m[label], ("decode_tps", "loading_share", "speedup"), f"{cap}: row {label!r}")
        best = max((r for r in TOP_R if r in m), key=lambda r: m[r]["decode_tps"], default=None)
        row = {
            "read_bw": bw,
            "ar_tps": m["ar"]["decode_tps"],
            "ar_loading_share": m["ar"]["loading_share"],
            "best_top_r": best,
            "top_r_speedup": m[best]["speedup"] if best else None,
            "de_speedup": m["draftexpert"]["speedup"],
            "de_tps": m["draftexpert"]["decode_tps"],
            "de_acceptance": m["draftexpert"]["acceptance"],
            "de_long_speedup": m[DE_LONG]["speedup"] if DE_LONG in m else None,
            "pld_speedup": m["pld"]["speedup"] if "pld" in m else None,
            "ar_cache_speedup": m["ar-cache"]["speedup"] if "ar-cache" in m else None,
            "de_vs_cache": m["draftexpert"].get("speedup_vs_cache"),
            "de_cost_speedup": m[DE_COST]["speedup"] if DE_COST in m else None,
            "best_fixed_speedup": max((m[x]["speedup"] for x in FIXED if x in m), default=None),
            "auto_speedup": max((m[x]["speedup"] for x in AUTO if x in m), default=None),
            "best_auto": max((x for x in AUTO if x in m), key=lambda x: m[x]["speedup"], default=None),
            "tokens_equal_ar": all(cell["tokens_equal_ar"].values()),
        }
        for label, key in (("ar", "ar"), ("draftexpert", "de")):
            row[f"{key}_limit_tps"] = metrics.physical_limit_tps(m[label], bw)
        out.append(row)
    return out


def table(res: dict) -> str:
    lines = [
        f"{res['model']} on {res['platform']}, engine {res['engine']}: storage reads capped by the kernel "
        "(cgroup blkio throttle); limit = read bandwidth ÷ bytes moved per emitted token.",
        "",
        "DraftExpert: K_max = 4, τ = 0.6, B = 24, prefetch; DraftExpert K = 8: K_max = 8, no truncation, "
        "prefetch; best top-r: over r = 1, 2, 3 at K = 4 and r = 3 at K = 8, fixed K, no prefetch; pld: prompt "
        "lookup (training-free, not the paper's); AR-cache: AR with an LRU expert cache of DraftExpert's memory "
        "beyond AR (draft experts + prefetch buffer), DE ×AR-cache: DraftExpert over it; DE cost: DraftExpert "
        "with the cost controller (`--controller cost`, not the paper's), ÷ best fixed: over the best of the "
        "sweep's fixed settings (top-r, DraftExpert at K = 4 and 8, pld); auto: `--method auto` (each round "
        "DraftExpert, top-1, top-3 or an AR step, by price; not the paper's), the better of K_max = 4 and 8.",
        "",
        "| read cap | AR TPS | AR loading share | AR limit TPS | best top-r ×AR | DraftExpert ×AR | DE TPS | "
        "DE limit TPS | DE α | DraftExpert K = 8 ×AR | pld ×AR | AR-cache ×AR | DE ×AR-cache | DE cost ×AR | "
        "÷ best fixed | auto ×AR | ÷ best fixed | tokens equal AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v, fmt: fmt.format(v) if v is not None else "–"  # noqa: E731
    for r in rows(res):
        cap = f"{r['read_bw'] / 1e6:.0f} MB/s" if r["read_bw"] else "uncapped"
        auto_setting = f" ({r['best_auto']})" if r["best_auto"] else ""
        lines.append(
            f"| {cap} | {r['ar_tps']:.2f} | {f(r['ar_loading_share'], '{:.2f}')} | "
            f"{f(r['ar_limit_tps'], '{:.1f}')} | {f(r['top_r_speedup'], '{:.2f}')} ({r['best_top_r']}) | "
            f"{f(r['de_speedup'], '{:.2f}')} | {r['de_tps']:.2f} | {f(r['de_limit_tps'], '{:.1f}')} | "
            f"{f(r['de_acceptance'], '{:.3f}')} | {f(r['de_long_speedup'], '{:.2f}')} | "
            f"{f(r['pld_speedup'], '{:.2f}')} | {f(r['ar_cache_speedup'], '{:.2f}')} | "
            f"{f(r['de_vs_cache'], '{:.2f}')} | {f(r['de_cost_speedup'], '{:.2f}')} | "
            f"{f(r['de_cost_speedup'] / r['best_fixed_speedup'] if r['de_cost_speedup'] else None, '{:.2f}')} | "
            f"{f(r['auto_speedup'], '{:.2f}')}{auto_setting} | "
            f"{f(r['auto_speedup'] / r['best_fixed_speedup'] if r['auto_speedup'] else None, '{:.2f}')} | "
            f"{r['tokens_equal_ar']} |"
        )
    return "\n".join(lines) + "\n"


def _share_crossing(rs: list[dict], share: float) -> float | None:
    """The read bandwidth (log-interpolated between capped cells) where AR's loading share is `share`."""
    pts = sorted(
        (r["read_bw"], r["ar_loading_share"]) for r in rs if r["read_bw"] and r["ar_loading_share"] is not None
    )
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if (s0 - share) * (s1 - share) <= 0 and s0 != s1:
            t = (s0 - share) / (s0 - s1)
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return None


def figure(results: list[dict], out_stem: Path, source: str) -> list[Path]:
    """`results`: one regime result per engine (same model and platform)."""
    fig, (ax, ax_tps) = plt.subplots(1, 2, figsize=(11, 5.5))
    share_ax = ax.twinx()
    colors = {"torch": "#4c72b0", "llama.cpp": "#dd8452"}
    top = 1.0
    for res in results:
        rs = [r for r in rows(res) if r["read_bw"]]
        bw = [r["read_bw"] / 1e6 for r in rs]
        c = colors.get(res["engine"], None)
        ax.plot(bw, [r["de_speedup"] for r in rs], marker="o", color=c, label=f"DraftExpert ({res['engine']})")
        if any(r["de_long_speedup"] is not None for r in rs):
            ax.plot(
                bw,
                [r["de_long_speedup"] for r in rs],
                marker="D",
                ls="-.",
                color=c,
                label=f"DraftExpert K = 8, no truncation ({res['engine']})",
            )
        ax.plot(
            bw,
            [r["top_r_speedup"] for r in rs],
            marker="s",
            ls="--",
            color=c,
            alpha=0.6,
            label=f"best top-r ({res['engine']})",
        )
        share_ax.plot(
            bw, [r["ar_loading_share"] for r in rs], ls=":", color=c, label=f"AR loading share ({res['engine']})"
        )
        top = max([top] + [r["de_speedup"] or 0 for r in rs] + [r["top_r_speedup"] or 0 for r in rs])
        x = _share_crossing(rs, PAPER_MN_LOADING_SHARE)
        if x is not None:
            ax.plot(
                [x / 1e6],
                [PAPER_SPEEDUP["mn"]],
                marker="*",
                ms=12,
                color=c,
                ls="none",
                label=f"paper MN (DS) {PAPER_SPEEDUP['mn']}× at AR share {PAPER_MN_LOADING_SHARE:.2f} "
                f"({res['engine']})",
            )
        ax_tps.plot(bw, [r["ar_tps"] for r in rs], marker="o", color=c, label=f"AR ({res['engine']})")
        ax_tps.plot(
            bw, [r["de_tps"] for r in rs], marker="^", color=c, alpha=0.7, label=f"DraftExpert ({res['engine']})"
        )
        ax_tps.plot(
            bw, [r["ar_limit_tps"] for r in rs], ls="--", lw=1, color=c, label=f"AR physical limit ({res['engine']})"
        )
        ax_tps.plot(
            bw,
            [r["de_limit_tps"] for r in rs],
            ls=":",
            lw=1,
            color=c,
            label=f"DraftExpert physical limit ({res['engine']})",
        )
    if not any(_share_crossing([r for r in rows(res) if r["read_bw"]], PAPER_MN_LOADING_SHARE) for res in results):
        ax.axhline(
            PAPER_SPEEDUP["mn"],
            color="grey",
            ls=":",
            lw=0.8,
            label=f"paper MN (DS) {PAPER_SPEEDUP['mn']}× (its AR loading share {PAPER_MN_LOADING_SHARE:.2f} "
            "is below every one measured here)",
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(
        PAPER_SPEEDUP["cg"], color="grey", ls="-.", lw=0.8, label="paper CG (DS) 1.36× (no loading share stated)"
    )
    ticks = sorted({r["read_bw"] / 1e6 for res in results for r in rows(res) if r["read_bw"]})
    for a in (ax, ax_tps):
        a.set_xscale("log")
        a.set_xticks(ticks, [f"{t:g}" for t in ticks])
        a.minorticks_off()
        a.set_xlabel("storage read cap (MB/s, kernel throttle)")
        a.grid(alpha=0.3)
    ax.set_ylabel("decode speed-up over AR offload")
    ax.set_ylim(0, max(top, PAPER_SPEEDUP["mn"]) * 1.25)
    share_ax.set_ylabel("AR loading share (dotted)")
    share_ax.set_ylim(0, 1.05)
    ax_tps.set_yscale("log")
    ax_tps.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_tps.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax_tps.set_ylabel("decode tokens/s")
    ax.set_title("Speed-up vs read bandwidth (measured, capped for real)", fontsize=9)
    ax_tps.set_title("Throughput and the physical limit (read bw ÷ bytes per token)", fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = share_ax.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    ax_tps.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    fig.suptitle(f"{results[0]['model']} on {results[0]['platform']}", fontsize=8)
    return save(fig, out_stem, source)
