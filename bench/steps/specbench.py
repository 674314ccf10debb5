"""`bench specbench`: Spec-Bench's questions through the suite's methods, and its table.

For one model, platform and engine: AR (cold, and with the equal-memory expert cache), the best
top-r at K = 4 (top-3), prompt lookup and DraftExpert over Spec-Bench's questions (`--limit` per
task; every turn), uncapped and under a load-bound storage read cap, each method through `compare`
(resumable run folders), then per Spec-Bench task (mt_bench, translation, summarization, qa,
math_reasoning, rag, overall): speed-up over both ARs, mean accepted tokens, expert loads per
emitted token, whether every answer equals AR's; beside them, Spec-Bench's own speed-up (its
speed.py's formula, from the exported answer files: per-question tokens/s averaged, the baseline's
tokens re-counted from its text) — and, given a Spec-Bench checkout, what its unmodified
evaluation/speed.py and equal.py print from the same files.
"""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cells.cell import Cell
from bench.runs.export import TASKS, answers_equal, export_spec_bench, read_answers, spec_bench_speed
from bench.runs.readcap import ReadCap, ReadCapError
from bench.runs.results import read_records, write_json_atomic
from bench.steps.compare import compare
from bench.suites import prompts
from draftexpert import metrics
from draftexpert.runtime.checkpoint import load_tokenizer
from paper_figs.spec_bench import page

LABELS = ("ar", "ar-cache", "top-3", "pld", "draftexpert")
DEFAULT_CAP = 12 * 10**6  # bytes/s: the embedded models' AR spends ≥ 0.9 of its decode waiting for loads there


def _task_rows(recs: list[dict], ar: dict[str, dict]) -> dict[str, dict]:
    """Per task (and overall): the summed counters derived, and whether every answer equals AR's."""
    out = {}
    for task in TASKS:
        rs = [r for r in recs if task == "overall" or r["category"] == task]
        if not rs:
            continue
        row = metrics.aggregate(rs)
        row["questions"] = len(rs)
        row["turns"] = sum(len(r.get("turns") or [r]) for r in rs)
        row["equal_ar"] = all(r["tokens"] == ar[r["prompt_id"]]["tokens"] for r in rs if r["prompt_id"] in ar)
        row["seconds"] = sum(r["decode_s"] + r["prefill_s"] for r in rs)
        lengths = [n for r in rs for n in r.get("accept_lengths") or []]
        row["mean_accepted_tokens"] = sum(lengths) / len(lengths) if lengths else None
        out[task] = row
    return out


def cap_table(
    base: Cell,
    folder: Path,
    questions: list[dict],
    run_dir: Path,
    answers_dir: Path,
    expert_file,
    machine: dict | None,
    tokenizer,
    log=print,
) -> dict:
    """One cap (base.read_bw, None = uncapped): every method run, exported and tabulated per task."""
    t0 = time.perf_counter()
    res = compare(base, folder, questions, run_dir, expert_file, machine, list(LABELS), log, "spec_bench")
    elapsed = time.perf_counter() - t0
    recs, files = {}, {}
    for label, row in res["methods"].items():
        recs[label] = [
            r for r in read_records(run_dir / label / "records.jsonl") if r["config_hash"] == row["config_hash"]
        ]
        files[label] = answers_dir / f"{base.model}-{label}.jsonl"
        export_spec_bench(run_dir / label, files[label], row["config_hash"], f"{base.model}-{label}")
    ar = {r["prompt_id"]: r for r in recs["ar"]}
    asked = [q["id"] for q in questions]
    not_run = {label: [i for i in asked if i not in {r["prompt_id"] for r in rs}] for label, rs in recs.items()}
    per_task = {label: _task_rows(rs, ar) for label, rs in recs.items()}
    answers = {label: read_answers(f) for label, f in files.items()}
    for label, tasks in per_task.items():
        for task, row in tasks.items():
            row.update(metrics.relative(row, per_task["ar"].get(task)))
            row["physical_limit_tps"] = metrics.physical_limit_tps(row, res["limit_read_bw"])
            cached = per_task.get("ar-cache", {}).get(task)
            row["speedup_vs_cache"] = metrics.relative(row, cached)["speedup"] if cached else None
            sb = spec_bench_speed(answers[label], answers["ar"], tokenizer, task)
            row["spec_bench_speedup"] = sb["speedup"] if sb else None
            row["spec_bench_mean_accepted"] = sb["mean_accepted_tokens"] if sb else None
    for label, row in res["methods"].items():
        row.pop("tokens", None)
    return {
        "read_bw": base.read_bw,
        "limit_read_bw": res["limit_read_bw"],  # the cap, else the storage's measured O_DIRECT bandwidth
        "methods": res["methods"],
        "per_task": per_task,
        "answers": {label: str(f) for label, f in files.items()},
        "answers_equal_ar": {label: answers_equal(answers["ar"], a) for label, a in answers.items() if label != "ar"},
        "not_run": {label: ids for label, ids in not_run.items() if ids},
        "finished_at": [
            min(r["finished_at"] for rs in recs.values() for r in rs),
            max(r["finished_at"] for rs in recs.values() for r in rs),
        ],  # when its cells ran  # e.g. a prompt longer than the context
        "wall_s": elapsed,
    }


SPEEDUP_LINE = re.compile(r"Task:\s+(\S+)|#Mean accepted tokens:\s+(\S+)|Speedup ratio:\s+(\S+)")


