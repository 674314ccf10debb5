"""Figures and tables from small fixtures: Fig. 2, Fig. 3 with the paper's points, the paper's values in Tables 2–5."""

from pathlib import Path

import pandas as pd
import pytest

from bench.steps.distill import report
from bench.steps.distill import table as table5
from paper_figs import fig1b, fig2, fig3, fig45
from paper_figs.readme import tables
from paper_figs.spec_table import table, table4


def _comparison():
    row = lambda a, d: {"acceptance": a, "draft_forward_s": d}  # noqa: E731
    return {
        "methods": {
            "ar": {"ar_forward_s": 0.010},
            "top-1": row(0.4, 0.002),
            "top-2": row(0.5, 0.004),
            "top-3": row(0.6, 0.005),
            "draftexpert": row(0.8, 0.0025),
        }
    }


def test_points_table_and_figure(tmp_path):
    p = fig2.points(_comparison())
    assert p["top-1"] == {"acceptance": 0.4, "draft_latency_x_top1": 1.0, "speedup_over_target": 5.0}
    assert p["top-3"]["draft_latency_x_top1"] == 2.5 and p["draftexpert"]["speedup_over_target"] == 4.0
    t = fig2.table(p)
    assert "| top-2 | 50% | 31% | 2.00× | 2.50× | 2.7× |" in t and "| draftexpert | 80% | — |" in t
    png = [f for f in fig2.figure({"fixture": p}, tmp_path / "fig2", "fixture records") if f.suffix == ".png"]
    assert png and png[0].stat().st_size > 10_000


def test_a_missing_row_or_column_is_named():
    c = _comparison()
    del c["methods"]["top-2"]
    with pytest.raises(ValueError, match="top-2"):
        fig2.points(c)
    c = _comparison()
    del c["methods"]["top-3"]["draft_forward_s"]
    with pytest.raises(ValueError, match="'top-3' lacks column.*draft_forward_s"):
        fig2.points(c)


def test_fig3_draws_the_papers_points_scaled_to_the_models_layers(tmp_path):
    pts = fig3.paper_points("ds-tiny", moe_layers=5)
    assert abs(pts["top-1"] - 84 * 5 / 26) < 1e-9 and set(pts) == {"top-1", "top-2", "top-3", "draftexpert"}
    curves = {"top-1": [5.0, 9.5, 13.5, 17.2], "draftexpert": [5.0, 9.6, 13.4, 16.9]}
    png = [f for f in fig3.figure(curves, tmp_path / "f3", "fixture", paper_at_k4=pts) if f.suffix == ".png"]
    assert png[0].stat().st_size > 10_000


def test_tables_print_the_papers_values_beside_ours():
    row = {"decode_tps": 10.0, "speedup": 1.0, "acceptance": 0.5}
    t2 = table({"model": "ds-tiny", "platform": "mn", "methods": {"ar": row, "top-1": row, "draftexpert": row}})
    assert "| paper α | paper ×AR |" in t2 and "| 0.225 | – |" in t2 and "| 0.850 | 1.52 |" in t2
    assert "AR 10.18 TPS" in t2 and "resident AR 14.36" in t2
    # a fixed-K DraftExpert row (Table 3's setting) is not the paper's Table 2 method: no ×AR beside it
    fixed = {**row, "method_args": {"truncate": False, "prefetch": False}}
    t3 = table({"model": "ds-tiny", "platform": "mn", "methods": {"ar": row, "draftexpert": fixed}})
    assert "| 0.850 | – |" in t3 and "1.52 |" not in t3.split("paper (DS")[0]
    t4 = table4({"model": "ml-tiny", "platform": "mn", "methods": {"conf-exp-prefetch": {"verify_cost_x_ar": 1.1}}})
    assert "| 1.40 | 0.86 / 0.14 |" in t4
    r5 = {
        "kl": 0.1,
        "token_agreement": 0.9,
        "router_agreement": 0.9,
        "acceptance_k4": 0.8,
        "prefetch_hit_rate": 0.9,
        "steps": 1,
        "tokens": 1,
        "train_seconds": 1,
    }
    assert "0.07 / 0.870 / 0.86 / 0.88" in table5({"model": "ds-tiny", "presets": {"full": r5}})
    # with its per-margin readings the report adds the margin table; without them it is Table 5 alone
    margins = {"edges": [0.0, 0.05, 1.0], "share": [0.6, 0.4], "token_agreement": [0.7, float("nan")]}
    r5m = {
        **r5,
        "by_target_margin": margins,
        "target_top1_prob": 0.3,
        "continuations": {"by_target_margin": margins, "target_top1_prob": 0.2, "tokens": 64, "token_agreement": 0.8},
    }
    assert report({"model": "ds-tiny", "presets": {"full": r5}}) == table5(
        {"model": "ds-tiny", "presets": {"full": r5}}
    )
    full = report({"model": "ds-tiny", "presets": {"full": r5m}})
    assert "| [0.00, 0.05) | 0.600 / 0.600 | 0.700 / 0.700 |" in full
    assert "| [0.05, 1.00) | 0.400 / 0.400 | – / – |" in full


