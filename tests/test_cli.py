import json

import pytest

from bench.steps.reproduce import spec_compare
from bench.steps.speed import ENGINE_CELLS
from tests.conftest import REPO, bench_inproc, run_bench


def test_help_lists_commands():
    p = run_bench("--help")
    assert p.returncode == 0
    for cmd in ("models", "params", "env", "run", "prompts", "reproduce"):
        assert cmd in p.stdout


def test_env_json_measures_odirect(tmp_path):
    p = run_bench("env", "--json", "--path", str(tmp_path), "--block-size", "65536")
    assert p.returncode == 0, p.stderr
    t = json.loads(p.stdout)
    assert t["cpu"]["logical_cores"] >= 1 and t["memory"]["total_gib"] > 0
    io = t["storage"]["odirect_read"]
    assert io["block_bytes"] == 65536
    assert io.get("gb_per_s_median", 0) > 0 or "error" in io  # tmpfs refuses O_DIRECT: said, not hidden
    assert t["versions"]["torch"] and t["versions"]["transformers"]
    assert t["copy_in"]["cpu_gb_per_s"] > 0  # cg's link when the CPU is the accelerator (a GPU adds cuda_pinned)


def test_env_rejects_tiny_block():
    p = run_bench("env", "--block-size", "100")
    assert p.returncode == 2 and "--block-size" in p.stderr


