"""`bench run` end to end on a tiny random checkpoint: records, manifest, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import gguf
import torch

from bench.runs.results import read_records
from draftexpert.engines.reference import ReferenceDecoder
from draftexpert.runtime.checkpoint import load_target
from draftexpert.runtime.experts import STAGING
from draftexpert.runtime.gguf_experts import ExpertFile
from tests.conftest import BENCH, REPO, bench_inproc, run_bench


def _run_args(ckpt, out, limit=2, method="ar", tokens=4):
    return [
        "run",
        "--model",
        "ds-tiny",
        "--model-path",
        str(ckpt),
        "--suite",
        "gsm8k",
        "--suite",
        "chat",
        "--limit",
        str(limit),
        "--max-new-tokens",
        str(tokens),
        "--out",
        str(out),
        "--threads",
        "1",
        "--json",
        "--method",
        method,
        "--platform",
        "mn",
        "--expert-type",
        "f32",
    ]


def _env(tmp_path):
    return {"DRAFTEXPERT_CACHE": str(tmp_path / "cache")}  # the GGUF expert file goes here, not the user's cache


def test_run_writes_records_and_manifest_then_skips_done(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    p = run_bench(*_run_args(tiny_checkpoint, out), env=_env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["written"] == 4
    recs = read_records(out / "records.jsonl")
    assert [r["prompt_id"] for r in recs] == ["gsm8k-000", "gsm8k-001", "chat-000", "chat-001"]
    for r in recs:
        assert 1 <= r["new_tokens"] <= 4 and len(r["tokens"]) == r["new_tokens"]
        assert r["method"] == "ar" and r["platform"] == "mn" and r["model"] == "ds-tiny" and r["prompt_tokens"] > 5
        assert r["method_args"] == {
            "store": "flash",
            "device": "cpu",
            "cache_experts": 0,
            "expert_type": "f32",
            "staging_budget": 0,
            "staging": STAGING["demand"],
        }
        # cold flash: each decode step loads top-2 of 8 experts in the one MoE layer
        assert r["decode_loads"] == 2 * (r["new_tokens"] - 1) and r["decode_bytes"] > 0
        assert 0 < r["loading_share"] < 1 and r["ledger"]["by_phase"]["prefill"]["forwards"] == 1
    man = json.loads((out / "manifest.json").read_text())
    assert man["sessions"][-1]["status"] == "complete" and man["machine"]["cpu"]["logical_cores"] >= 1
    assert "commit" in man["git"]
    p = run_bench(*_run_args(tiny_checkpoint, out), env=_env(tmp_path))
    assert json.loads(p.stdout)["written"] == 0
    assert json.loads(p.stdout)["skipped"] == 4
    assert len(json.loads((out / "manifest.json").read_text())["sessions"]) == 2


def test_sweep_killed_mid_run_resumes_without_redoing_cells(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*BENCH, *_run_args(tiny_checkpoint, out, limit=30)],
        cwd=REPO,
        env=os.environ | _env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "records.jsonl").exists() and len(read_records(out / "records.jsonl")) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = read_records(out / "records.jsonl")
    assert 3 <= len(first) < 60
    p = run_bench(*_run_args(tiny_checkpoint, out, limit=30), env=_env(tmp_path))
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["skipped"] == len(first) and summary["written"] == 60 - len(first)
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 60 and len({r["key"] for r in recs}) == 60
    assert recs[: len(first)] == first  # finished cells untouched
    man = json.loads((out / "manifest.json").read_text())
    assert [s["status"] for s in man["sessions"]] == ["running", "complete"]  # the killed session says so


def test_ar_offload_records_equal_reference_records_token_for_token(tiny_checkpoint, tmp_path):
    for method in ("ar", "reference"):
        p = run_bench(
            *_run_args(tiny_checkpoint, tmp_path / method, limit=3, method=method, tokens=24), env=_env(tmp_path)
        )
        assert p.returncode == 0, p.stderr
    ar, ref = (read_records(tmp_path / m / "records.jsonl") for m in ("ar", "reference"))
    assert [r["prompt_id"] for r in ar] == [r["prompt_id"] for r in ref]
    assert [r["tokens"] for r in ar] == [r["tokens"] for r in ref]


def test_speculative_runs_emit_ar_tokens_and_ledger_per_prompt(tiny_checkpoint, tmp_path):
    """`bench run --json` of top-r and draftexpert: per prompt the tokens (equal to AR's, fp32 here —
    the float64 property tests are in test_speculative) and the speculation + prefetch counters."""
    p = run_bench(*_run_args(tiny_checkpoint, tmp_path / "ar", limit=2, tokens=16), env=_env(tmp_path))
    ar = {r["prompt_id"]: r["tokens"] for r in json.loads(p.stdout)["records"]}
    for method, extra in (("top-r", ["--r", "1", "--no-truncate"]), ("draftexpert", ["--k-max", "3", "--tau", "0.9"])):
        p = run_bench(
            *_run_args(tiny_checkpoint, tmp_path / method, limit=2, method=method, tokens=16),
            *extra,
            env=_env(tmp_path),
        )
        assert p.returncode == 0, p.stderr
        recs = json.loads(p.stdout)["records"]
        assert {r["prompt_id"]: r["tokens"] for r in recs} == ar
        for r in recs:
            assert r["method"] == method and r["rounds"] >= 1 and 0 <= r["acceptance"] <= 1
            assert r["prefetch_hits"] + r["prefetch_waste"] == r["prefetch_issued"]
            assert r["ledger"]["by_phase"]["verify"]["forwards"] == r["rounds"]
    assert recs[0]["method_args"]["draft_experts"]["preset"] == "zero" and recs[0]["method_args"]["k_max"] == 3


def test_reference_decoder_equals_transformers_generate(tiny_checkpoint):
    model, tok = load_target(tiny_checkpoint)
    ids = tok("the model routes each token")["input_ids"]
    out = ReferenceDecoder(model).generate(ids, 12)
    gen = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.tokens == gen[0, len(ids) :].tolist()


def test_bad_method_and_suite_name_the_flag(tiny_checkpoint):
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--method", "medusa")
    assert p.returncode == 2 and "--method" in p.stderr
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--platform", "gpu")
    assert p.returncode == 2 and "--platform" in p.stderr
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--expert-type", "q8_0")
    assert p.returncode == 2 and "--expert-type" in p.stderr
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--suite", "trivia")
    assert p.returncode == 2 and "--suite" in p.stderr
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--method", "top-r", "--r", "2")  # target is top-2
    assert p.returncode == 2 and "--r" in p.stderr and "top-k (2)" in p.stderr
    p = bench_inproc("run", "--model-path", str(tiny_checkpoint), "--method", "draftexpert", "--draft-cache", "both")
    assert p.returncode == 2 and "--draft-cache" in p.stderr
    p = bench_inproc("compare", "--model-path", str(tiny_checkpoint), "--method", "top-9")
    assert p.returncode == 2 and "--method" in p.stderr


def test_convert_writes_a_readable_expert_file_once(tiny_checkpoint, tmp_path):
    """The expert file (flash store) and the llama.cpp head over it (split 1; split 2 links the
    expert file), written once and reused."""
    p = run_bench(
        "convert",
        "--model",
        "ds-tiny",
        "--model-path",
        str(tiny_checkpoint),
        "--type",
        "bf16",
        "--json",
        env=_env(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    path = out["experts"]
    f = ExpertFile(path)
    assert f.layers == [1] and f.qtype == "bf16"
    f.close()
    head = Path(out["target"])
    assert head.name.endswith("-00001-of-00002.gguf")
    assert Path(str(head).replace("-00001-of-", "-00002-of-")).resolve() == Path(path).resolve()
    names = {t.name for t in gguf.GGUFReader(str(head)).tensors}
    assert "blk.1.attn_k_b.weight" in names and "blk.1.ffn_gate_shexp.weight" in names
    assert not any("_exps" in n for n in names)  # the routed experts live in split 2 only
    again = run_bench(
        "convert",
        "--model",
        "ds-tiny",
        "--model-path",
        str(tiny_checkpoint),
        "--type",
        "bf16",
        "--json",
        env=_env(tmp_path),
    )
    assert json.loads(again.stdout)["experts"] == path and "writing" not in again.stderr  # reused
    bad = run_bench("convert", "--model-path", str(tiny_checkpoint), "--type", "q8_0")
    assert bad.returncode == 2 and "--type" in bad.stderr
    # this checkpoint's moe_intermediate (16) cannot be Q4_0: said plainly, no traceback
    q4 = run_bench("convert", "--model-path", str(tiny_checkpoint), "--type", "q4_0", env=_env(tmp_path))
    assert q4.returncode == 2 and "multiples of 32" in q4.stderr and "Traceback" not in q4.stderr


def test_compare_on_cg_measures_the_resident_bound_on_the_same_accelerator(tiny_checkpoint, tmp_path):
    """cg's table has its upper bound beside AR: every expert resident on cg's accelerator (here the
    CPU, as `--device cpu` asks), the checkpoint's experts (not an expert file), the same tokens."""
    p = run_bench(
        "compare",
        "--model-path",
        str(tiny_checkpoint),
        "--platform",
        "cg",
        "--device",
        "cpu",
        "--method",
        "ar",
        "--method",
        "ar-resident",
        "--suite",
        "gsm8k",
        "--limit",
        "1",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "cmp"),
        "--json",
        env=_env(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    recs = {label: read_records(tmp_path / "cmp" / label / "records.jsonl") for label in ("ar", "ar-resident")}
    resident = recs["ar-resident"][0]
    assert resident["platform"] == "resident" and resident["method_args"]["device"] == "cpu"
    assert "expert_type" not in resident["method_args"]  # the checkpoint's experts, as cg moves them
    assert resident["tokens"] == recs["ar"][0]["tokens"]
    # cg's physical limit is the copy into its accelerator (here a memcpy), not the disk's read rate
    res = json.loads(p.stdout)
    machine = json.loads((tmp_path / "cmp" / "ar" / "manifest.json").read_text())["machine"]
    assert res["limit_read_bw"] == machine["copy_in"]["cpu_gb_per_s"] * 1e9
    assert res["methods"]["ar"]["physical_limit_tps"] > 0
    assert res["methods"]["ar-resident"]["physical_limit_tps"] is None
