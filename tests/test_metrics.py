"""draftexpert.metrics: every derived figure from hand-made counters, sums before ratios across
records, and the regime table / figure built from a small fixture of rows."""

import math

import pytest

from draftexpert import metrics
from paper_figs import regime

LEDGER = {  # a Ledger.summary() of one prompt: prefill, 3 AR-phase... here draft + verify forwards
    "total": {},
    "prefetch": {"issued": 10, "bytes": 1000, "hits": 8, "waste": 2, "misses": 4},
    "oracle": {"capacity": 40, "requested": 80, "loads": 6},
    "by_phase": {
        "prefill": {
            "requested": 30,
            "loads": 30,
            "hits": 0,
            "bytes": 3000,
            "stall_s": 0.5,
            "wall_s": 1.0,
            "forwards": 1,
            "tokens": 9,
        },
        "draft": {
            "requested": 20,
            "loads": 5,
            "hits": 15,
            "bytes": 500,
            "stall_s": 0.1,
            "wall_s": 0.4,
            "forwards": 4,
            "tokens": 4,
        },
        "verify": {
            "requested": 60,
            "loads": 4,
            "hits": 56,
            "bytes": 400,
            "stall_s": 0.1,
            "wall_s": 0.6,
            "forwards": 2,
            "tokens": 7,
        },
    },
}
RECORD = {
    "new_tokens": 9,
    "decode_s": 2.0,
    "rounds": 2,
    "drafted": 6,
    "accepted": 4,
    "truncated": 1,
    "draft_unique": 14,
    "verify_unique": 50,
    "predicted_unique": 48,
    "drafted_at": [2, 2, 1, 1],
    "accepted_at": [2, 1, 1, 0],
    "draft_unique_at": [10, 14, 8, 9],
    "ledger": LEDGER,
}


def test_derived_figures_from_one_record():
    d = metrics.derive(metrics.counters(RECORD))
    assert d["decode_tokens"] == 8 and d["decode_tps"] == 4.0  # (9 − 1) / 2 s
    assert d["acceptance"] == 4 / 6 and d["mean_accepted_length"] == 3.0  # 1 + 4 / 2
    assert d["per_position_acceptance"] == [1.0, 0.5, 1.0, 0.0]
    assert d["draft_unique_curve"] == [5.0, 7.0, 8.0, 9.0]
    assert d["draft_unique_per_round"] == 7 and d["verify_unique_per_round"] == 25
    # decode phases only (prefill excluded): loads 5 + 4, bytes 900, stall 0.2 s of 1.0 s
    assert d["moved_loads"] == 9 + 10 and d["moved_bytes"] == 900 + 1000
    assert math.isclose(d["loading_share"], 0.2) and math.isclose(d["decode_compute_s"], 0.8)
    assert d["loads_per_token"] == 19 / 8 and math.isclose(d["mib_per_token"], 1900 / 8 / 2**20)
    assert d["prefetch_hit_rate"] == 0.8 and d["prefetch_waste_rate"] == 0.2 and d["prefetch_coverage"] == 8 / 12
    assert math.isclose(d["loading_ms_per_token"], 25.0) and math.isclose(d["other_ms_per_token"], 125.0)
    assert d["draft_forward_s"] == 0.1 and d["verify_forward_s"] == 0.3 and d["ar_forward_s"] is None
    # 80 decode requests, 9 on-demand loads; MIN with the run's memory: 6 loads of the 19 moved
    assert d["hit_rate"] == 1 - 9 / 80 and d["oracle_hit_rate"] == 1 - 6 / 80
    assert d["oracle_loads_per_token"] == 6 / 8 and d["oracle_gap"] == 1 - 6 / 19


def test_tables_sum_counters_before_dividing():
    """Two prompts: α over both is Σ accepted / Σ drafted, not the mean of the two ratios."""
    other = {
        **RECORD,
        "drafted": 2,
        "accepted": 0,
        "drafted_at": [1, 1],
        "accepted_at": [0, 0],
        "draft_unique_at": [5, 9],
        "decode_s": 6.0,
    }
    a = metrics.aggregate([RECORD, other])
    assert a["prompts"] == 2 and a["acceptance"] == 4 / 8  # the mean of ratios would be (4/6 + 0) / 2
    assert a["decode_tps"] == 16 / 8.0
    assert a["drafted_at"] == [3, 3, 1, 1] and a["per_position_acceptance"] == [2 / 3, 1 / 3, 1.0, 0.0]
    ar = {"decode_tps": 1.0, "ar_forward_s": 0.15}
    rel = metrics.relative(a, ar)
    assert rel["speedup"] == 2.0 and math.isclose(rel["verify_cost_x_ar"], 2.0)  # 0.3 s per verify / 0.15
    assert metrics.relative(a, None) == {"speedup": None, "verify_cost_x_ar": None}


