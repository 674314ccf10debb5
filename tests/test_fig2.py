"""Fig. 2 from a small fixture comparison: the points, the table with the paper's values, the PNG."""
import pytest

from paper_figs import fig2


def _comparison():
    row = lambda a, d: {"acceptance": a, "draft_forward_s": d}  # noqa: E731
    return {"methods": {"ar": {"ar_forward_s": 0.010}, "top-1": row(0.4, 0.002), "top-2": row(0.5, 0.004),
                        "top-3": row(0.6, 0.005), "draftexpert": row(0.8, 0.0025)}}


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
