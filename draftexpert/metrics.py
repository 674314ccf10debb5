"""Counters in, every derived figure out — each formula written once, here (vLLM spec_decode/metrics
style). Pure Python: decoders count, the runner stores the counters in each record, and tables,
figures and `distill-eval` sum counters over records and call `derive`; nobody else divides.

Counters (summable; per prompt in a record, summed over records for a table row):
  new_tokens, decode_s     tokens emitted (tokens[0] from the prefill) and the decode phase's seconds
  prefills                 prompt forwards (1 a record; a multi-turn question's record: one a turn)
  rounds                   draft → verify rounds
  drafted, accepted        Σ K (kept draft tokens sent to verification), Σ accepted draft tokens
  truncated                rounds the controller stopped before K_max
  draft_unique             Σ_rounds layer-experts the drafter ran in the round     (Table 3 "Unique")
  verify_unique            Σ_rounds |∪ target top-k over the verify block|         (Eq. 2, |U(B)|)
  predicted_unique         Σ_rounds |Û_K| (the controller's predicted verifier set)
  drafted_at[j], accepted_at[j]   rounds that drafted ≥ j+1 tokens / accepted position j+1
  draft_unique_at[j]       Σ_rounds layer-experts the drafter had run when it proposed v_{j+1}
  decode_loads, decode_bytes      experts loaded on demand after the prefill, and their bytes
  decode_stall_s, decode_wall_s   seconds decode forwards waited for loads / took
  prefetch_{issued,bytes,hits,waste,misses}   see the Ledger
  decode_requested         layer-experts decode forwards computed with (the ledger's requested)
  oracle_loads             loads Belady's MIN makes on those requests with the run's peak expert
                           memory (the ledger's oracle; absent where the run loaded nothing)
  {ar,draft,verify}_s, _stall_s, _forwards    per phase: forward seconds, stall, forwards
Derived (`derive`):
  decode_tps          = (new_tokens − prefills) / decode_s   (each prefill's token is timed with it)
  acceptance α        = accepted / drafted
  mean_accepted_length τ = 1 + accepted / rounds            (tokens emitted per verify forward)
  per_position_acceptance[j] = accepted_at[j] / drafted_at[j]
  draft_unique_curve[j] = draft_unique_at[j] / drafted_at[j]   (Fig. 3)
  draft / verify / predicted unique per round = draft_unique / rounds, …
  decode_compute_s    = decode_wall_s − decode_stall_s
  loading_share       = decode_stall_s / decode_wall_s      (Fig. 1b)
  moved_loads / moved_bytes = decode_loads + prefetch_issued / decode_bytes + prefetch_bytes
  loads_per_token, mib_per_token = moved_loads / (new_tokens − 1), moved_bytes / (new_tokens − 1) / 2^20
  prefetch_hit_rate   = prefetch_hits / prefetch_issued;  prefetch_waste_rate = prefetch_waste / prefetch_issued
  prefetch_coverage   = prefetch_hits / (prefetch_hits + prefetch_misses)
  hit_rate            = 1 − decode_loads / decode_requested   (served without an on-demand load)
  oracle_hit_rate     = 1 − oracle_loads / decode_requested   (MIN, same memory, no prefetch needed)
  oracle_loads_per_token = oracle_loads / (new_tokens − 1)
  oracle_gap          = 1 − oracle_loads / moved_loads   (share of the moved loads MIN would not need)
  {phase}_forward_s   = {phase}_s / {phase}_forwards        (seconds per forward)
  {loading,compute,other}_ms_per_token = 1000 · (stall | compute | decode_s − wall) / (new_tokens − 1)
Relative to AR (`relative`):
  speedup             = decode_tps / AR's decode_tps
  verify_cost_x_ar    = verify_forward_s / AR's ar_forward_s            (Table 4)
Against the storage (`physical_limit_tps`):
  physical limit      = read bandwidth / (moved_bytes / (new_tokens − 1))   (tokens/s with free compute)
  predicted TPS       = 1 / max(bytes per token / read bandwidth, seconds per token as calibrated)
                        (`predicted_tps`: a calibrated roofline — the slower of moving the bytes and
                        running as measured on the calibration's own, faster, storage)
The verify-block sweep (Figs. 4–5, `verify_sweep_curves`; one cold forward per (prompt, start, L)):
  unique(L)           = mean over (prompt, start) of Σ_l |∪ top-k over the block|
  cost ×AR(L)         = mean over (prompt, start) of wall(L) / wall(1)   (L = 1 is one AR step)
  linear(L)           = L · unique(1)   (no overlap between the block's positions: the upper bound)
"""

from __future__ import annotations

