"""How every figure is written: PNG (for the README) and PDF (for the paper), same stem, the
runs it came from printed under it; and the one check every renderer makes of its input."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def require(row: Mapping, columns: Iterable[str], what: str) -> None:
    """A renderer's input lacks a column: say which, and of what."""
    missing = [c for c in columns if c not in row]
    if missing:
        raise ValueError(f"{what} lacks column(s) {', '.join(missing)}")


def save(fig, out_stem: Path, source: str | None = None) -> list[Path]:
    """`source`: the runs (folders, machine) the figure was drawn from, printed under it."""
    if source:
        fig.text(0.005, 0.005, f"data: {source}", fontsize=6, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03 if source else 0, 1, 0.95 if fig._suptitle else 1))
    out = [out_stem.with_suffix(".png"), out_stem.with_suffix(".pdf")]
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    for p in out:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return out