def test_reproduce_writes_fig1a_and_lists_pending(tmp_path):
    """Every step end to end on ds-tiny (ml-tiny's V3 routing goes through the same steps; its engines, drafters
    and sweeps are tested on their own)."""
    p = run_bench(
        "reproduce",
        "--results",
        str(tmp_path),
        "--per-suite",
        "1",
        "--max-new-tokens",
        "6",
        "--json",
        "--model",
        "ds-tiny",
        env={"DRAFTEXPERT_CACHE": str(tmp_path / "cache")},
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert not (tmp_path / "spec_compare_ml-tiny_mn.json").exists()  # --model: only the models named
    plan = (tmp_path / "plan_ds-tiny_mn.md").read_text()  # will speculation pay: predicted, beside the regime
    assert "Will speculation pay? ds-tiny on mn, engine torch" in plan and "| top-3-k8 |" in plan
    for model in ("ds-tiny",):
        spec = json.loads((tmp_path / f"spec_compare_{model}_mn.json").read_text())
        assert set(spec["methods"]) == {
            "ar",
            "ar-resident",
            "top-1",
            "top-2",
            "top-3",
            "draftexpert",
            "draftexpert-cost",
            "auto",
            "pld",
            "ar-cache",
        }
        cache = spec["methods"]["ar-cache"]
        assert cache["method_args"]["staging_budget"] == cache["extra_memory"]["bytes"] > 0
        assert spec["methods"]["draftexpert"]["speedup_vs_cache"] is not None
        assert spec["methods"]["ar"]["physical_limit_tps"] > 0
        assert spec["methods"]["ar-resident"]["physical_limit_tps"] is None
        assert all(spec["tokens_equal_ar"].values()) and spec["methods"]["top-1"]["acceptance"] is not None
        assert spec["methods"]["draftexpert"]["method_args"]["draft_experts"]["preset"] == "full"
        assert f"### {model}" in (tmp_path / "fig2_tradeoff.md").read_text()
        assert "| MN (paper) |" in (tmp_path / "table1_platforms.md").read_text()
        f3 = (tmp_path / f"fig3_{model}_mn.md").read_text()
        assert "| top-1 |" in f3 and "| draftexpert |" in f3 and (tmp_path / "figures" / f"fig3_{model}.png").exists()
        t3 = json.loads((tmp_path / f"table3_{model}_mn.json").read_text())  # the drafting bar's setting
        assert set(t3["methods"]) == {"ar", "top-1", "top-2", "top-3", "draftexpert"} and all(
            t3["tokens_equal_ar"].values()
        )
        assert {
            r["method_args"]["k_max"] for r in t3["methods"].values() if r["method_args"].get("truncate") is False
        } == {4}
        assert "fixed K = 4" in (tmp_path / f"table3_{model}_mn.md").read_text()
        t4 = json.loads((tmp_path / f"table4_{model}_mn.json").read_text())
        assert set(t4["methods"]) == {"ar", "fixed-k", "conf-exp", "conf-exp-prefetch"}
        assert all(t4["tokens_equal_ar"].values()) and t4["methods"]["fixed-k"]["verify_cost_x_ar"] > 0
        assert t4["methods"]["conf-exp-prefetch"]["prefetch_hit_rate"] is not None
        lc = json.loads((tmp_path / f"spec_compare_{model}_mn_llama.cpp.json").read_text())
        assert lc["engine"] == "llama.cpp" and set(lc["methods"]) == set(spec["methods"])
        assert all(lc["tokens_equal_ar"].values())  # demand staging and the resident bound included
        assert lc["methods"]["ar"]["loading_share"] > 0 and lc["methods"]["ar-resident"]["decode_loads"] == 0
        eng = json.loads((tmp_path / f"engines_{model}_mn.json").read_text())
        assert all(eng["ar_tokens_equal_resident"].values()) and eng["rounds"] == 1
        assert "| torch, Q4_0 head |" in (tmp_path / f"engines_{model}_mn.md").read_text()
        f45_all = json.loads((tmp_path / f"fig45_{model}_mn.json").read_text())
        f45, dense = f45_all["curves"], f45_all["dense"]
        assert dense["curves"]["unique"] == [5] * 8  # the dense counterpart: one FFN per MoE layer, any block
        one = lambda rows: {r["bytes"] for r in rows if r["length"] == 1}  # noqa: E731
        assert one(dense["rows"]) == one(f45_all["rows"])  # and an AR step's bytes
        assert f45["length"] == list(range(1, 9)) and f45["unique"][0] == 30  # one AR step: 5 MoE layers × top-6
        assert all(a <= b for a, b in zip(f45["unique"], f45["unique"][1:])) and f45["unique"][-1] <= f45["linear"][-1]
        for engine in ("torch",):  # a quick reproduce runs Spec-Bench on the torch engine only
            sb = json.loads((tmp_path / f"spec_bench_{model}_mn_{engine}.json").read_text())
            assert [c["read_bw"] for c in sb["caps"]] == [None] and sb["questions"]["mt_bench"] == 1
            assert all(r["equal_ar"] for t in sb["caps"][0]["per_task"].values() for r in t.values())
            assert (tmp_path / "spec_bench" / f"{model}_mn_{engine}" / "uncapped" / f"{model}-pld.jsonl").exists()
        cc = json.loads((tmp_path / f"crosscheck_{model}.json").read_text())
        assert cc["prompts"] == 6 and cc["token_mismatches"] == 0 and cc["layer_positions"] > 0
    corpus = (REPO / "work" / "corpus" / "val.jsonl").exists()  # Table 5's held-out text (`bench data corpus`)
    for model in ("ds-tiny",):
        if corpus:
            t5 = json.loads((tmp_path / f"table5_{model}.json").read_text())
            assert {"top1", "residual", "logit-token", "full"} <= set(t5["presets"])
        else:
            assert "Table 5 skipped" in p.stderr and "bench data corpus" in p.stderr
    if "regime sweep skipped" not in p.stderr:  # the read cap needs root and the kernel's block-I/O throttle
        for engine in ("", "_llama.cpp"):
            rg = json.loads((tmp_path / f"regime_ds-tiny_mn{engine}.json").read_text())
            assert [c["read_bw"] for c in rg["caps"]] == [16 * 10**6, None]
            assert all(all(c["tokens_equal_ar"].values()) for c in rg["caps"])
            capped = rg["caps"][0]["methods"]["ar"]
            assert capped["method_args"]["read_bw"] == 16 * 10**6 and capped["loading_share"] > 0
        assert (tmp_path / "figures" / "regime_ds-tiny.png").stat().st_size > 1000
    assert (tmp_path / "figures" / "fig1a_params.png").stat().st_size > 1000
    assert "| ds | 15.7B | 14.4B | 91.6% | 26.8 GiB | 2.44 GiB |" in (tmp_path / "fig1a_params.md").read_text()
    assert s["pending"]


def test_reproduce_cg_rows_put_the_resident_bound_and_the_copy_in_limit_beside_ar(tmp_path, monkeypatch):
    """Table 2's cg rows (what `make reproduce` runs on a GPU machine), here with the CPU as the accelerator."""
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    written = spec_compare(
        tmp_path, lambda m: None, per_suite=1, tokens=4, models=("ds-tiny",), platform="cg", device="cpu"
    )
    assert "results/spec_compare_ds-tiny_cg_cpu.md" in written
    res = json.loads((tmp_path / "spec_compare_ds-tiny_cg_cpu.json").read_text())
    assert res["platform"] == "cg" and set(res["methods"]) == {
        "ar",
        "ar-resident",
        "top-1",
        "top-2",
        "top-3",
        "draftexpert",
        "draftexpert-cost",
        "auto",
        "pld",
        "ar-cache",
    }
    assert all(res["tokens_equal_ar"].values())
    rows = res["methods"]
    cfg = json.loads((REPO / "models" / "ds-tiny" / "config.json").read_text())
    one_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4  # fp32 on cg's accelerator
    cache = rows["ar-cache"]
    assert cache["method_args"]["cache_experts"] == cache["extra_memory"]["bytes"] // one_expert > 0
    assert 0 < cache["cache_hit_bytes"] < 1  # it saved some of cold AR's copies
    assert rows["ar-resident"]["platform"] == "resident" and rows["ar-resident"]["method_args"]["device"] == "cpu"
    assert rows["ar"]["loading_share"] > 0 and rows["ar-resident"]["decode_loads"] == 0
    assert rows["ar"]["physical_limit_tps"] > 0
    assert "copy-in rate" in (tmp_path / "spec_compare_ds-tiny_cg_cpu.md").read_text()


def test_a_staging_the_engine_lacks_is_refused_by_name(tmp_path):
    for engine, staging in (("torch", "pagefault"), ("llama.cpp", "odirect")):
        p = bench_inproc(
            "run",
            "--model",
            "ds-tiny",
            "--method",
            "ar",
            "--engine",
            engine,
            "--staging",
            staging,
            "--limit",
            "1",
            "--max-new-tokens",
            "2",
            "--out",
            str(tmp_path / engine),
        )
        assert p.returncode != 0 and "--staging" in p.stderr and staging in p.stderr, p.stderr
        assert not (tmp_path / engine / "records.jsonl").exists()


def test_reproduce_names_a_model_it_cannot_run(tmp_path):
    p = bench_inproc("reproduce", "--results", str(tmp_path), "--model", "qq")
    assert p.returncode == 2 and "--model" in p.stderr and "ds-tiny" in p.stderr and "ml" in p.stderr
    # a real model that is not here: where it was looked for and how to get it, before anything is written
    p = bench_inproc(
        "reproduce", "--results", str(tmp_path), "--model", "ds", env={"DRAFTEXPERT_MODELS": str(tmp_path)}
    )
    assert p.returncode == 2 and "was not found" in p.stderr and "hf download" in p.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("staging", ["demand", "odirect"])
def test_speed_flash_measures_a_layers_loads_against_odirect_reads(staging):
    p = run_bench(
        "speed",
        "flash",
        "--model",
        "ds-tiny",
        "--expert-type",
        "q4_0",
        "--repeats",
        "3",
        "--staging",
        staging,
        "--json",
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["staging"] == staging and r["experts"] == 6 and r["load_ms"]["n"] == 3 and r["read_gb_per_s"] > 0
    bad = run_bench("speed", "flash", "--model", "ds-tiny", "--staging", "pagefault")
    assert bad.returncode == 2 and "--staging" in bad.stderr


def test_speed_engines_reports_both_engines_beside_their_resident_bounds():
    """`bench speed engines` (the engine ratio and AR / resident): every configuration decoded,
    each engine's staged AR equal to its resident bound token for token."""
    pytest.importorskip("llama_cpp")
    p = run_bench(
        "speed", "engines", "--model", "ds-tiny", "--suite", "chat", "--max-new-tokens", "8", "--rounds", "1", "--json"
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["ms_per_token"]) == {label for label, _ in ENGINE_CELLS}
    assert all(v["n"] == 1 and v["median"] > 0 for v in r["ms_per_token"].values())
    assert r["stall_ms_per_token"]["llama.cpp"]["median"] > 0 == r["stall_ms_per_token"]["llama.cpp resident"]["median"]
    assert all(r["ar_tokens_equal_resident"].values())
    assert r["x_llama_cpp"]["llama.cpp"] == 1 and r["x_llama_cpp"]["torch, Q4_0 head"] > 0
    assert 0 <= r["tokens_following_llama_cpp"]["Q4_0 head"] <= 8
    assert r["read_bw"] > 0 and all(r["limit_tps"][e] > 0 for e in r["resident_of"])  # measured by `bench env`'s probe
    assert r["bytes_per_token"]["torch"] == r["bytes_per_token"]["llama.cpp"]  # the same experts, the same file


def test_speed_host_measures_loads_against_a_copy():
    """The cg load benchmark runs anywhere (the CPU as the accelerator here; `make gpu-check` on a GPU)."""
    p = run_bench("speed", "host", "--model", "ds-tiny", "--repeats", "3", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["experts"] == 6 and r["bytes"] == 6 * 3 * 128 * 256 * 2  # gate_up, down as stored: bf16
    assert r["load_ms"]["n"] == 3 and r["efficiency"] > 0 and r["copy_gb_per_s"] > 0
