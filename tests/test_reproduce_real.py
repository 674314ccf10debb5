"""`bench reproduce --model ds|ml` end to end on checkpoints shaped like the real models (3 layers, the
real routing, random weights: tests/shaped.py), `bench plan --reproduce`, the identity check's
override, and Moonlight's tiktoken tokenizer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import regex

from bench.cells import registry
from bench.steps.reproduce_model import RECIPE, reproduce_plan
from draftexpert.runtime.checkpoint import MOONSHOT_PATTERN, CheckpointError, load_tokenizer, read_tiktoken_ranks
from draftexpert.runtime.params import GIB
from tests.conftest import BENCH, REPO, bench_inproc, run_bench
from tests.shaped import texts, write_shaped

SMALL_RUN = ["--device", "cpu", "--per-suite", "1", "--max-new-tokens", "8", "--seq-len", "16", "--batch-size", "1",
             "--held-out", "2"]  # fmt: skip
# every page a reproduction writes for model M, and the columns its table must have
PAGES = {
    "spec_compare_{m}_mn.md": ["| method | TPS | ×AR |", "limit TPS", "paper α", "| ar-resident |", "| draftexpert |"],
    "spec_compare_{m}_mn_llama.cpp.md": ["| method | TPS | ×AR |", "| top-3 |"],
    "spec_compare_{m}_cg_cpu.md": ["| method | TPS | ×AR |", "| draftexpert |"],
    "table4_{m}_mn.md": ["conf-exp-prefetch"],
    "table4_{m}_mn_llama.cpp.md": ["conf-exp-prefetch"],
    "table5_{m}.md": ["| preset | KL(target‖draft)", "| full |", "| logit-token |", "| residual |", "| top1 |"],
    "fig2_tradeoff.md": ["|"],
    "fig3_{m}_mn.md": ["|"],
    "fig45_{m}_mn.md": ["|"],
    "fig1b_breakdown.md": ["|"],
    "table1_platforms.md": ["|"],
}
FIGURES = ["fig2_tradeoff.png", "fig45_verify_block.png", "fig1b_breakdown.png"]


def _corpus(work: Path) -> None:
    """The distillation's text (what `bench data corpus` builds) in a private work folder."""
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    t = texts(400)
    for split, rows in (("train", t[:360]), ("val", t[360:])):
        with open(work / "corpus" / f"{split}.jsonl", "w") as f:
            for i in range(0, len(rows), 8):
                f.write(json.dumps({"text": " ".join(rows[i : i + 8])}) + "\n")


@pytest.fixture
def shaped_env(tmp_path):
    work = tmp_path / "work"
    _corpus(work)
    env = {
        "DRAFTEXPERT_WORK": str(work),
        "DRAFTEXPERT_CACHE": str(tmp_path / "cache"),
        registry.SHAPED_ENV: "1",
    }
    return tmp_path, env


def _check_pages(results: Path, model: str) -> None:
    for page, columns in PAGES.items():
        text = (results / page.format(m=model)).read_text()
        for c in columns:
            assert c in text, (page, c)
    for fig in FIGURES:
        assert (results / "figures" / fig).stat().st_size > 0
    summary = json.loads((results / "REPRODUCE.json").read_text())
    assert summary["shaped"] is True
    eq = summary["tokens_equal_ar"]
    assert len(eq) >= 20 and all(eq.values()), eq  # every speculative row of every comparison
    steps = json.loads((results / "STEPS.json").read_text())
    for step in ["expert-files", "distill-residual", "distill-logit-token", "distill-full", "table2-mn",
                 "table2-mn-llama.cpp", "table2-cg", "fig2", "table4-mn", "table4-mn-llama.cpp", "fig3", "fig45",
                 "fig1b", "table5"]:  # fmt: skip
        assert steps[step]["seconds"] >= 0 and steps[step]["host_peak_bytes"] > 0, step
    t5 = json.loads((results / f"table5_{model}.json").read_text())
    assert t5["teacher"]["kind"] == "runtime" and set(t5["presets"]) == {"top1", "residual", "logit-token", "full"}