def run_spec_bench_eval(spec_bench_dir: Path, answers: Path, baseline: Path, tokenizer_dir: Path) -> dict:
    """Spec-Bench's own evaluation/speed.py (its get_single_speedup: every task) and equal.py on two
    answer files, unmodified, from a checkout of Spec-Bench: {task: (mean accepted, speed-up)}, equal."""
    ev = Path(spec_bench_dir) / "evaluation"
    if not (ev / "speed.py").is_file() or not (ev / "equal.py").is_file():
        raise FileNotFoundError(f"--spec-bench-dir {spec_bench_dir}: no evaluation/speed.py and equal.py there")
    code = (
        "import sys; from speed import get_single_speedup; from equal import run_compare; "
        "get_single_speedup(sys.argv[1] + '/method.jsonl', sys.argv[1] + '/baseline.jsonl', sys.argv[2]); "
        "run_compare(sys.argv[1] + '/', 'baseline.jsonl', 'method.jsonl')"
    )
    with tempfile.TemporaryDirectory() as tmp:  # equal.py writes its txt/ copies beside the files
        shutil.copyfile(answers, Path(tmp) / "method.jsonl")
        shutil.copyfile(baseline, Path(tmp) / "baseline.jsonl")
        out = subprocess.run(
            [sys.executable, "-c", code, tmp, str(tokenizer_dir)], cwd=ev, capture_output=True, text=True, check=True
        ).stdout
    tasks, task = {}, None
    for m in SPEEDUP_LINE.finditer(out):
        if m.group(1):
            task = m.group(1)
            tasks[task] = {}
        elif m.group(2):
            tasks[task]["mean_accepted_tokens"] = float(m.group(2))
        else:
            tasks[task]["speedup"] = float(m.group(3))
    return {"tasks": tasks, "equal": "Result totally Equal!" in out, "stdout": out}


def spec_bench(
    base: Cell,
    folder: Path,
    questions: list[dict],
    out_dir: Path,
    answers_dir: Path,
    expert_file,
    machine: dict | None,
    tokenizer,
    caps: list[int | None],
    spec_bench_dir: Path | None = None,
    log=print,
) -> dict:
    """Every cap of `caps` (None: uncapped) through `cap_table`, each in its own folders; with
    `spec_bench_dir`, Spec-Bench's own scripts on each method's answers against AR's."""
    cells = []
    for cap in caps:
        tag = f"cap-{cap // 10**6}MBps" if cap else "uncapped"
        log(f"=== Spec-Bench, {base.model} {base.platform} {base.engine}, {tag}")
        cell = cap_table(
            base.with_(read_bw=cap),
            folder,
            questions,
            out_dir / tag,
            answers_dir / tag,
            expert_file,
            machine,
            tokenizer,
            log,
        )
        if spec_bench_dir is not None:
            cell["spec_bench_eval"] = {
                label: {
                    k: v
                    for k, v in run_spec_bench_eval(
                        spec_bench_dir, Path(f), Path(cell["answers"]["ar"]), folder
                    ).items()
                    if k != "stdout"
                }
                for label, f in cell["answers"].items()
                if label != "ar"
            }
        cells.append(cell)
    return {
        "model": base.model,
        "platform": base.platform,
        "engine": base.engine,
        "max_new_tokens": base.max_new_tokens,
        "spec": base.spec.as_dict(),
        "tasks": list(TASKS),
        "questions": {t: sum(q["category"] == t for q in questions) for t in TASKS[:-1]},
        "caps": cells,
    }


def usable_caps(caps: list[int | None], expert_file: Path, log=print) -> list[int | None]:
    """`caps` less the capped ones when the kernel's throttle cannot be applied here (with the reason)."""
    if not any(caps):
        return caps
    try:
        with ReadCap(10**9, expert_file):
            pass
    except ReadCapError as e:
        log(f"the capped Spec-Bench runs are skipped: {e}")
        return [c for c in caps if c is None]
    return caps


def run_and_write(
    base: Cell,
    folder: Path,
    limit: int | None,
    caps: list[int | None],
    out: Path,
    expert_file,
    machine: dict,
    command: str,
    spec_bench_dir: Path | None = None,
    log=print,
) -> tuple[dict, str, Path]:
    """The Spec-Bench table for `base`'s model, platform and engine, written to
    `out`/spec_bench_<model>_<platform>_<engine>.md / .json, its runs under `out`/runs and its
    answer files under `out`/spec_bench: (result, page, page path)."""
    stem = f"{base.model}_{base.platform}_{base.engine}"
    out = Path(out).resolve()
    tokenizer = load_tokenizer(folder)
    res = spec_bench(
        base,
        folder,
        prompts.load("spec_bench", limit),
        out / "runs" / f"spec_bench-{stem.replace('_', '-')}",
        out / "spec_bench" / stem,
        expert_file,
        machine,
        tokenizer,
        caps,
        spec_bench_dir,
        log,
    )
    for c in res["caps"]:  # paths as the results folder's parent sees them (results/…)
        c["answers"] = {k: str(Path(v).relative_to(out.parent)) for k, v in c["answers"].items()}
    days = sorted(
        {
            datetime.datetime.fromtimestamp(t, datetime.timezone.utc).date().isoformat()
            for c in res["caps"]
            for t in c["finished_at"]
        }
    )
    date = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]} (UTC)"  # when the cells ran
    text = page(res, command, machine.get("machine_id", "?"), date)
    write_json_atomic(out / f"spec_bench_{stem}.json", {**res, "command": command, "date": date})
    path = out / f"spec_bench_{stem}.md"
    path.write_text(text)
    return res, text, path