def _records():
    rec = lambda platform, qtype, loading, compute: {  # noqa: E731 - one AR record of a cell
        "method": "ar",
        "model": "ds-tiny",
        "platform": platform,
        "config_hash": platform + qtype,
        "method_args": {"expert_type": qtype, "device": "cpu"},
        "prompt_id": "p",
        "new_tokens": 11,
        "decode_s": loading + compute + 0.01,
        "decode_wall_s": loading + compute,
        "decode_stall_s": loading,
        "decode_loads": 300,
        "decode_bytes": 10 * 2**20,
    }
    return pd.DataFrame([rec("mn", "q4_0", 0.1, 0.08), rec("cg", "—", 0.02, 0.09)])


def test_fig1b_from_fixture_records_prints_the_papers_statement(tmp_path):
    b = fig1b.breakdown(_records())
    assert list(b.platform) == ["mn", "cg"]
    t = fig1b.table(b)
    assert "| paper loading share |" in t and "29% implied by AR 10.18 vs resident 14.36 TPS" in t
    png = [f for f in fig1b.figure(b, tmp_path / "f1b", "fixture records, machine m") if f.suffix == ".png"]
    assert png[0].stat().st_size > 10_000
    with pytest.raises(ValueError, match="Fig. 1b: the breakdown lacks column.*loading_share"):
        fig1b.table(b.drop(columns=["loading_share"]))
    with pytest.raises(ValueError, match="Fig. 1b: the record table lacks column.*config_hash"):
        fig1b.breakdown(_records().drop(columns=["config_hash"]))


def test_fig45_draws_the_dense_half_and_the_papers_table4_points(tmp_path):
    c = {
        "length": [1, 2, 3],
        "unique": [30.0, 50.0, 65.0],
        "linear": [30, 60, 90],
        "cost": [1.0, 1.6, 2.1],
        "dense_cost": [1.0, 1.02, 1.05],
    }
    t = fig45.table(c)
    assert "dense verify cost ×step |" in t and "| 3 | 65.0 | 90 | 2.10 | 1.05 |" in t
    assert fig45.paper_costs("ds-tiny") == (2.35, 3.10) and fig45.paper_costs("other") is None
    assert "3.10× one AR step on MN" in fig45.paper_note("ds-tiny")
    png = [f for f in fig45.figure({"ds-tiny": c}, tmp_path / "f45", "fixture") if f.suffix == ".png"]
    assert png[0].stat().st_size > 10_000
    del c["cost"]
    with pytest.raises(ValueError, match="lacks column.*cost"):
        fig45.table(c)


def test_the_readme_holds_each_result_table_as_the_results_give_it():
    """README.md's numbers are the committed results' (`python -m paper_figs.readme` prints each table):
    a result regenerated without the README following, or a number typed in, fails here."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = tables()
    assert {"table2 torch", "table2 llama.cpp", "regime", "plan", "spec_bench"} <= set(found)
    stale = [name for name, text in found.items() if text not in readme]
    assert not stale, f"README.md lacks these tables as results/ gives them: {stale} (python -m paper_figs.readme)"
