"""Nothing silently wrong: every fault a user can walk into exits with one line naming the problem
and the fix (or skips with a recorded reason), and leaves no half-written file."""

import errno
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from bench.cells import artifacts
from bench.cells.cell import Cell, SpecOptions
from bench.cells.decoders import make_decoder
from bench.cli import app
from bench.runs.results import RecordWriter, RunFolderError, RunManifest, check_run_dir, load_results, read_records
from bench.runs.runner import context_overflows, run_cells
from bench.suites import prompts
from bench.suites.prompts import render_prompt
from draftexpert.decoding import ContextOverflow, NonFiniteLogits, sample
from draftexpert.runtime.gguf_checksums import checksum_path, verify_checksums
from tests.conftest import BENCH, REPO, run_bench


def _env(tmp_path):
    return {"DRAFTEXPERT_CACHE": str(tmp_path / "cache")}


def _run(ckpt, out, *extra, limit=1, tokens=4):
    return [
        "run",
        "--model",
        "ds-tiny",
        "--model-path",
        str(ckpt),
        "--suite",
        "gsm8k",
        "--limit",
        str(limit),
        "--max-new-tokens",
        str(tokens),
        "--out",
        str(out),
        "--threads",
        "1",
        *extra,
    ]


def _one_line_error(p, *words):
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    for w in words:
        assert w in errors[0], errors[0]


def _copy_with(ckpt, dest, edit):
    """A copy of the checkpoint whose weights `edit(tensors)` changed in place."""
    shutil.copytree(ckpt, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


# ---------------------------------------------------------------- identity


def test_other_weights_are_other_cells(tiny_checkpoint, tmp_path, monkeypatch):
    """Records carry the weights' fingerprint in their key: a run over other weights of the same
    architecture into the same folder is decoded anew, never taken as done."""
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    other = _copy_with(tiny_checkpoint, tmp_path / "other", lambda t: t["lm_head.weight"].mul_(1.5))
    out = tmp_path / "run"
    for ckpt, written in [(tiny_checkpoint, 1), (tiny_checkpoint, 0), (other, 1)]:
        dec, tok, cfg = make_decoder(Cell(method="ar", platform="resident", max_new_tokens=4), ckpt)
        assert run_cells(cfg, prompts.load("gsm8k", 1), dec, tok, out, log=lambda m: None)["written"] == written
    recs = read_records(out / "records.jsonl")
    assert len({r["weights"] for r in recs}) == 2 and all(len(r["weights"]) == 64 for r in recs)


# ---------------------------------------------------------------- integrity


def _damage(path, offset, n):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(n))


