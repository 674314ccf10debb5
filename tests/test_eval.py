"""lm-eval through the registered `draftexpert` model, for real: generation through the suite's
decoders (answers identical across methods), scoring through the target's forward."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from bench.cli import app

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from bench.steps.eval_tasks import mbpp, mbpp_results, passes  # noqa: E402
from bench.steps.evaluation import DraftExpertLM, evaluate, lm_eval_main  # noqa: E402


def test_mbpp_pass_at_1_runs_the_tests():
    tests = ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]
    assert passes("def add(a, b):\n    return a + b", tests)
    assert not passes("def add(a, b):\n    return a * b", tests)
    assert not passes("def add(a, b) return", tests)  # a syntax error fails, it does not raise
    assert mbpp_results({"test_list": tests}, ["def add(a, b):\n    return b + a"]) == {"pass_at_1": 1.0}


def test_the_offline_tasks_read_the_shipped_data():
    test = mbpp()["test"]
    assert len(test) == 500 and {r["task_id"] for r in test} == set(range(11, 511))


def test_lm_eval_command_line_runs_the_registered_model(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = (
        f"model=ds-tiny,model_path={tiny_checkpoint},method=draftexpert,platform=resident,max_gen_toks=6,"
        f"out={tmp_path / 'run'},draft_experts=zero"
    )
    lm_eval_main(
        [
            "--model",
            "draftexpert",
            "--model_args",
            args,
            "--tasks",
            "mbpp_offline",
            "--limit",
            "2",
            "--confirm_run_unsafe_code",
            "--output_path",
            str(tmp_path / "lm-eval"),
        ]
    )
    assert "mbpp_offline" in capsys.readouterr().out
    recs = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(r["method"] == "draftexpert" and r["category"] == "mbpp_offline" for r in recs)
    saved = list((tmp_path / "lm-eval").rglob("results*.json"))
    assert saved and "pass_at_1,none" in json.loads(saved[0].read_text())["results"]["mbpp_offline"]


def test_bench_eval_methods_answer_identically(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    args = {"expert_type": "f32", "draft_experts": "zero"}
    res = evaluate(
        "ds-tiny",
        tiny_checkpoint,
        ["mbpp"],
        ["ar", "top-r", "draftexpert"],
        tmp_path / "eval",
        platform="mn",
        limit=3,
        max_gen_toks=8,
        allow_code=True,
        lm_args=args,
        log=lambda m: None,
    )
    rows = {r["method"]: r for r in res["rows"]}
    assert res["mismatches"] == 0 and all(r["answers_equal"] and r["samples"] == 3 for r in rows.values())
    assert rows["ar"]["scores"] == rows["draftexpert"]["scores"] == rows["top-r"]["scores"]
    assert rows["ar"]["alpha"] is None and 0 <= rows["draftexpert"]["alpha"] <= 1
    assert all(r["decode_tps"] > 0 for r in rows.values())
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["rows"] == res["rows"]
    again = evaluate(
        "ds-tiny",
        tiny_checkpoint,
        ["mbpp"],
        ["ar"],
        tmp_path / "eval",
        platform="mn",
        limit=3,
        max_gen_toks=8,
        allow_code=True,
        lm_args=args,
        log=lambda m: None,
    )  # resumed: nothing decoded
    assert again["rows"][0]["scores"] == rows["ar"]["scores"]
    assert len((tmp_path / "eval" / "ar" / "records.jsonl").read_text().splitlines()) == 3


def test_a_task_that_runs_code_needs_the_flag(tiny_checkpoint, tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            "ds-tiny",
            "--model-path",
            str(tiny_checkpoint),
            "--tasks",
            "gsm8k,mbpp",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert res.exit_code == 2 and "pass --allow-code-execution" in res.output
    assert not (tmp_path / "out").exists()


def test_loglikelihood_is_the_target_forward(tiny_checkpoint):
    lm = DraftExpertLM(model="ds-tiny", model_path=str(tiny_checkpoint), method="ar", platform="resident")
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    context, continuation = "the model routes each", " token to six experts"
    ctx = lm._encode(context)
    whole = lm._encode(context + continuation)
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([whole])).logits[0].float(), -1)
    expected = float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))
    req = Instance("loglikelihood", {}, (context, continuation), 0, ("t", 0, 1))
    [(ll, greedy)] = lm.loglikelihood([req])
    assert ll == pytest.approx(expected, abs=1e-3) and ll < 0 and isinstance(greedy, bool)
    text = "the shared experts see every token"
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))])
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix = lm.tokenizer.bos_token_id if lm.tokenizer.bos_token_id is not None else lm.tokenizer.eos_token_id
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([[prefix, *ids]])).logits[0].float(), -1)
    assert rolling == pytest.approx(float(sum(logp[i, ids[i]] for i in range(len(ids)))), abs=1e-3)
