import json
from pathlib import Path

import pytest

from bench.cells import registry
from tests.conftest import bench_inproc, run_bench


@pytest.fixture
def empty_env(tmp_path, monkeypatch):
    models, hf = tmp_path / "models", tmp_path / "hf"
    models.mkdir()
    hf.mkdir()
    env = {"DRAFTEXPERT_MODELS": str(models), "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def ds_shaped(tmp_path) -> Path:
    """A folder whose config.json is DeepSeek-V2-Lite's (no weights: resolution reads the config only)."""
    folder = tmp_path / "ds-config"
    folder.mkdir()
    (folder / "config.json").write_text((registry.FACTS_DIR / "ds.json").read_text())
    return folder


def test_missing_real_model_names_every_place_searched(empty_env, tmp_path):
    with pytest.raises(registry.ModelNotFound) as e:
        registry.resolve("ds")
    msg = str(e.value)
    for place in [
        tmp_path / "models" / "ds",
        tmp_path / "models" / "DeepSeek-V2-Lite",
        tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V2-Lite",
    ]:
        assert str(place) in msg
    assert "hf download deepseek-ai/DeepSeek-V2-Lite" in msg


@pytest.mark.parametrize("make", ["missing", "empty", "file", "no-config"])
def test_explicit_model_path_is_the_only_place_looked(empty_env, tmp_path, make):
    """An explicit --model-path that is not a model folder is an error — for an embedded model
    too, never a silent fall-back to the committed weights."""
    path = tmp_path / "given"
    if make == "empty":
        path.mkdir()
    elif make == "file":
        path.write_text("x")
    elif make == "no-config":
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(registry.ModelNotFound) as e:
        registry.resolve("ds-tiny", path)
    assert str(path) in str(e.value) and "--model-path" in str(e.value)


def test_a_checkpoint_must_be_the_model_named(empty_env, tiny_checkpoint, ds_shaped):
    with pytest.raises(registry.ModelMismatch, match="not 'ds'.*num_hidden_layers 2 \\(not 27\\)"):
        registry.resolve("ds", tiny_checkpoint)  # a tiny V2 folder is not DeepSeek-V2-Lite
    with pytest.raises(registry.ModelMismatch, match="DeepseekV3ForCausalLM.*matches --model ml-tiny"):
        registry.resolve("ds-tiny", registry.EMBEDDED_DIR / "ml-tiny")
    with pytest.raises(registry.ModelMismatch, match="DeepseekV2ForCausalLM"):
        registry.resolve("ml", ds_shaped)
    assert registry.resolve("ds", ds_shaped) == ds_shaped


def test_cli_wrong_or_missing_model_path_exits_nonzero_and_writes_nothing(empty_env, tmp_path):
    out = tmp_path / "run"
    for path, words in [
        (tmp_path / "nonexistent", "does not exist"),
        (registry.EMBEDDED_DIR / "ml-tiny", "not 'ds-tiny'"),
    ]:
        p = bench_inproc(
            "run",
            "--model",
            "ds-tiny",
            "--model-path",
            str(path),
            "--suite",
            "gsm8k",
            "--limit",
            "1",
            "--out",
            str(out),
            env=empty_env,
        )
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_models_lists_a_foreign_folder_only_under_its_own_name(empty_env):
    p = run_bench("models", "--json", "--model-path", str(registry.EMBEDDED_DIR / "ml-tiny"), env=empty_env)
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert [n for n, r in rows.items() if r["present"]] == ["ml-tiny"]
    assert "not 'ml'" in rows["ml"]["not_it"] and rows["ml"]["config"]["num_hidden_layers"] == 27


def test_cli_missing_model_exits_nonzero_without_traceback(empty_env):
    p = bench_inproc("run", "--model", "ml", "--limit", "1", env=empty_env)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "Moonlight-16B-A3B" in p.stderr and "hf download moonshotai/Moonlight-16B-A3B" in p.stderr
    assert empty_env["DRAFTEXPERT_MODELS"] in p.stderr


def test_cli_unknown_model_names_the_flag():
    p = bench_inproc("params", "--model", "gpt2")
    assert p.returncode == 2 and "--model" in p.stderr and "ds-tiny" in p.stderr


def test_resolution_order(empty_env, tmp_path, ds_shaped):
    # $DRAFTEXPERT_MODELS/<repo basename> is found; --model-path wins over it
    link = tmp_path / "models" / "DeepSeek-V2-Lite"
    link.symlink_to(ds_shaped)
    other = tmp_path / "other"
    other.symlink_to(ds_shaped)
    assert registry.resolve("ds") == link
    assert registry.resolve("ds", other) == other


def test_hf_cache_snapshot_is_found_offline(empty_env, tmp_path, ds_shaped):
    repo = tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V2-Lite"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / "abc123").symlink_to(ds_shaped)
    (repo / "refs" / "main").write_text("abc123")
    assert registry.resolve("ds") == repo / "snapshots" / "abc123"


def test_models_json_lists_all_four(empty_env):
    p = run_bench("models", "--json", env=empty_env)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {"ds", "ml", "ds-tiny", "ml-tiny"}
    assert rows["ds"]["config"]["n_routed_experts"] == 64 and rows["ds"]["config"]["scoring_func"] == "softmax"
    assert rows["ml"]["config"]["scoring_func"] == "sigmoid" and not rows["ml"]["present"]
