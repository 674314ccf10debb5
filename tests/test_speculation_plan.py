"""`bench plan --speculation`: the calibrated roofline, the verdicts, the profile as the cost
controller's prior, and the command end to end on ds-tiny."""

import json

import pytest

from bench.cells.calibration import CalibrationError, priors
from bench.cells.cell import Cell, CellError
from bench.steps import speculation_plan as sp
from bench.suites import prompts
from draftexpert.metrics import predicted_tps
from draftexpert.speculation.controller import Acceptance, CostController
from tests.conftest import bench_inproc, run_bench

MB = 10**6


def _row(tps, mb_per_token, tokens=100, **extra):
    return {"decode_tps": tps, "moved_bytes": mb_per_token * MB * tokens, "decode_tokens": tokens, **extra}


def test_predicted_tps_is_the_slower_of_moving_the_bytes_and_decoding_as_calibrated():
    row = _row(200.0, 2.0)  # 5 ms a token as calibrated; 2 MB a token
    assert predicted_tps(row, None) == 200.0  # the calibration's own storage: as measured
    assert predicted_tps(row, 16 * MB) == pytest.approx(8.0)  # 2 MB at 16 MB/s: 125 ms, the bytes decide
    assert predicted_tps(row, 1000 * MB) == pytest.approx(200.0)  # 2 ms of reads under 5 ms of decoding
    assert predicted_tps(_row(float("nan"), 2.0), 16 * MB) is None
    assert predicted_tps({"decode_tps": 50.0}, 16 * MB) == 50.0  # nothing moved (resident): as measured


def _profile(**methods):
    return {
        "model": "ds-tiny",
        "platform": "mn",
        "engine": "torch",
        "read_bw": None,
        "storage_read_bw": 2e9,
        "date": "2026-01-01",
        "prompts": ["a", "b"],
        "max_new_tokens": 8,
        "tokens_equal_ar": {k: True for k in methods if k != "ar"},
        "methods": methods,
    }


def test_speculation_pays_only_where_the_bytes_decide_and_ar_is_named_when_it_wins():
    # AR: 200 tok/s here, 2 MB a token; top-3: slower to compute (120 tok/s) but 1.5 MB a token
    prof = _profile(ar=_row(200.0, 2.0), **{"top-3": _row(120.0, 1.5, acceptance=0.7)})
    pred = sp.predict(prof, [None, 16 * MB])
    assert pred[None]["top-3"]["speedup"] == pytest.approx(0.6)
    assert pred[16 * MB]["top-3"]["speedup"] == pytest.approx(2.0 / 1.5)
    assert sp.verdict(pred[None], "here").startswith("here: AR is predicted to win")
    assert sp.verdict(pred[16 * MB], "16 MB/s") == "16 MB/s: top-3 is predicted fastest, 1.33× AR."
    text = sp.table(prof, pred)
    assert "| top-3 | 0.70 | 1.43 | 0.60 (120.0) | 1.33 (10.7) |" in text  # MiB/token from moved bytes
    regime = {"caps": [{"read_bw": 16 * MB, "methods": {"ar": {}, "top-3": {"speedup": 1.25}}}]}
    (row,) = sp.against(prof, regime)
    assert row["method"] == "top-3" and row["measured"] == 1.25 and row["error"] == pytest.approx(1.0 / 0.9375 - 1)
    assert "| 16 MB/s | top-3 | 1.33 | 1.25 | +7% |" in sp.against_table([row])


def test_the_calibration_prompts_are_held_out_of_every_limit_a_measurement_takes():
    held = sp.held_out_prompts(None)
    assert len(held) == len(prompts.SUITES)
    first = {p["id"] for s in prompts.SUITES for p in prompts.load(s, 29)}
    assert not first & {p["id"] for p in held}


def test_bench_run_names_the_prediction_or_how_to_get_one(tmp_path):
    cell = Cell(model="ds-tiny", method="top-r", spec=Cell().spec.with_(r=3, truncate=False, prefetch=False))
    assert "bench plan --speculation --model ds-tiny --platform mn --engine torch" in sp.note(tmp_path, cell)
    folder = sp.profile_dir(tmp_path, cell)
    folder.mkdir(parents=True)
    (folder / sp.PROFILE).write_text("{not json")
    assert "could not be read" in sp.note(tmp_path, cell)
    prof = _profile(ar=_row(200.0, 2.0), **{"top-3": _row(120.0, 1.5, acceptance=0.7)})
    (folder / sp.PROFILE).write_text(json.dumps(prof))
    assert sp.note(tmp_path, cell) == (
        "plan (2026-01-01, this storage): top-3 predicted 0.60× AR; "
        "AR is predicted to win (best speculative: top-3 0.60×)"
    )
    assert sp.note(tmp_path, cell.with_(read_bw=16 * MB)).endswith(
        "top-3 predicted 1.33× AR; best predicted: top-3 1.33× AR"
    )


