"""Tables 2 / 3 / 4 (speculative methods) from run records: one row per method, metrics computed
from the records, never by running a model.

Per method, over all prompts (sums before ratios, so long prompts weigh by their tokens):
  decode TPS          = Σ (new_tokens − 1) / Σ decode_s
  speed-up            = decode TPS / AR's decode TPS
  α                   = Σ accepted / Σ drafted
  τ                   = 1 + Σ accepted / Σ rounds            (tokens per verify forward)
  draft / verify unique = Σ draft_unique / Σ rounds, Σ verify_unique / Σ rounds (layer-experts per block)
  loads / token       = Σ moved_loads / Σ (new_tokens − 1)   (on-demand loads + prefetches, decode phase)
  MB / token          = Σ moved_bytes / Σ (new_tokens − 1) / 2^20
  hit rate, waste     = Σ prefetch_hits / Σ prefetch_issued, Σ prefetch_waste / Σ prefetch_issued
  loading share       = Σ decode_stall_s / Σ (decode_stall_s + decode_compute_s)
  verify / AR forward = Σ verify_s / Σ verify forwards, Σ ar_s / Σ ar forwards (wall seconds per forward)
  verify cost ×AR     = verify forward seconds / AR's one-token forward seconds   (Table 4)
"""
from __future__ import annotations


def aggregate(records: list[dict]) -> dict:
    s = lambda k: sum(r.get(k) or 0 for r in records)  # noqa: E731
    dec_tokens = sum(r["new_tokens"] - 1 for r in records)
    issued = s("prefetch_issued")
    return {
        "prompts": len(records), "decode_tokens": dec_tokens,
        "decode_tps": dec_tokens / s("decode_s") if s("decode_s") else float("nan"),
        "acceptance": s("accepted") / s("drafted") if s("drafted") else None,
        "mean_accepted_length": 1 + s("accepted") / s("rounds") if s("rounds") else None,
        "draft_unique_per_round": s("draft_unique") / s("rounds") if s("rounds") else None,
        "verify_unique_per_round": s("verify_unique") / s("rounds") if s("rounds") else None,
        "loads_per_token": s("moved_loads") / dec_tokens if dec_tokens else None,
        "mib_per_token": s("moved_bytes") / dec_tokens / 2**20 if dec_tokens else None,
        "prefetch_hit_rate": s("prefetch_hits") / issued if issued else None,
        "prefetch_waste": s("prefetch_waste") / issued if issued else None,
        "loading_share": s("decode_stall_s") / (s("decode_stall_s") + s("decode_compute_s"))
        if s("decode_stall_s") + s("decode_compute_s") else None,
        **{f"{ph}_forward_s": s(f"{ph}_s") / n for ph, n in (("verify", forwards(records, "verify")),
                                                              ("ar", forwards(records, "ar"))) if n},
    }


def forwards(records: list[dict], phase: str) -> int:
    return sum(((r.get("ledger") or {}).get("by_phase", {}).get(phase) or {}).get("forwards", 0) for r in records)



def table(result: dict) -> str:
    cols = [("decode_tps", "TPS", "{:.2f}"), ("speedup", "×AR", "{:.2f}"), ("acceptance", "α", "{:.3f}"),
            ("mean_accepted_length", "τ", "{:.2f}"), ("draft_unique_per_round", "draft uniq", "{:.1f}"),
            ("verify_unique_per_round", "verify uniq", "{:.1f}"), ("loads_per_token", "loads/tok", "{:.1f}"),
            ("mib_per_token", "MiB/tok", "{:.2f}"), ("prefetch_hit_rate", "hit", "{:.2f}"),
            ("prefetch_waste", "waste", "{:.2f}"), ("loading_share", "load share", "{:.2f}")]
    lines = ["| method | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["methods"].items():
        cells = [fmt.format(row[k]) if row.get(k) is not None else "–" for k, _, fmt in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table4(result: dict) -> str:
    """Verify-side control: fixed K vs confidence–expansion truncation vs + prefetch."""
    cols = [("verify_cost_x_ar", "verify cost ×AR", "{:.2f}"), ("mean_accepted_length", "τ", "{:.2f}"),
            ("verify_unique_per_round", "verify uniq", "{:.1f}"), ("prefetch_hit_rate", "hit", "{:.2f}"),
            ("prefetch_waste", "waste", "{:.2f}"), ("decode_tps", "TPS", "{:.2f}"), ("speedup", "×AR", "{:.2f}")]
    lines = ["| policy | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["methods"].items():
        if label == "ar":
            continue
        cells = [fmt.format(row[k]) if row.get(k) is not None else "–" for k, _, fmt in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
