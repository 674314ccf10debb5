"""Tables 2 / 3 / 4 (speculative methods): one row per method, formatted from the rows
`bench compare` derives from the records (`draftexpert.metrics.aggregate` / `relative`: every
formula is there); nothing here computes a figure or runs a model.
"""
from __future__ import annotations


def table(result: dict) -> str:
    cols = [("decode_tps", "TPS", "{:.2f}"), ("speedup", "×AR", "{:.2f}"), ("acceptance", "α", "{:.3f}"),
            ("mean_accepted_length", "τ", "{:.2f}"), ("draft_unique_per_round", "draft uniq", "{:.1f}"),
            ("verify_unique_per_round", "verify uniq", "{:.1f}"), ("loads_per_token", "loads/tok", "{:.1f}"),
            ("mib_per_token", "MiB/tok", "{:.2f}"), ("prefetch_hit_rate", "hit", "{:.2f}"),
            ("prefetch_waste_rate", "waste", "{:.2f}"), ("loading_share", "load share", "{:.2f}"),
            ("physical_limit_tps", "limit TPS", "{:.1f}")]
    lines = ["| method | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["methods"].items():
        cells = [fmt.format(row[k]) if row.get(k) is not None else "–" for k, _, fmt in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table4(result: dict) -> str:
    """Verify-side control: fixed K vs confidence–expansion truncation vs + prefetch."""
    cols = [("verify_cost_x_ar", "verify cost ×AR", "{:.2f}"), ("mean_accepted_length", "τ", "{:.2f}"),
            ("verify_unique_per_round", "verify uniq", "{:.1f}"), ("prefetch_hit_rate", "hit", "{:.2f}"),
            ("prefetch_waste_rate", "waste", "{:.2f}"), ("decode_tps", "TPS", "{:.2f}"), ("speedup", "×AR", "{:.2f}")]
    lines = ["| policy | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["methods"].items():
        if label == "ar":
            continue
        cells = [fmt.format(row[k]) if row.get(k) is not None else "–" for k, _, fmt in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
