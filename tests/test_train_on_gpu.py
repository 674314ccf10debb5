"""scripts/train_on_gpu.py at a few steps on the CPU: the corpus pack in, both training runs (probe
and schedule), the install with its card, the draft experts, α at K = 4 per drafter, and what a
device returns (the report and the models in parts of ≤ 15 MiB that rebuild the folders)."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from bench.tiny.pack import pack

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_training_command_runs_end_to_end_on_the_cpu(tmp_path):
    data, corpus_dir = tmp_path / "data", tmp_path / "corpus"
    (data / "tokenizer").mkdir(parents=True)
    corpus_dir.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 40_000), ("val", 600 * 8)):
        rng.integers(3, 4096, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (data / "tokenizer" / f).write_bytes((REPO / "models" / "ds-tiny" / f).read_bytes())
    (corpus_dir / "manifest.json").write_bytes((REPO / "models" / "ds-tiny" / "corpus_manifest.json").read_bytes())
    pack(data, corpus_dir, tmp_path / "pack", log=lambda m: None)
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_on_gpu.py"), "--out", str(out), "--pack", str(tmp_path / "pack"),
         "--dir", str(tmp_path / "dir"), "--device", "cpu", "--models", "ds-tiny", "--tokens", "1280",
         "--probe-steps", "2", "--batch-size", "2", "--seq-len", "64", "--distill-steps", "2", "--threads", "1",
         "--max-new-tokens", "8", "--eval-limit", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "train_on_gpu.json").read_text())
    m = report["models"]["ds-tiny"]
    assert m["steps"] == 10 and m["tokens"] == 1280 and m["probe_tokens_per_s"] > 0
    assert set(m["alpha_k4"]) == {"top-1", "top-2", "top-3", "draftexpert"}
    assert all(0 <= a <= 1 for a in m["alpha_k4"].values())
    assert all(c["rc"] == 0 for c in report["commands"]) and "error" not in report
    parts = sorted(out.glob("models.tar.*"))
    assert [p.name for p in parts] == report["parts"] and all(p.stat().st_size <= 15 << 20 for p in parts)
    whole = tmp_path / "models.tar"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as tar:
        names = set(tar.getnames())
    kept = ("config.json", "model.safetensors.index.json", "eval.json", "README.md", "draft_experts/full.safetensors")
    assert all(f"models/ds-tiny/{f}" in names for f in kept), names