PHASES = ("ar", "draft", "verify")  # decode phases whose forwards are timed separately
PREFETCH = ("issued", "bytes", "hits", "waste", "misses")
SCALARS = (
    "new_tokens",
    "prefills",
    "decode_s",
    "rounds",
    "drafted",
    "accepted",
    "truncated",
    "draft_unique",
    "verify_unique",
    "predicted_unique",
    "decode_loads",
    "decode_bytes",
    "decode_requested",
    "oracle_loads",
    "decode_stall_s",
    "decode_wall_s",
    *(f"prefetch_{k}" for k in PREFETCH),
    *(f"{p}_{k}" for p in PHASES for k in ("s", "stall_s", "forwards")),
)
LISTS = ("drafted_at", "accepted_at", "draft_unique_at")


class RoundStats:
    """Per-prompt speculation counters (the names above), one `add` per round."""

    def __init__(self, k_max: int):
        self.rounds = self.drafted = self.accepted = self.truncated = 0
        self.draft_unique = self.verify_unique = self.predicted_unique = 0
        self.drafted_at, self.accepted_at, self.draft_unique_at = [0] * k_max, [0] * k_max, [0] * k_max

    def add(self, draft, accepted: int, verify_unique: int) -> None:
        """`draft`: the round's `Draft` (tokens, touched, predicted, truncated, touched_at)."""
        self.rounds += 1
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        self.truncated += draft.truncated
        self.draft_unique += len(draft.touched)
        self.verify_unique += verify_unique
        self.predicted_unique += len(draft.predicted)
        for j in range(len(draft.tokens)):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted
            self.draft_unique_at[j] += draft.touched_at[j]

    def counters(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "rounds",
                "drafted",
                "accepted",
                "truncated",
                "draft_unique",
                "verify_unique",
                "predicted_unique",
                *LISTS,
            )
        }


def ledger_counters(ledger: dict | None) -> dict:
    """Decode-phase movement from a `Ledger.summary()`: every phase but prefill(-draft) is decode."""
    if not ledger:
        return {}
    by_phase = ledger["by_phase"]
    decode = [v for k, v in by_phase.items() if not k.startswith("prefill")]
    out = {
        "decode_loads": sum(p["loads"] for p in decode),
        "decode_bytes": sum(p["bytes"] for p in decode),
        "decode_requested": sum(p["requested"] for p in decode),
        "decode_stall_s": sum(p["stall_s"] for p in decode),
        "decode_wall_s": sum(p["wall_s"] for p in decode),
        **{f"prefetch_{k}": (ledger.get("prefetch") or {}).get(k, 0) for k in PREFETCH},
    }
    if ledger.get("oracle"):
        out["oracle_loads"] = ledger["oracle"]["loads"]
    for p in PHASES:
        if p in by_phase:
            out.update(
                {
                    f"{p}_s": by_phase[p]["wall_s"],
                    f"{p}_stall_s": by_phase[p]["stall_s"],
                    f"{p}_forwards": by_phase[p]["forwards"],
                }
            )
    return out


def counters(record: dict) -> dict:
    """The counters of one record (or of a `DecodeOutput`'s stats plus new_tokens / decode_s)."""
    out = {k: record[k] for k in SCALARS if _present(record.get(k))}
    if "new_tokens" in out:
        out["prefills"] = int(out.get("prefills") or 1)
    out.update({k: record[k] for k in LISTS if isinstance(record.get(k), list)})
    ledger = record.get("ledger")
    # movement always from the ledger the record carries
    out.update(ledger_counters(ledger if isinstance(ledger, dict) else None))
    return out


def _present(v) -> bool:
    return v is not None and v == v  # a table built with pandas fills absent fields with NaN