def test_reproduce_moonlight_shaped_end_to_end(shaped_env):
    """Moonlight's shape (sigmoid + bias routing, a tiktoken tokenizer and no tokenizer.json) through
    every step on both platforms: the GGUF head gets the tokenizer's merges, llama.cpp loads it."""
    tmp, env = shaped_env
    folder = write_shaped("ml", tmp / "ml")
    out = tmp / "results"
    r = run_bench("reproduce", "--model", "ml", "--model-path", str(folder), "--results", str(out),
                  "--distill-steps", "2", *SMALL_RUN, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens equal AR in every cell" in r.stdout
    _check_pages(out, "ml")


def _wait_for(proc, cond, what: str, timeout: float = 240) -> None:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def _records(folder: Path) -> dict[str, list[str]]:
    return {str(p.relative_to(folder)): p.read_text().splitlines() for p in sorted(folder.rglob("records.jsonl"))}


def test_reproduce_ds_shaped_resumes_after_sigkill(shaped_env):
    """SIGKILL during the distillation and during Table 2, then the same command: the distillation
    resumes from its checkpoint, Table 2 keeps the prompts it finished, finished steps are not redone,
    and the pages are those of an uninterrupted run."""
    tmp, env = shaped_env
    folder = write_shaped("ds", tmp / "ds")
    out = tmp / "results"
    cmd = [*BENCH, "reproduce", "--model", "ds", "--model-path", str(folder), "--results", str(out),
           "--distill-steps", "30", *SMALL_RUN]  # fmt: skip
    e = dict(os.environ, **env)
    state = lambda: list((tmp / "work" / "distill").glob("ds-residual-*/state.pt"))  # noqa: E731

    log1 = open(tmp / "run1.log", "w")
    p = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log1, stderr=subprocess.STDOUT)
    _wait_for(p, lambda: state(), "the first distillation checkpoint")  # checkpoint every 25 steps
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "STEPS.json").exists() or "distill-residual" not in json.loads((out / "STEPS.json").read_text())

    table2 = out / "runs" / "compare-ds-mn"
    log2 = open(tmp / "run2.log", "w")
    p = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log2, stderr=subprocess.STDOUT)
    _wait_for(p, lambda: sum(map(len, _records(table2).values())) >= 8, "Table 2's first records")
    p.send_signal(signal.SIGKILL)
    p.wait()
    run2 = (tmp / "run2.log").read_text()
    assert "resuming residual at step 25" in run2
    kept = _records(table2)
    steps = json.loads((out / "STEPS.json").read_text())
    assert "distill-full" in steps and "table2-mn" not in steps

    r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for step in ("expert-files", "distill-residual", "distill-logit-token", "distill-full"):
        assert f"[{step}] done already" in r.stderr
    after = _records(table2)
    for name, lines in kept.items():
        complete = [ln for ln in lines if ln.endswith("}")]
        assert after[name][: len(complete)] == complete, name  # finished prompts kept, not decoded again
    for name, lines in after.items():
        ids = [json.loads(ln)["prompt_id"] for ln in lines if ln.strip()]
        assert len(ids) == len(set(ids)) == 6, name  # one record per prompt (6 suites × 1)
    _check_pages(out, "ds")
    # the whole command again: every step kept
    r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "running" not in "".join(ln for ln in r.stderr.splitlines() if ln.startswith("["))


def test_a_shaped_checkpoint_is_refused_unless_told(tmp_path, monkeypatch):
    folder = tmp_path / "c"
    folder.mkdir()
    cfg = json.loads((registry.FACTS_DIR / "ds.json").read_text()) | {"num_hidden_layers": 3, "vocab_size": 400}
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.delenv(registry.SHAPED_ENV, raising=False)
    with pytest.raises(registry.ModelMismatch, match="num_hidden_layers 3"):
        registry.resolve("ds", folder)
    monkeypatch.setenv(registry.SHAPED_ENV, "1")
    assert registry.resolve("ds", folder) == folder and registry.is_shaped("ds", cfg)
    (folder / "config.json").write_text(json.dumps(cfg | {"n_routed_experts": 8}))  # another routing: still refused
    with pytest.raises(registry.ModelMismatch, match="n_routed_experts 8"):
        registry.resolve("ds", folder)
    r = bench_inproc("reproduce", "--model", "ds", "--model-path", folder, env={registry.SHAPED_ENV: ""})
    assert r.returncode != 0 and "is not 'ds'" in r.stderr


