"""A user's own prompts (`--prompts FILE`: JSONL, CSV, Parquet) and suites as `datasets.Dataset`."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from bench.cells.cell import Cell
from bench.cells.decoders import make_decoder
from bench.cli import app
from bench.runs.results import read_records
from bench.runs.runner import run_cells
from bench.suites import prompts


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _run(ckpt, prompts, out, *extra):
    return _cli(
        "run",
        "--model",
        "ds-tiny",
        "--model-path",
        ckpt,
        "--platform",
        "resident",
        "--prompts",
        prompts,
        "--max-new-tokens",
        4,
        "--out",
        out,
        "--threads",
        1,
        *extra,
    )


BAD = {
    "not-json.jsonl": ('{"category": "a", "prompt": "hello"}\nnot json at all\n', "not-json.jsonl:2: not JSON"),
    "no-field.jsonl": (
        '{"category": "a", "prompt": "hello"}\n\n{"prompt": "b"}\n',
        "no-field.jsonl:3: missing field 'category'",
    ),
    "empty.jsonl": ('{"category": "a", "prompt": "   "}\n', "empty.jsonl:1: empty prompt"),
    "not-object.jsonl": ('["a", "b"]\n', "not-object.jsonl:1: expected an object"),
    "number.jsonl": ('{"category": "a", "prompt": 7}\n', "number.jsonl:1: field 'prompt' must be text"),
    "twice.jsonl": (
        '{"id": "q", "category": "a", "prompt": "x"}\n{"id": "q", "category": "a", "prompt": "y"}\n',
        "twice.jsonl:2: id 'q' repeats line 1",
    ),
    "too-long.jsonl": (
        json.dumps({"category": "a", "prompt": "the model " * 400}) + "\n",
        "too-long.jsonl:1: the prompt is",
    ),
    "empty-cell.csv": ("category,prompt\na,hello\na,\n", "empty-cell.csv: row 2: no prompt"),
    "no-column.csv": ("category,text\na,hello\n", "no-column.csv: row 1: missing field 'prompt'"),
    "prompts.txt": ("hello\n", "unknown format '.txt'"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_prompt_file_names_the_line_and_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch, name):
    text, words = BAD[name]
    if name == "too-long.jsonl":  # the tiny checkpoint's context: set small, so the prompt alone overflows it
        monkeypatch.setattr("bench.cells.decoders.context_length", lambda folder, engine: 64)
    f = tmp_path / name
    f.write_text(text)
    res = _run(tiny_checkpoint, f, tmp_path / "out")
    assert res.exit_code == 2 and words in res.output, res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


def test_a_user_file_runs_in_every_format(tiny_checkpoint, tmp_path):
    rows = [
        {"category": "mine", "prompt": "the model routes each token"},
        {"id": "second", "category": "mine", "prompt": "six experts and the shared experts"},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).drop(columns="id").to_csv(tmp_path / "p.csv", index=False)
    pd.DataFrame(rows).drop(columns="id").to_parquet(tmp_path / "p.parquet")
    tokens = {}
    for kind in ("jsonl", "csv", "parquet"):
        out = tmp_path / f"run-{kind}"
        res = _run(tiny_checkpoint, tmp_path / f"p.{kind}", out, "--json")
        assert res.exit_code == 0, res.output
        recs = json.loads(res.stdout[res.stdout.index("{") :])["records"]
        assert [r["category"] for r in recs] == ["mine", "mine"]
        tokens[kind] = [r["tokens"] for r in recs]
        assert all(len(t) == 4 for t in tokens[kind])
    assert [r["prompt_id"] for r in recs] == ["p-0001", "p-0002"]  # tables have no ids: their rows name them
    assert tokens["jsonl"] == tokens["csv"] == tokens["parquet"]
    again = _run(tiny_checkpoint, tmp_path / "p.jsonl", tmp_path / "run-jsonl")
    assert again.exit_code == 0 and "0 written, 2 already done" in again.output


def test_prompt_suites_travel_as_datasets_and_run_the_same(tiny_checkpoint, tmp_path):
    recs = prompts.load("gsm8k", limit=2)
    ds = prompts.as_dataset(recs)
    assert ds.column_names == list(prompts.COLUMNS) and ds[1]["prompt"] == recs[1]["prompt"]
    dec, tok, cfg = make_decoder(Cell(method="ar", platform="resident", max_new_tokens=4), tiny_checkpoint)
    for name, suite in (("list", recs), ("dataset", ds)):
        run_cells(cfg, suite, dec, tok, tmp_path / name, log=lambda m: None)
    assert [r["tokens"] for r in read_records(tmp_path / "list" / "records.jsonl")] == [
        r["tokens"] for r in read_records(tmp_path / "dataset" / "records.jsonl")
    ]


def test_prompts_and_suites_do_not_mix(tiny_checkpoint, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"category": "a", "prompt": "x"}\n')
    res = _run(tiny_checkpoint, tmp_path / "p.jsonl", tmp_path / "out", "--suite", "gsm8k")
    assert res.exit_code == 2 and "--prompts: a prompt file replaces the suites; drop --suite" in res.output
    assert not (tmp_path / "out").exists()