def total(rows: list[dict]) -> dict:
    """Counters summed over records (lists element-wise; a counter absent from some rows is summed
    over the rows that have it — `derive` then reports only what every row could count)."""
    cs = [counters(r) for r in rows]
    out: dict = {}
    for k in SCALARS:
        vals = [c[k] for c in cs if k in c]
        if vals:
            out[k] = sum(vals)
    for k in LISTS:
        if all(k in c for c in cs) and cs:
            n = max(len(c[k]) for c in cs)
            out[k] = [sum(c[k][j] for c in cs if j < len(c[k])) for j in range(n)]
    out["prompts"] = len(rows)
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def derive(c: dict) -> dict:
    """Every derived figure from (summed) counters; a figure whose counters are missing is None."""
    g = c.get
    dec = g("new_tokens", 0) - g("prefills", g("prompts", 1)) if "new_tokens" in c else None  # decode-phase tokens
    rounds = g("rounds")
    compute = g("decode_wall_s") - g("decode_stall_s") if "decode_wall_s" in c else None
    moved_loads = g("decode_loads") + g("prefetch_issued", 0) if "decode_loads" in c else None
    moved_bytes = g("decode_bytes") + g("prefetch_bytes", 0) if "decode_bytes" in c else None
    issued = g("prefetch_issued")
    out = {
        "decode_tokens": dec,
        "decode_tps": dec / g("decode_s") if dec and g("decode_s") else float("nan"),
        "acceptance": _ratio(g("accepted"), g("drafted")),
        "mean_accepted_length": 1 + g("accepted") / rounds if rounds else None,
        "draft_unique_per_round": _ratio(g("draft_unique"), rounds),
        "verify_unique_per_round": _ratio(g("verify_unique"), rounds),
        "predicted_unique_per_round": _ratio(g("predicted_unique"), rounds),
        "decode_compute_s": compute,
        "loading_share": _ratio(g("decode_stall_s"), g("decode_wall_s")),
        "moved_loads": moved_loads,
        "moved_bytes": moved_bytes,
        "loads_per_token": _ratio(moved_loads, dec),
        "mib_per_token": _ratio(moved_bytes, dec) / 2**20 if _ratio(moved_bytes, dec) is not None else None,
        "prefetch_hit_rate": _ratio(g("prefetch_hits"), issued),
        "prefetch_waste_rate": _ratio(g("prefetch_waste"), issued),
        "prefetch_coverage": _ratio(g("prefetch_hits"), (g("prefetch_hits") or 0) + (g("prefetch_misses") or 0)),
        "hit_rate": _complement(_ratio(g("decode_loads"), g("decode_requested"))),
        "oracle_hit_rate": _complement(_ratio(g("oracle_loads"), g("decode_requested"))),
        "oracle_loads_per_token": _ratio(g("oracle_loads"), dec),
        "oracle_gap": _complement(_ratio(g("oracle_loads"), moved_loads)),
        "loading_ms_per_token": _ms(g("decode_stall_s"), dec),
        "compute_ms_per_token": _ms(compute, dec),
        "other_ms_per_token": _ms(
            g("decode_s") - g("decode_wall_s") if "decode_wall_s" in c and "decode_s" in c else None, dec
        ),
        **{f"{p}_forward_s": _ratio(g(f"{p}_s"), g(f"{p}_forwards")) for p in PHASES},
    }
    if all(k in c for k in ("drafted_at", "accepted_at")):
        out["per_position_acceptance"] = [_ratio(a, d) for a, d in zip(c["accepted_at"], c["drafted_at"])]
    if all(k in c for k in ("drafted_at", "draft_unique_at")):
        out["draft_unique_curve"] = [u / d for u, d in zip(c["draft_unique_at"], c["drafted_at"]) if d]
    return out


def _complement(x):
    return None if x is None else 1 - x


def _ms(seconds, tokens):
    return 1000 * seconds / tokens if seconds is not None and tokens else None


def aggregate(rows: list[dict]) -> dict:
    """One table row: counters summed over `rows` (records), then derived (sums before ratios, so
    long prompts weigh by their tokens)."""
    c = total(rows)
    return {**c, **derive(c)}


def relative(row: dict, ar: dict | None) -> dict:
    """Figures relative to AR's row of the same table."""
    if not ar:
        return {"speedup": None, "verify_cost_x_ar": None}
    return {
        "speedup": _ratio(row.get("decode_tps"), ar.get("decode_tps")),
        "verify_cost_x_ar": _ratio(row.get("verify_forward_s"), ar.get("ar_forward_s")),
    }


def verify_sweep_curves(rows: list[dict]) -> dict[str, list[float]]:
    """{"length", "unique", "linear", "cost"}: one value per block length, ascending (Figs. 4–5)."""
    base = {(r["prompt"], r["start"]): r["wall_s"] for r in rows if r["length"] == 1}
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(r["length"], []).append(r)
    lengths = sorted(by_len)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    unique = [mean([r["unique"] for r in by_len[L]]) for L in lengths]
    return {
        "length": lengths,
        "unique": unique,
        "linear": [L * unique[0] for L in lengths],
        "cost": [mean([r["wall_s"] / base[(r["prompt"], r["start"])] for r in by_len[L]]) for L in lengths],
    }


def physical_limit_tps(row: dict, read_bw: float | None) -> float | None:
    """Tokens/s the storage allows the method at all: read bandwidth ÷ bytes moved per emitted
    token (on-demand loads + prefetches, decode phase) — no compute, no latency, perfect overlap."""
    per_token = _ratio(row.get("moved_bytes"), row.get("decode_tokens"))
    return read_bw / per_token if read_bw and per_token else None


def predicted_tps(row: dict, read_bw: float | None) -> float | None:
    """Tokens/s a method is predicted to decode at storage read bandwidth `read_bw`, from a row measured
    on faster storage (its calibration): the slower of moving its bytes per emitted token at `read_bw`
    and decoding as measured — storage reads overlap compute (staging reads ahead of the forward), so a
    token takes whichever is longer. `read_bw` None: the calibration's own storage (its measured rate)."""
    tps = row.get("decode_tps")
    if not tps or tps != tps:
        return None
    if not read_bw:
        return tps
    per_token = _ratio(row.get("moved_bytes"), row.get("decode_tokens"))
    return 1.0 / max(per_token / read_bw, 1.0 / tps) if per_token else tps
