import json

import pytest

from bench import registry
from tests.conftest import run_bench


@pytest.fixture
def empty_env(tmp_path, monkeypatch):
    models, hf = tmp_path / "models", tmp_path / "hf"
    models.mkdir()
    hf.mkdir()
    env = {"DRAFTEXPERT_MODELS": str(models), "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def test_missing_real_model_names_every_place_searched(empty_env, tmp_path):
    with pytest.raises(registry.ModelNotFound) as e:
        registry.resolve("ds", tmp_path / "nowhere")
    msg = str(e.value)
    for place in [tmp_path / "nowhere", tmp_path / "models" / "ds", tmp_path / "models" / "DeepSeek-V2-Lite",
                  tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V2-Lite"]:
        assert str(place) in msg
    assert "hf download deepseek-ai/DeepSeek-V2-Lite" in msg


def test_cli_missing_model_exits_nonzero_without_traceback(empty_env):
    p = run_bench("run", "--model", "ml", "--limit", "1", env=empty_env)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "Moonlight-16B-A3B" in p.stderr and "hf download moonshotai/Moonlight-16B-A3B" in p.stderr
    assert empty_env["DRAFTEXPERT_MODELS"] in p.stderr


def test_cli_unknown_model_names_the_flag():
    p = run_bench("params", "--model", "gpt2")
    assert p.returncode == 2 and "--model" in p.stderr and "ds-tiny" in p.stderr


def test_resolution_order(empty_env, tmp_path, tiny_checkpoint):
    # $DRAFTEXPERT_MODELS/<repo basename> is found; --model-path wins over it
    link = tmp_path / "models" / "DeepSeek-V2-Lite"
    link.symlink_to(tiny_checkpoint)
    assert registry.resolve("ds") == link
    assert registry.resolve("ds", tiny_checkpoint) == tiny_checkpoint


def test_hf_cache_snapshot_is_found_offline(empty_env, tmp_path, tiny_checkpoint):
    repo = tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V2-Lite"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / "abc123").symlink_to(tiny_checkpoint)
    (repo / "refs" / "main").write_text("abc123")
    assert registry.resolve("ds") == repo / "snapshots" / "abc123"


def test_models_json_lists_all_four(empty_env):
    p = run_bench("models", "--json", env=empty_env)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {"ds", "ml", "ds-tiny", "ml-tiny"}
    assert rows["ds"]["config"]["n_routed_experts"] == 64 and rows["ds"]["config"]["scoring_func"] == "softmax"
    assert rows["ml"]["config"]["scoring_func"] == "sigmoid" and not rows["ml"]["present"]