def test_reproduce_refuses_without_distillation_data(tmp_path):
    folder = write_shaped("ds", tmp_path / "ds")
    env = {"DRAFTEXPERT_WORK": str(tmp_path / "empty-work"), "DRAFTEXPERT_CACHE": str(tmp_path / "cache"),
           registry.SHAPED_ENV: "1"}  # fmt: skip
    r = run_bench("reproduce", "--model", "ds", "--model-path", str(folder), "--results", str(tmp_path / "r"),
                  *SMALL_RUN, env=env)  # fmt: skip
    assert r.returncode == 1 and "bench data corpus" in r.stderr and "distillation data" in r.stderr
    assert not (tmp_path / "r" / "STEPS.json").exists()  # nothing ran
    r = bench_inproc("reproduce", "--model", "ds", "--model", "ds-tiny")
    assert r.returncode == 2 and "alone" in r.stderr


def test_plan_reproduce_on_the_paper_machine():
    """The paper's CG machine fits every step; 16 GiB of host refuses naming the step."""
    r = bench_inproc("plan", "--model", "ds", "--reproduce", "--platform", "cg", "--gpu-mem", "24GiB",
                  "--host-mem", "64GiB", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    names = [s["step"] for s in p["steps"]]
    assert names[:4] == ["expert-files", "distill-residual", "distill-logit-token", "distill-full"]
    assert {"table2-cg", "fig1b", "table5"} <= set(names)
    for s in p["steps"][1:]:
        assert s["host"] > 0 and s["time_basis"], s
    assert all(s["seconds"] for s in p["steps"] if s["step"].startswith("distill"))  # PCIe-bound on cg
    r = bench_inproc("plan", "--model", "ds", "--reproduce", "--platform", "cg", "--gpu-mem", "24GiB",
                  "--host-mem", "16GiB")  # fmt: skip
    assert r.returncode == 1 and "does not fit: distill-residual needs" in r.stdout


def test_reproduce_plan_numbers():
    cfg = json.loads((registry.FACTS_DIR / "ds.json").read_text())
    p = reproduce_plan("ds", cfg, ("mn", "cg"), "cuda", 64 * GIB, 24 * GIB, 100 * GIB, 1e9)
    by = {s["step"]: s for s in p["steps"]}
    assert by["expert-files"]["disk"] == pytest.approx((7.54 + 26.8) * GIB, rel=0.02)  # Q4_0 + bf16 files
    assert by["distill-full"]["gpu"] < 0.9 * 24 * GIB < 24.4 * GIB  # batch 2 fits the card; 4 would not
    assert p["refused"] is None and p["recipe"]["steps"] == RECIPE.steps
    assert reproduce_plan("ds", cfg, ("mn",), "cpu", 64 * GIB, None, 20 * GIB, 1e9)["refused"]["step"] == "expert-files"


def _tiktoken_reference(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's algorithm, written out: split by the pattern, then per piece merge the adjacent
    pair whose concatenation has the lowest rank until none is left."""
    out = []
    for piece in regex.findall(MOONSHOT_PATTERN, text, flags=regex.V1):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 60))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        out += [ranks[p] for p in parts]
    return out


def test_tiktoken_tokenizer_encodes_as_tiktoken(tmp_path):
    folder = write_shaped("ml", tmp_path / "ml")
    assert not (folder / "tokenizer.json").exists()
    tok = load_tokenizer(folder)
    ranks = read_tiktoken_ranks(folder / "tiktoken.model")
    assert len(tok) == len(ranks) + 3 and tok.eos_token_id == len(ranks) + 1
    for text in [*texts(5), "Hello World's 12345 中文字 it's\n\n  ok", "x=3.14; y = 'done'\tTAB"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == _tiktoken_reference(ranks, text), text
        assert tok.decode(ids) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    (folder / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(CheckpointError, match="tiktoken.model:1"):
        load_tokenizer(folder)


def test_distill_eval_plans_before_loading(tmp_path):
    """Table 5 on DS-V2-Lite through the whole transformers model (fp32: ~63 GB) is refused before
    anything loads; a real model's default is the runtime teacher (`bench distill`'s)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "config.json").write_text((registry.FACTS_DIR / "ds.json").read_text())  # no weights needed
    r = bench_inproc("distill-eval", "--model", "ds", "--model-path", folder, "--teacher", "transformers")
    assert r.returncode == 1 and "transformers teacher needs" in r.stderr and "--teacher runtime" in r.stderr