def test_missing_counters_give_none_not_zero():
    d = metrics.derive(metrics.counters({"new_tokens": 5, "decode_s": 1.0}))
    assert d["acceptance"] is None and d["loading_share"] is None and d["prefetch_hit_rate"] is None
    assert "per_position_acceptance" not in d


def test_physical_limit_is_bandwidth_over_bytes_per_token():
    row = metrics.aggregate([RECORD])
    assert metrics.physical_limit_tps(row, 1900.0) == 8.0  # 1900 B/s ÷ (1900 B / 8 tokens)
    assert metrics.physical_limit_tps(row, None) is None


def test_verify_sweep_curves():
    rows = [
        {"prompt": 0, "start": 0, "length": L, "unique": u, "wall_s": w}
        for L, u, w in ((1, 30, 1.0), (2, 50, 1.5), (4, 80, 3.0))
    ]
    c = metrics.verify_sweep_curves(rows)
    assert c == {"length": [1, 2, 4], "unique": [30, 50, 80], "linear": [30, 60, 120], "cost": [1.0, 1.5, 3.0]}


def _regime_fixture():
    def row(tps, share, mib, label):
        dec = 10
        return {
            "decode_tps": tps,
            "loading_share": share,
            "moved_bytes": mib * 2**20 * dec,
            "decode_tokens": dec,
            "acceptance": 0.8 if label == "draftexpert" else None,
            "speedup": None,
        }

    caps = []
    for bw, ar, de, share in ((16e6, 8.0, 10.0, 0.95), (64e6, 20.0, 18.0, 0.7), (None, 60.0, 40.0, 0.3)):
        m = {
            "ar": row(ar, share, 1.5, "ar"),
            "top-1": row(ar * 0.9, share, 1.4, "top-1"),
            "top-2": row(ar * 1.05, share, 1.4, "top-2"),
            "draftexpert": row(de, share, 1.4, "draftexpert"),
        }
        for r in m.values():
            r["speedup"] = r["decode_tps"] / ar
        caps.append({"read_bw": bw, "methods": m, "tokens_equal_ar": {"top-1": True, "draftexpert": True}})
    return {"model": "ds-tiny", "platform": "mn", "engine": "torch", "set": "regime", "caps": caps}


def test_regime_table_and_figure(tmp_path):
    res = _regime_fixture()
    rows = regime.rows(res)
    assert [r["best_top_r"] for r in rows] == ["top-2"] * 3 and rows[0]["de_speedup"] == 1.25
    assert math.isclose(rows[0]["ar_limit_tps"], 16e6 / (1.5 * 2**20))
    assert rows[2]["ar_limit_tps"] is None  # uncapped: no cap to divide
    text = regime.table(res)
    assert "| 16 MB/s | 8.00 | 0.95 |" in text and "| uncapped |" in text
    # the paper's MN mark: where AR's loading share crosses 0.29 — between 64 MB/s (0.7) and uncapped (none): absent
    assert regime._share_crossing(rows, regime.PAPER_MN_LOADING_SHARE) is None
    assert 16e6 < regime._share_crossing(rows, 0.8) < 64e6
    out = regime.figure([res, {**res, "engine": "llama.cpp"}], tmp_path / "regime", "fixture")
    assert all(p.stat().st_size > 1000 for p in out)
    del res["caps"][0]["methods"]["draftexpert"]
    with pytest.raises(ValueError, match="16 MB/s: methods lacks column.*draftexpert"):
        regime.table(res)  # a missing method is an error, not a silent blank
    del res["caps"][1]["methods"]["ar"]["loading_share"]
    with pytest.raises(ValueError, match="64 MB/s: row 'ar' lacks column.*loading_share"):
        regime.rows({**res, "caps": res["caps"][1:]})
