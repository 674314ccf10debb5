import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from bench.cells import registry
from bench.cli import app
from bench.tiny.configs import ds_tiny
from draftexpert.runtime import params
from draftexpert.runtime.loader import build_model
from draftexpert.runtime.params import _cgroup_room, breakdown
from draftexpert.speculation.drafters import make_draft_path
from tests.conftest import run_bench

GIB = 1 << 30


def test_ds_breakdown_matches_paper_fig1a():
    # Paper, Sec. 2: "routed experts account for 14.4B parameters, or 91.6% of the model weights.
    # In BF16, this routed pool alone occupies 26.8 GiB, while all non-routed weights ... 2.4 GiB."
    s = breakdown(registry.config_facts("ds")).summary()
    assert round(s["routed_experts"] / 1e9, 1) == 14.4
    assert round(100 * s["routed_share"], 1) == 91.6
    assert round(s["routed_gib_bf16"], 1) == 26.8
    assert round(s["non_routed_gib_bf16"], 1) == 2.4
    assert s["n_routed_experts_total"] == 26 * 64


@pytest.mark.parametrize("name", ["ds", "ml", "ds-tiny", "ml-tiny"])
def test_breakdown_equals_transformers_parameter_count(name):
    """The analytic count equals the tensors transformers builds from the same config (meta device)."""
    facts = {k: v for k, v in registry.config_facts(name).items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(**facts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    b = breakdown(facts)
    assert b.total == n_params + n_bias
    assert b.routed_experts == routed


def test_q4_0_is_4_5_bits_per_matrix_weight():
    s = breakdown(registry.config_facts("ds")).summary()
    assert s["routed_gib_q4_0"] == pytest.approx(s["routed_experts"] * 18 / 32 / GIB)


def test_cli_params_json():
    p = run_bench("params", "--model", "ds", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["model"] == "ds" and round(100 * s["routed_share"], 1) == 91.6


def test_the_memory_plan_and_the_refusal_before_loading():
    ds = registry.config_facts("ds")
    gib = 1 << 30
    cg = params.plan(ds, "cg", cuda=True)  # fp32 compute; the pool stays in the checkpoint's bf16
    assert cg["host_pool"] == cg["host_pinned"] == 26 * 64 * 3 * 2048 * 1408 * 2  # exact size: 26.8 GiB
    assert cg["host_load_transient"] == 64 * 3 * 2048 * 1408 * 2  # one layer at most while filling
    assert cg["host"] == cg["host_pool"] + cg["host_load_transient"]  # no pageable copy beside the pinned one
    assert params.check_fits(cg, 64 * gib, 24 * gib)  # fits; only a round staging every position warns
    with pytest.raises(params.WontFit, match=r"need 27\.8 GiB of host memory, but 24\.0 GiB"):
        params.check_fits(cg, 24 * gib, 24 * gib)
    bf16 = params.plan(ds, "cg", cuda=True, dtype_bytes=2)
    assert bf16["host_pool"] == cg["host_pool"] and bf16["accelerator_weights"] * 2 == cg["accelerator_weights"]
    ar = params.plan(ds, "mn", cuda=False, expert_type="q4_0", positions=1)
    assert abs(ar["storage"] / gib - 7.54) < 0.01  # Fig. 1a's Q4_0 pool
    assert 9 * gib < ar["host"] < 11 * gib  # AR on mn measured at a 10.1 GiB peak
    assert params.check_fits(ar, 24 * gib) is None
    spec = params.plan(ds, "mn", cuda=False, expert_type="q4_0", positions=5)  # K_max = 4, no bound on the round yet
    assert "lower --k-max" in params.check_fits(spec, 24 * gib)
    assert params.plan(ds, "cg", cuda=False)["host"] > 36 * gib  # the CPU as accelerator holds everything
    tiny = params.plan(registry.config_facts("ds-tiny"), "resident", cuda=False)
    params.check_fits(tiny, 1 * gib)


def test_bench_plan_reads_the_config_alone_and_exits_1_when_it_does_not_fit():
    r = CliRunner().invoke(
        app, ["plan", "--model", "ds", "--platform", "mn", "--method", "ar", "--host-mem", "24GiB", "--json"]
    )
    p = json.loads(r.output)
    assert r.exit_code == 0 and p["fits"] and p["host_available"] == 24 << 30 and p["storage"] > 0
    # the paper's CG host (64 GB, a 24 GB GPU) holds the exact-size bf16 pool; a 24 GiB host does not
    r = CliRunner().invoke(
        app, ["plan", "--model", "ds", "--platform", "cg", "--host-mem", "64GiB", "--gpu-mem", "24GiB", "--json"]
    )
    p = json.loads(r.output[r.output.index("{") :])
    assert r.exit_code == 0 and p["fits"] and p["host_pinned"] <= 30 << 30
    r = CliRunner().invoke(
        app, ["plan", "--model", "ds", "--platform", "cg", "--host-mem", "24GiB", "--gpu-mem", "24GiB"]
    )
    assert r.exit_code == 1 and "does not fit" in r.output and "24.0 GiB is available" in r.output
    r = CliRunner().invoke(app, ["plan", "--model", "ds", "--host-mem", "lots"])
    assert r.exit_code == 2 and "--host-mem" in r.output


def test_a_round_that_would_not_fit_gets_a_working_set_bound_that_does():
    ds, gib = registry.config_facts("ds"), 1 << 30
    spec = params.plan(ds, "mn", cuda=False, expert_type="q4_0", positions=5)  # DS, K_max 4, every position new
    assert spec["host"] > 18 * gib and params.working_set_bound(spec, 64 * gib, None) == 0  # fits: no bound
    bound = params.working_set_bound(spec, 18 * gib, None)
    assert spec["working_set_one_position"] < bound < spec["working_set"]
    bounded = params.plan(ds, "mn", cuda=False, expert_type="q4_0", positions=5, working_set_bytes=bound)
    assert bounded["host"] <= 0.9 * 18 * gib and params.check_fits(bounded, 18 * gib) is None
    cg = params.plan(ds, "cg", cuda=True, positions=5)  # the GPU holds the working set on cg
    assert 0 < params.working_set_bound(cg, 64 * gib, 24 * gib) < cg["working_set"]


def test_a_memory_cgroup_limit_is_what_is_available(tmp_path):
    """In a container or a capped group, the plan is checked against the group's room, not the machine's."""
    gib = 1 << 30
    v1 = tmp_path / "v1" / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(18 * gib))
    (v1 / "memory.usage_in_bytes").write_text(str(6 * gib))
    (v1 / "memory.stat").write_text(f"cache 1\ntotal_cache {2 * gib}\nrss 9\n")
    (tmp_path / "proc1").write_text("5:devices:/\n4:memory:/job\n0::/\n")
    assert _cgroup_room(tmp_path / "proc1", tmp_path / "v1") == 14 * gib  # page cache counts as free
    v2 = tmp_path / "v2" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text(f"{8 * gib}\n")
    (v2 / "memory.current").write_text(str(3 * gib))
    (v2 / "memory.stat").write_text(f"anon {2 * gib}\nfile {1 * gib}\n")
    (tmp_path / "proc2").write_text("0::/job\n")
    assert _cgroup_room(tmp_path / "proc2", tmp_path / "v2") == 6 * gib
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path / "proc2", tmp_path / "v2") is None  # no limit: MemAvailable decides


def test_the_plan_counts_the_draftexpert_drafters_own_shared_mlp(tiny_checkpoint):
    """DraftExpert's drafter fuses its draft expert into a copy of the shared MLP (per MoE layer):
    the plan counts those bytes — DS-V2-Lite's zero draft expert: 2.5 GiB in fp32, what the
    full-scale OOM row measured outside the plan — and exactly what `make_draft_path` holds."""
    ds, gib = registry.config_facts("ds"), 1 << 30
    spec = params.plan(ds, "mn", cuda=False, positions=5, draft_intermediate=ds["moe_intermediate_size"])
    assert spec["draft_weights"] == 26 * 3 * 2048 * (2 * 1408 + 1408) * 4 and 2.5 < spec["draft_weights"] / gib < 2.6
    assert spec["host"] == params.plan(ds, "mn", cuda=False, positions=5)["host"] + spec["draft_weights"]
    bound = params.working_set_bound(spec, 18 * gib, None)  # room for the drafter and one verify layer's loads
    layer = 30 * 3 * 2048 * 1408 * 4  # 5 positions × top-6 experts in flight at once
    assert spec["demand_one_layer"] == layer
    assert bound == int(0.9 * 18 * gib) - spec["accelerator_weights"] - spec["kv_cache"] - spec["draft_weights"] - layer
    bounded = params.plan(ds, "mn", cuda=False, positions=5, draft_intermediate=1408, working_set_bytes=bound)
    assert bounded["demand_in_flight"] == layer and bounded["host"] <= 0.9 * 18 * gib
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    model = build_model(tiny_checkpoint, "resident")
    path = make_draft_path(model, "draftexpert")
    held = sum(t.nbytes for w in path.shared.values() for t in w)
    assert held == params.plan(cfg, "mn", cuda=False, draft_intermediate=cfg["moe_intermediate_size"])["draft_weights"]
    assert params.plan(cfg, "mn", cuda=False)["draft_weights"] == 0 and torch.float32 == model.embed.dtype


def test_a_tokens_reads_and_the_routed_share_of_them():
    """DeepSeek-V2-Lite's token reads ~2.4B parameters (the paper's "2.4B active"), 55% of them routed;
    a tied embedding is read once, as the head."""
    ds = breakdown(registry.config_facts("ds", None)).summary()
    assert 2.40e9 < ds["token_params"] < 2.50e9 and 0.54 < ds["token_routed_share"] < 0.56
    cfg = ds_tiny().to_dict()
    tied = breakdown(cfg)
    untied = breakdown({**cfg, "tie_word_embeddings": False})
    assert untied.total - tied.total == cfg["vocab_size"] * cfg["hidden_size"]
    assert tied.token_params == untied.token_params  # the head is read either way, the embedding a row
    assert tied.routed_per_token == 6 * 5 * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
