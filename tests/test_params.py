import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import registry
from draftexpert.runtime.params import breakdown

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
    from tests.conftest import run_bench

    p = run_bench("params", "--model", "ds", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["model"] == "ds" and round(100 * s["routed_share"], 1) == 91.6


def test_a_model_that_cannot_fit_is_refused_before_loading(monkeypatch):
    import pytest

    from draftexpert.runtime import params

    monkeypatch.setattr(params, "available_host_bytes", lambda: 64 << 30)  # the paper's CG host
    ds = registry.config_facts("ds")
    with pytest.raises(params.WontFit, match=r"needs 58\.5 GiB of host memory, but 64\.0 GiB"):
        params.check_fits(ds, "host", "cpu", dtype_bytes=4)  # cg with the CPU as accelerator, fp32
    assert params.check_fits(ds, "flash", "cpu", dtype_bytes=4)["host"] < 5 << 30  # mn: only the rest is held
    assert params.check_fits(registry.config_facts("ds-tiny"), "resident", "cpu", dtype_bytes=4)["host"] < 1 << 30
