"""Spec-Bench in and out: its question format (multi-turn), the shipped suite, the answer export
and the replicas of its speed.py / equal.py measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bench.cells import registry
from bench.cells.artifacts import expert_file_for
from bench.cells.cell import Cell
from bench.cells.decoders import make_decoder
from bench.cli import app
from bench.runs.export import answers_equal, read_answers, spec_bench_answer, spec_bench_speed
from bench.runs.results import read_records
from bench.runs.runner import merge_turns, run_cells
from bench.suites import prompts
from draftexpert import metrics


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


Q = {"question_id": 7, "category": "writing", "turns": ["Write a haiku.", "Now another one."]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"question_id": 1, "category": "qa"}, "missing field 'turns'"),
        ({"question_id": 1, "category": "qa", "turns": []}, "'turns' must be a non-empty list"),
        ({"question_id": 1, "category": "qa", "turns": ["a", "  "]}, "turn 2 is empty"),
        ({"question_id": 1, "category": "qa", "turns": ["a", 3]}, "turn 2 must be text, got int"),
        ({"question_id": 1, "category": "qa", "turns": "abc"}, "'turns' must be a non-empty list"),
        ({"question_id": None, "category": "qa", "turns": ["a"]}, "'question_id' must be a number or text"),
        ({"question_id": 1, "turns": ["a"]}, "missing field 'category'"),
        ({"question_id": 7, "category": "qa", "turns": ["a"]}, "question_id 7 repeats line 1"),
    ],
)
def test_bad_question_files_name_the_line(tmp_path, bad, message):
    path = _write(tmp_path / "q.jsonl", [Q, bad])
    with pytest.raises(prompts.PromptFileError) as e:
        prompts.read_prompt_file(path)
    assert f"{path}:2: " in str(e.value) and message in str(e.value)


def test_question_records_keep_id_turns_and_category(tmp_path):
    recs = prompts.read_prompt_file(_write(tmp_path / "q.jsonl", [Q, {**Q, "question_id": "x-1", "turns": ["b"]}]))
    assert [r["id"] for r in recs] == ["7", "x-1"] and recs[0]["question_id"] == 7
    assert recs[0]["turns"] == Q["turns"] and recs[0]["prompt"] == Q["turns"][0]
    assert recs[0]["location"] == f"{tmp_path / 'q.jsonl'}:1"


def test_spec_bench_suite_is_shipped_whole_with_its_tasks():
    recs = prompts.load("spec_bench")
    assert len(recs) == 480 and len({r["question_id"] for r in recs}) == 480
    by_task = {t: [r for r in recs if r["category"] == t] for t in prompts.SPEC_BENCH_TASKS}
    assert {t: len(v) for t, v in by_task.items()} == dict.fromkeys(prompts.SPEC_BENCH_TASKS, 80)
    assert {r["source_category"] for r in by_task["mt_bench"]} == set(prompts.MT_BENCH_CATEGORIES)
    assert all(len(r["turns"]) == 2 for r in by_task["mt_bench"])
    assert all(len(r["turns"]) == 1 for t in prompts.SPEC_BENCH_TASKS[1:] for r in by_task[t])
    two = prompts.load("spec_bench", limit=2)
    assert [r["category"] for r in two] == [t for t in prompts.SPEC_BENCH_TASKS for _ in range(2)]
    assert prompts.load()[0]["category"] == "chat"  # the default is still the six


def test_later_turns_see_the_conversation(tiny_checkpoint):
    _, tok, _ = make_decoder(Cell(method="ar", platform="resident", max_new_tokens=2), tiny_checkpoint)
    first = prompts.render_conversation(tok, Q["turns"], [])
    second = prompts.render_conversation(tok, Q["turns"], ["ANSWER ONE"])
    assert first == prompts.render_prompt(tok, Q["turns"][0])
    text = tok.decode(second)
    assert text.index(Q["turns"][0]) < text.index("ANSWER ONE") < text.index(Q["turns"][1])
    assert len(second) > len(first)
    with pytest.raises(ValueError, match="turn 3"):
        prompts.render_conversation(tok, Q["turns"], ["a", "b"])


def test_plain_template_without_a_chat_template(tiny_checkpoint):
    _, tok, _ = make_decoder(Cell(method="ar", platform="resident", max_new_tokens=2), tiny_checkpoint)
    tok.chat_template = None
    text = tok.decode(prompts.render_conversation(tok, ["hi", "more"], ["yes"]), skip_special_tokens=True)
    assert text.strip() == "User: hi\n\nAssistant: yes\n\nUser: more\n\nAssistant:"


def _runs(tiny_checkpoint, tmp_path, methods, questions, n=6):
    out = {}
    for method in methods:
        cell = Cell(model="ds-tiny", method=method, platform="mn", expert_type="f32", max_new_tokens=n)
        dec, tok, cfg = make_decoder(cell, tiny_checkpoint, lambda qt: expert_file_for("ds-tiny", tiny_checkpoint, qt))
        run_cells(cfg, questions, dec, tok, tmp_path / method, log=lambda m: None)
        out[method] = read_records(tmp_path / method / "records.jsonl")
        dec.close()
    return out


def test_multi_turn_runs_export_and_equal_ar(tiny_checkpoint, tmp_path):
    questions = prompts.read_prompt_file(
        _write(tmp_path / "q.jsonl", [Q, {"question_id": 8, "category": "qa", "turns": ["What is 2+2?"]}])
    )
    runs = _runs(tiny_checkpoint, tmp_path, ("ar", "draftexpert", "pld"), questions)
    ar = runs["ar"]
    two, one = ar
    assert two["prefills"] == 2 and len(two["turns"]) == 2 and "turns" not in one
    assert two["tokens"] == two["turns"][0]["tokens"] + two["turns"][1]["tokens"]
    assert two["new_tokens"] == 12 and two["decode_tokens"] == 10  # one token of each turn is its prefill's
    assert two["decode_s"] == pytest.approx(sum(t["decode_s"] for t in two["turns"]))
    assert two["turns"][1]["prompt_tokens"] > two["turns"][0]["prompt_tokens"]
    assert two["decode_loads"] == sum(t["decode_loads"] for t in two["turns"]) == metrics.counters(two)["decode_loads"]
    assert two["decode_loads"] > 0
    for method in ("draftexpert", "pld"):
        assert [r["tokens"] for r in runs[method]] == [r["tokens"] for r in ar]
        for r in runs[method]:
            turns = r.get("turns") or [r]
            assert all(sum(t["accept_lengths"]) == t["new_tokens"] - 1 for t in turns)
            assert len(r["accept_lengths"]) == r["rounds"]
    answers = {m: [spec_bench_answer(r) for r in recs] for m, recs in runs.items()}
    for m, ans in answers.items():
        a = ans[0]
        assert set(a) == {"question_id", "category", "answer_id", "model_id", "tstamp", "choices"}
        assert a["question_id"] == 7 and a["category"] == "writing" and a["model_id"] == f"ds-tiny-{m}"
        c = a["choices"][0]
        assert c["index"] == 0 and len(c["turns"]) == 2 and all(isinstance(t, str) for t in c["turns"])
        assert c["new_tokens"] == [6, 6] and all(isinstance(w, float) and w > 0 for w in c["wall_time"])
        assert sum(c["decoding_steps"]) == len(c["accept_lengths"]) and sum(c["accept_lengths"]) == 10
    assert answers["ar"][0]["choices"][0]["accept_lengths"] == [1] * 10
    assert answers["ar"][0]["choices"][0]["turns"] == answers["draftexpert"][0]["choices"][0]["turns"]
    assert answers_equal(answers["ar"], answers["draftexpert"]) and answers_equal(answers["ar"], answers["pld"])


def test_export_cli_writes_what_speed_and_equal_read(tiny_checkpoint, tmp_path):
    questions = prompts.load("spec_bench", limit=1)[:2]  # one two-turn MT-Bench question, one translation
    runs = _runs(tiny_checkpoint, tmp_path, ("ar", "top-r"), questions, n=4)
    assert len(runs["ar"][0]["turns"]) == 2
    for m in runs:
        res = CliRunner().invoke(app, ["export", str(tmp_path / m), "-o", str(tmp_path / f"{m}.jsonl")])
        assert res.exit_code == 0, res.output
    ar, top = read_answers(tmp_path / "ar.jsonl"), read_answers(tmp_path / "top-r.jsonl")
    assert [a["question_id"] for a in ar] == [81, 161] and [a["category"] for a in ar] == ["writing", "translation"]
    assert answers_equal(ar, top)
    bad = CliRunner().invoke(app, ["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.jsonl")])
    assert bad.exit_code == 2 and "no records.jsonl" in bad.output and not (tmp_path / "x.jsonl").exists()


class _Tok:  # len(input_ids) = words + 1 (a BOS), as speed.py's "- 1" expects
    def __call__(self, text):
        return type("E", (), {"input_ids": [0] + text.split()})()


def _answer(category, turns, new_tokens, wall, accept):
    return {
        "category": category,
        "choices": [{"turns": turns, "new_tokens": new_tokens, "wall_time": wall, "accept_lengths": accept}],
    }


def test_speed_replica_computes_what_speed_py_prints():
    base = [
        _answer("writing", ["a b c d", "e f"], [4, 2], [2.0, 1.0], [1] * 4),
        _answer("qa", ["x y"], [2], [1.0], [1]),
    ]
    mine = [_answer("writing", ["a b c d", "e f"], [4, 2], [1.0, 0.5], [2, 2]), _answer("qa", ["x y"], [2], [2.0], [1])]
    mt = spec_bench_speed(mine, base, _Tok(), "mt_bench")
    assert mt["tokens_per_second"] == 4.0 and mt["tokens_per_second_baseline"] == 2.0 and mt["speedup"] == 2.0
    assert mt["mean_accepted_tokens"] == 2.0
    overall = spec_bench_speed(mine, base, _Tok(), "overall")
    assert overall["speedup"] == pytest.approx(((4.0 + 1.0) / 2) / ((2.0 + 2.0) / 2))
    assert overall["mean_accepted_tokens"] == pytest.approx(5 / 3)
    assert spec_bench_speed(mine, base, _Tok(), "rag") is None
    assert not answers_equal(mine, [_answer("writing", ["a b c", "e f"], [1], [1.0], [1])])


def test_merge_turns_sums_counters_and_concatenates_tokens():
    t1 = {
        "prompt_tokens": 5,
        "tokens": [1, 2],
        "new_tokens": 2,
        "text": "a",
        "decode_s": 1.0,
        "rounds": 1,
        "drafted_at": [1, 0],
        "accept_lengths": [1],
        "ledger": {"by_phase": {"ar": {"loads": 3}}},
    }
    t2 = {
        "prompt_tokens": 9,
        "tokens": [3],
        "new_tokens": 1,
        "text": "b",
        "decode_s": 0.5,
        "rounds": 0,
        "drafted_at": [1, 1, 1],
        "accept_lengths": [],
        "ledger": {"by_phase": {"ar": {"loads": 2}, "verify": {"loads": 1}}},
    }
    m = merge_turns([t1, t2])
    assert m["tokens"] == [1, 2, 3] and m["new_tokens"] == 3 and m["decode_s"] == 1.5 and m["prefills"] == 2
    assert m["drafted_at"] == [2, 1, 1] and m["accept_lengths"] == [1] and m["prompt_tokens"] == 5
    assert m["ledger"]["by_phase"] == {"ar": {"loads": 5}, "verify": {"loads": 1}}
    assert [t["text"] for t in m["turns"]] == ["a", "b"] and "ledger" not in m["turns"][0] and "text" not in m
    assert merge_turns([t1]) == t1


def test_specbench_writes_every_task_and_method(tmp_path):
    args = ["specbench", "--model", "ds-tiny", "--limit", "1", "--max-new-tokens", "3", "--cap", "none"]
    args += ["--out", str(tmp_path)]  # the embedded ds-tiny: its context holds the first question of every task
    bad = CliRunner().invoke(app, [*args, "--spec-bench-dir", str(tmp_path / "nowhere")])
    assert bad.exit_code == 2 and "no evaluation/speed.py and equal.py" in bad.output
    assert not (tmp_path / "runs").exists()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    page = (tmp_path / "spec_bench_ds-tiny_mn_torch.md").read_text()
    data = json.loads((tmp_path / "spec_bench_ds-tiny_mn_torch.json").read_text())
    cell = data["caps"][0]
    assert set(cell["per_task"]) == {"ar", "ar-cache", "top-3", "pld", "draftexpert"}
    for label, tasks in cell["per_task"].items():
        assert set(tasks) == {*prompts.SPEC_BENCH_TASKS, "overall"}
        assert all(row["equal_ar"] for row in tasks.values()), label
        assert tasks["mt_bench"]["turns"] == 2 and tasks["overall"]["questions"] == 6
    for name in ("AR (cold)", "AR + expert cache", "top-3", "pld (training-free)", "DraftExpert"):
        assert page.count(f"| {name} |") == 7, name
    extra = cell["methods"]["ar-cache"]["extra_memory"]
    assert (
        extra["draft_expert_bytes"] > 0
        and extra["bytes"] == extra["draft_expert_bytes"] + extra["prefetch_buffer_bytes"]
    )
    assert cell["methods"]["ar-cache"]["method_args"]["staging_budget"] == extra["bytes"]
    assert all(cell["answers_equal_ar"].values())
    assert (
        read_answers(tmp_path / "spec_bench" / "ds-tiny_mn_torch" / "uncapped" / "ds-tiny-pld.jsonl")[0]["question_id"]
        == 81
    )
    runs = tmp_path / "runs" / "spec_bench-ds-tiny-mn-torch" / "uncapped"
    before = {p: p.read_bytes() for p in runs.glob("*/records.jsonl")}
    again = CliRunner().invoke(app, args)  # resumable: nothing is decoded twice
    assert again.exit_code == 0 and len(before) == 5
    assert {p: p.read_bytes() for p in runs.glob("*/records.jsonl")} == before


def test_embedded_tokenizers_load_as_speed_py_loads_them():
    """speed.py calls AutoTokenizer.from_pretrained(<model folder>) with no other argument: offline,
    the embedded models' folders must load that way (and count tokens as len(input_ids) - 1 expects)."""
    code = (
        "import sys; from transformers import AutoTokenizer; "
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); print(len(t('hello world').input_ids))"
    )
    for model in ("ds-tiny", "ml-tiny"):
        folder = registry.resolve(model)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.split()[-1]) >= 2