def test_damaged_cached_expert_file_is_rebuilt_never_used(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    msgs = []
    path = artifacts.expert_file_for("ds-tiny", tiny_checkpoint, "f32", log=msgs.append)
    good = path.read_bytes()
    assert verify_checksums(path, full=True) is None  # control: an intact file passes
    size = path.stat().st_size
    for where in (size // 2, 0):  # tensor bytes, then the header
        _damage(path, where, 64)
        assert verify_checksums(path) is not None  # changed since its last check: read again
        msgs.clear()
        assert artifacts.expert_file_for("ds-tiny", tiny_checkpoint, "f32", log=msgs.append) == path
        assert any("damaged" in m for m in msgs) and path.read_bytes() == good
    # damage that keeps size and mtime passes the cheap check; --verify (full) still finds it
    st = path.stat()
    _damage(path, size // 2, 64)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_checksums(path) is None and "checksum" in verify_checksums(path, full=True)
    artifacts.expert_file_for("ds-tiny", tiny_checkpoint, "f32", log=msgs.append, verify=True)
    assert path.read_bytes() == good
    # a file without its checksums (unfinished, or older) is not trusted either
    checksum_path(path).unlink()
    msgs.clear()
    artifacts.expert_file_for("ds-tiny", tiny_checkpoint, "f32", log=msgs.append)
    assert any("no readable checksum" in m for m in msgs) and checksum_path(path).exists()
    assert not list(path.parent.glob("*.part"))


def test_non_finite_logits_stop_the_run_without_a_record(tiny_checkpoint, tmp_path):
    with pytest.raises(NonFiniteLogits):
        sample(torch.tensor([0.0, float("nan"), 1.0]), 0.0, None)
    broken = _copy_with(tiny_checkpoint, tmp_path / "nan", lambda t: t["lm_head.weight"].fill_(float("nan")))
    out = tmp_path / "run"
    p = run_bench(*_run(broken, out, "--platform", "resident"), env=_env(tmp_path))
    _one_line_error(p, "non-finite logits", "bench convert --verify")
    assert read_records(out / "records.jsonl") == []
    assert json.loads((out / "manifest.json").read_text())["sessions"][-1]["status"] == "failed"


# ---------------------------------------------------------------- context


def test_prompts_past_the_context_are_skipped_with_their_reason_or_refused(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    p = run_bench(
        *_run(tiny_checkpoint, out, "--platform", "resident", "--json", limit=2, tokens=2040), env=_env(tmp_path)
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["written"] == 0 and len(s["skipped_context"]) == 2
    assert "exceed the model's context of 2048" in s["skipped_context"][0]["reason"]
    man = json.loads((out / "manifest.json").read_text())["sessions"][-1]
    assert man["status"] == "complete" and len(man["skipped_context"]) == 2
    # speculation reserves K_max + 1: a prompt that fits AR can overflow a speculative decoder
    n = s["skipped_context"][0]["prompt_tokens"]
    fits_ar = 2048 - n
    for method, refused in (("ar", False), ("top-r", True)):
        dec, tok, cfg = make_decoder(Cell(method=method, platform="resident", max_new_tokens=fits_ar), tiny_checkpoint)
        recs = prompts.load("gsm8k", 1)
        found = context_overflows(recs, {r["id"]: render_prompt(tok, r["prompt"]) for r in recs}, dec, fits_ar)
        assert bool(found) == refused
        if refused:
            with pytest.raises(ContextOverflow, match=r"K_max \+ 1.*--context-overflow skip"):
                run_cells(cfg, prompts.load("gsm8k", 1), dec, tok, tmp_path / "spec", on_overflow="refuse")
    assert not (tmp_path / "spec").exists()


def test_every_decoder_refuses_a_sequence_past_its_context(tiny_checkpoint):
    for method in ("ar", "top-r", "draftexpert", "reference"):
        dec, tok, _ = make_decoder(Cell(method=method, platform="resident"), tiny_checkpoint)
        assert dec.context_length == 2048
        with pytest.raises(ContextOverflow):
            dec.generate([1] * 2000, 49, None)


# ---------------------------------------------------------------- results store


def test_a_damaged_line_is_reported_with_file_and_line_and_skipped(tmp_path):
    run = tmp_path / "run"
    with RecordWriter(run) as w:
        for k in "abc":
            w.write({"key": k, "decode_tps": 1.0})
    lines = (run / "records.jsonl").read_bytes().split(b"\n")
    lines[1] = b'{"key": "b", "decode_tps": 1.0, garbage'
    (run / "records.jsonl").write_bytes(b"\n".join(lines))
    warned = []
    assert [r["key"] for r in read_records(run / "records.jsonl", warn=warned.append)] == ["a", "c"]
    assert warned and warned[0].startswith(f"{run / 'records.jsonl'}:2:")
    assert list(load_results(run)["key"]) == ["a", "c"]
    with RecordWriter(run) as w:
        assert w.done == {"a", "c"}  # the damaged cell is redone


def test_out_that_is_a_file_or_unwritable_is_one_line_error(tiny_checkpoint, tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    p = run_bench(*_run(tiny_checkpoint, f), env=_env(tmp_path))
    _one_line_error(p, str(f), "not a folder")
    assert f.read_text() == "x"
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # what a read-only file system answers
    with pytest.raises(RunFolderError, match="not writable"):
        check_run_dir(tmp_path / "ro")


def test_a_full_disk_fails_the_session_and_leaves_no_partial_file(tmp_path, monkeypatch):
    run = tmp_path / "run"
    man = RunManifest(run, {"model": "x"})
    with RecordWriter(run) as w:
        w.write({"key": "a"})
        real = os.write

        calls = []

        def full(fd, data):
            calls.append(len(data))
            if len(calls) == 1:
                return real(fd, bytes(data[:10]))  # a part lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
        with pytest.raises(RunFolderError, match="No space left.*rerun the same command"):
            w.write({"key": "b", "pad": "x" * 100})
        monkeypatch.setattr(os, "write", real)
    assert (run / "records.jsonl").read_bytes().endswith(b"\n")
    assert [r["key"] for r in read_records(run / "records.jsonl")] == ["a"]

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(RunFolderError, match="manifest.json"):
        man.finish("complete")
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "records.jsonl"]  # no temporary file


def test_a_run_writes_nothing_but_its_records_and_manifest(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    p = run_bench(*_run(tiny_checkpoint, out, "--platform", "resident"), env=_env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["manifest.json", "records.jsonl"]  # no storage probe here
    man = json.loads((out / "manifest.json").read_text())
    assert man["machine"]["storage"]["odirect_read"]["path"].startswith(str(tmp_path / "cache"))


def test_ctrl_c_says_how_to_resume(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *BENCH,
            *_run(tiny_checkpoint, out, "--platform", "resident", "--suite", "chat", limit=30, tokens=256),
        ],  # 60 prompts: seconds of work after the first
        cwd=REPO,
        env=os.environ | _env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,  # a background job inherits SIGINT ignored: give the child the default back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(read_records(out / "records.jsonl")) < 1:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted — rerun the same command to resume" in err
    assert "Traceback" not in err
    assert json.loads((out / "manifest.json").read_text())["sessions"][-1]["status"] == "interrupted"


# ---------------------------------------------------------------- inputs


def test_bad_draft_experts_and_checkpoints_name_the_file(tiny_checkpoint, tmp_path, monkeypatch):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(4096))
    p = run_bench(
        *_run(
            tiny_checkpoint,
            tmp_path / "a",
            "--method",
            "draftexpert",
            "--draft-experts",
            str(garbage),
            "--platform",
            "resident",
        ),
        env=_env(tmp_path),
    )
    _one_line_error(p, str(garbage), "not a readable safetensors file")

    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    weights = tiny_checkpoint / "model.safetensors"
    with pytest.raises(ValueError, match="not a draft-expert checkpoint.*model weights"):
        make_decoder(
            Cell(method="draftexpert", platform="resident", spec=SpecOptions(draft_experts=weights)), tiny_checkpoint
        )
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", only_config)
    with pytest.raises(RuntimeError, match=f"{only_config}.*tokenizer"):
        make_decoder(Cell(method="reference", platform="resident"), only_config)
    truncated = tmp_path / "trunc"
    shutil.copytree(tiny_checkpoint, truncated)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    for method in ("reference", "ar"):
        with pytest.raises((ValueError, RuntimeError), match=str(truncated)):
            make_decoder(Cell(method=method, platform="cg", device="cpu"), truncated)
    assert not list((tmp_path / "cache").rglob("*.part"))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--method", "ar", "--r", "2"], "--r does not apply to --method ar"),
        (["--method", "ar", "--draft-experts", "x.safetensors"], "--draft-experts does not apply"),
        (["--method", "top-r", "--draft-experts", "x.safetensors"], "--method top-r"),
        (["--method", "draftexpert", "--r", "2"], "--r does not apply to --method draftexpert"),
        (["--method", "reference", "--temperature", "0.7"], "--temperature does not apply to --method reference"),
        (["--engine", "llama.cpp", "--head-type", "q4_0"], "--head-type does not apply to --engine llama.cpp"),
        (["--method", "reference", "--head-type", "q4_0"], "--head-type does not apply to --method reference"),
        (["--head-type", "q8_0"], "--head-type: 'q8_0' is not one of checkpoint, q4_0"),
    ],
)
def test_flags_that_do_not_apply_are_refused(tiny_checkpoint, tmp_path, args, words):
    res = CliRunner().invoke(app, _run(tiny_checkpoint, tmp_path / "x", *args))  # refused before any model loads
    assert res.exit_code == 2 and words in res.output, res.output
    assert not (tmp_path / "x").exists()


def test_llama_cpp_refuses_a_sequence_past_its_context(tiny_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    for method in ("ar", "top-r"):
        dec, _, _ = make_decoder(
            Cell(method=method, platform="mn", expert_type="f32", engine="llama.cpp"),
            tiny_checkpoint,
            lambda qt: artifacts.expert_file_for("ds-tiny", tiny_checkpoint, qt),
        )
        try:
            assert dec.context_length == 2048
            with pytest.raises(ContextOverflow):
                dec.generate([1] * 2000, 49, None)
        finally:
            dec.close()


def test_gpu_placements_without_a_gpu_are_refused_unless_the_cpu_is_asked_for(tiny_checkpoint, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cg runs on it")
    res = CliRunner().invoke(app, _run(tiny_checkpoint, tmp_path / "x", "--platform", "cg"))
    assert res.exit_code == 2 and "`--device cpu` runs cg with the CPU as the accelerator" in res.output
    res = CliRunner().invoke(
        app, _run(tiny_checkpoint, tmp_path / "y", "--platform", "cg", "--device", "cpu", "--json")
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{") :])["records"][0]["method_args"]["device"] == "cpu"
    res = CliRunner().invoke(app, _run(tiny_checkpoint, tmp_path / "z", "--platform", "mn", "--device", "cuda"))
    assert res.exit_code == 2 and "--device does not apply to --platform mn" in res.output
    # resident: the CPU by default; --device cuda (cg's upper bound on the GPU) is refused here by what it needs
    res = CliRunner().invoke(app, _run(tiny_checkpoint, tmp_path / "r", "--platform", "resident", "--device", "cuda"))
    assert res.exit_code == 2 and "--platform resident --device cuda needs a CUDA GPU" in res.output
    res = CliRunner().invoke(
        app, _run(tiny_checkpoint, tmp_path / "s", "--platform", "resident", "--device", "cpu", "--json")
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{") :])["records"][0]["method_args"]["device"] == "cpu"


def test_distill_eval_refuses_a_missing_ablation_checkpoint_and_a_card_for_one(tiny_checkpoint, tmp_path):
    base = ["distill-eval", "--model", "ds-tiny", "--model-path", str(tiny_checkpoint)]
    res = CliRunner().invoke(app, [*base, "--draft-experts", str(tmp_path / "nope.safetensors")])
    assert res.exit_code == 2 and "nope.safetensors" in res.output and "bench distill --out" in res.output, res.output
    real = tmp_path / "ablation.safetensors"
    real.write_bytes(b"")
    res = CliRunner().invoke(app, [*base, "--draft-experts", str(real), "--card"])
    assert res.exit_code == 2 and "--card" in res.output, res.output