def test_a_calibration_warms_the_acceptance_and_weighs_at_most_its_rounds():
    acc = Acceptance(4)
    # fixed K = 4 over 100 rounds: 80 accepted v_1, 60 of them v_2 as well, 30 v_3, 0 v_4
    acc.warm([100, 100, 100, 100], [80, 60, 30, 0], rounds=20)
    assert acc.trials == pytest.approx([20, 16, 12, 6]) and acc.accepted == pytest.approx([16, 12, 6, 0])
    assert acc.at(0) == pytest.approx((16 + 2 * 0.5) / 22)  # shrunk towards ½ by 2 pseudo-trials
    cold, warm = CostController(4), CostController(4, prior=([100] * 4, [80, 60, 30, 0]))
    assert cold.acc.at(1) == pytest.approx(0.5) and warm.acc.at(1) > 0.7
    warm.observe(4, 0, [])  # the run's own rounds move it (the prior's weight decaying with them)
    assert warm.acc.trials[0] == pytest.approx(32 * warm.acc.decay + 1)


def test_a_profile_calibrates_each_drafter_at_its_k_or_is_refused_by_name(tmp_path):
    rows = {
        "ar": {},
        "top-3": {"drafted_at": [10, 10, 10, 10], "accepted_at": [9, 8, 7, 6]},
        "top-3-k8": {"drafted_at": [10] * 8, "accepted_at": [9, 8, 7, 6, 5, 4, 3, 2]},
        "draftexpert": {"drafted_at": [10, 8, 6, 4], "accepted_at": [7, 5, 3, 1]},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "ds-tiny", "date": "2026-01-01", "methods": rows}))
    got, meta = priors(path, "ds-tiny", ["draftexpert", "top-3"], 8)
    assert got["top-3"][1][:8] == [9, 8, 7, 6, 5, 4, 3, 2]  # the K = 8 row at K_max 8
    assert meta["rows"] == {"draftexpert": "draftexpert", "top-3": "top-3-k8"} and len(meta["sha256"]) == 16
    with pytest.raises(CalibrationError, match="does not calibrate the drafter top-1"):
        priors(path, "ds-tiny", ["top-1"], 4)
    with pytest.raises(CalibrationError, match="calibrates ds-tiny, not ml-tiny"):
        priors(path, "ml-tiny", ["top-3"], 4)
    with pytest.raises(CellError, match="applies to --method auto and --controller cost"):
        Cell(method="top-r", calibration=path)
    priced = Cell(method="draftexpert", calibration=path, spec=Cell().spec.with_(controller="cost"))
    assert priced.priced and Cell(method="auto", calibration=path).priced


def test_bench_plan_speculation_calibrates_predicts_and_warms_auto(tmp_path):
    out = tmp_path / "plan"
    p = run_bench("plan", "--speculation", "--model", "ds-tiny", "--platform", "mn", "--max-new-tokens", "3",
                  "--cap", "16MB/s", "--out", str(out), "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    prof = res["profile"]
    assert set(prof["methods"]) == set(sp.CALIBRATED) and all(prof["tokens_equal_ar"].values())
    assert set(res["predicted"]) == {"None", "16000000"}
    assert res["predicted"]["None"]["ar"]["speedup"] == 1.0
    saved = json.loads((out / sp.PROFILE).read_text())
    assert saved["methods"]["top-3-k8"]["drafted_at"][0] > 0 and len(saved["methods"]["top-3-k8"]["drafted_at"]) == 8
    # the profile as auto's prior: recorded in the key; tokens unchanged
    runs = {}
    for extra in ([], ["--calibration", str(out / sp.PROFILE)]):
        out_run = str(tmp_path / f"run{len(extra)}")
        r = run_bench("run", "--model", "ds-tiny", "--method", "auto", "--suite", "chat", "--limit", "1",
                      "--max-new-tokens", "6", "--out", out_run, "--json", *extra)  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs[bool(extra)] = json.loads(r.stdout)["records"][0]
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["method_args"]["calibration"]["rows"] == {
        "draftexpert": "draftexpert",
        "top-1": "top-1",
        "top-3": "top-3",
    }
    assert "calibration" not in runs[False]["method_args"] and runs[True]["config_hash"] != runs[False]["config_hash"]


def test_plan_speculation_refuses_bad_input_before_decoding(tmp_path):
    bad = tmp_path / "regime.json"
    bad.write_text('{"set": "table2"}')
    p = bench_inproc("plan", "--speculation", "--model", "ds-tiny", "--platform", "mn", "--measured", bad)
    assert p.returncode == 2 and "is not a regime sweep's JSON" in p.stderr
    p = bench_inproc("plan", "--speculation", "--model", "ds-tiny", "--platform", "resident", "--cap", "16MB/s")
    assert p.returncode == 2 and "reads nothing from storage" in p.stderr
