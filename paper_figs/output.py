"""How every figure is written: PNG (for the README) and PDF (for the paper), same stem."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, out_stem: Path) -> list[Path]:
    fig.tight_layout()
    out = [out_stem.with_suffix(".png"), out_stem.with_suffix(".pdf")]
    for p in out:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return out
