"""A run folder's answers in Spec-Bench's answer format, and Spec-Bench's two measures of them.

`bench export --format spec-bench RUN_DIR -o FILE.jsonl` writes one line a question (in the run's
prompt order), with the fields Spec-Bench's `evaluation/speed.py` and `evaluation/equal.py` read:

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [answer text per turn], "decoding_steps": [target forwards
                  after the prefill, per turn], "new_tokens": [per turn], "wall_time": [decode
                  seconds per turn], "accept_lengths": [tokens emitted per round, over all turns]}]}

(without speculation a round is one step and emits 1). `question_id` and `category` are as in the
question file. `spec_bench_speed` and `answers_equal` compute what those two scripts print, the
same way (per-question tokens/s, averaged, ÷ the baseline's with the baseline's tokens counted by
re-tokenising its text; answers compared as `str(turns)` a line), so a table can state them beside
its own figures; the scripts themselves read the files unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.runs.results import read_records
from bench.suites.prompts import MT_BENCH_CATEGORIES, SPEC_BENCH_TASKS

TASKS = (*SPEC_BENCH_TASKS, "overall")  # speed.py's report: every task, then all questions


class ExportError(ValueError):
    """A run folder that cannot be exported as asked; the message says why and what to pass."""


def run_records(run_dir: Path, config_hash: str | None = None) -> list[dict]:
    """The records of one configuration in `run_dir` (the only one, or `config_hash`), in file
    order, a cell's last record where it was written twice."""
    path = Path(run_dir) / "records.jsonl"
    if not path.is_file():
        raise ExportError(f"{run_dir}: no records.jsonl (not a run folder, or nothing was decoded yet)")
    recs = read_records(path)
    hashes = list(dict.fromkeys(r["config_hash"] for r in recs))
    if config_hash is None:
        if len(hashes) > 1:
            raise ExportError(
                f"{run_dir} holds {len(hashes)} configurations ({', '.join(hashes)}); pick one with --config-hash"
            )
        config_hash = hashes[0] if hashes else None
    elif config_hash not in hashes:
        raise ExportError(f"{run_dir}: no records of configuration {config_hash} (it holds {', '.join(hashes)})")
    by_key = {r["key"]: r for r in recs if r["config_hash"] == config_hash}
    if not by_key:
        raise ExportError(f"{run_dir}: no records")
    return list(by_key.values())


def _turns(record: dict) -> list[dict]:
    turns = record.get("turns") or [record]
    if any("text" not in t for t in turns):
        raise ExportError(
            f"{record['prompt_id']}: the record holds no answer text (written by an older version of the suite); "
            "rerun the cell into a new folder to export it"
        )
    return turns


def spec_bench_answer(record: dict, model_id: str | None = None) -> dict:
    """One record → one line of Spec-Bench's answer file."""
    turns = _turns(record)
    steps = [t.get("accept_lengths") or [1] * (t["new_tokens"] - 1) for t in turns]
    return {
        "question_id": record.get("question_id", record["prompt_id"]),
        "category": record.get("source_category", record["category"]),
        "answer_id": record["key"],
        "model_id": model_id or f"{record['model']}-{record['method']}",
        "tstamp": record.get("finished_at"),
        "choices": [
            {
                "index": 0,
                "turns": [t["text"] for t in turns],
                "decoding_steps": [len(s) for s in steps],
                "new_tokens": [t["new_tokens"] for t in turns],
                "wall_time": [t["decode_s"] for t in turns],
                "accept_lengths": [n for s in steps for n in s],
            }
        ],
    }


def export_spec_bench(run_dir: Path, out: Path, config_hash: str | None = None, model_id: str | None = None) -> int:
    """Write `out` (JSONL, replaced whole); return the number of answers."""
    answers = [spec_bench_answer(r, model_id) for r in run_records(run_dir, config_hash)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in answers), encoding="utf-8")
    tmp.replace(out)
    return len(answers)


def read_answers(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def in_task(answer: dict, task: str) -> bool:
    if task == "overall":  # as speed.py selects: mt_bench = MT-Bench's own categories
        return True
    return answer["category"] in MT_BENCH_CATEGORIES if task == "mt_bench" else answer["category"] == task


def spec_bench_speed(answers: list[dict], base: list[dict], tokenizer, task: str = "overall") -> dict | None:
    """What Spec-Bench's speed.py prints for `task`: mean accepted tokens, tokens/s (mean over
    questions of Σ new_tokens / Σ wall_time), the baseline's (its tokens re-counted as
    len(tokenizer(text).input_ids) − 1 a turn) and their ratio. None when the task has no answers."""
    mine = [a["choices"][0] for a in answers if in_task(a, task)]
    theirs = [a["choices"][0] for a in base if in_task(a, task)]
    if not mine or not theirs:
        return None
    speeds = [sum(c["new_tokens"]) / sum(c["wall_time"]) for c in mine]
    accepted = [n for c in mine for n in c["accept_lengths"]]
    speeds0 = [sum(len(tokenizer(t).input_ids) - 1 for t in c["turns"]) / sum(c["wall_time"]) for c in theirs]
    tps, tps0 = sum(speeds) / len(speeds), sum(speeds0) / len(speeds0)
    return {
        "task": task,
        "mean_accepted_tokens": sum(accepted) / len(accepted) if accepted else float("nan"),
        "tokens_per_second": tps,
        "tokens_per_second_baseline": tps0,
        "speedup": tps / tps0,
    }


def answers_equal(a: list[dict], b: list[dict]) -> bool:
    """equal.py's verdict: the files' answers, line for line as str(turns), over the shorter file."""
    return all(str(x["choices"][0]["turns"]) == str(y["choices"][0]["turns"]) for x, y in zip(a, b))


__all__ = [
    "ExportError",
    "TASKS",
    "answers_equal",
    "export_spec_bench",
    "read_answers",
    "run_records",
    "spec_bench_answer",
    "spec_bench_speed",
]
