"""`bench reproduce --model ds --platform cg` on the paper's CG machine, emulated on a larger GPU: the
full-size DS-V2-Lite-shaped random checkpoint (scripts/full_scale.py's writer: the real config, bf16,
31.4 GB, drawn on the GPU) through every cg step with a short distillation, the GPU capped at
`--gpu-mem` (torch's per-process fraction) and the process in a `--mem-cap` memory cgroup (root).
A benchmark script, not a test; one command for a device session:

    python3 scripts/gpu_reproduce.py --dir /dev/shm/gr --out $OUT [--gpu-mem 24GiB] [--mem-cap 64GiB]
                                     [--distill-steps 3] [--tokens 16] [--device cuda]

The distillation text is placeholder text (the decontaminated corpus needs archives the device cannot
fetch): on random weights it changes what is learned, not the time a step takes. Writes into `--out`:
`gpu_reproduce.json` (each step's wall time, host and GPU peaks, the group's peak, s per distillation
step, whether every cell's tokens equal AR) and `results_ds.tar.gz` (the pages and records). With
`--device cpu` and `--model-path` a small shaped checkpoint, it smoke-tests the same path here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from full_scale import MemoryCap, parse_size, run_child, write_checkpoint  # noqa: E402

from tests.shaped import texts  # noqa: E402


def write_corpus(work: Path) -> None:
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    t = texts(4000)
    for split, rows in (("train", t[:3600]), ("val", t[3600:])):
        with open(work / "corpus" / f"{split}.jsonl", "w") as f:
            for i in range(0, len(rows), 40):
                f.write(json.dumps({"text": " ".join(rows[i : i + 40])}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="scratch: the checkpoint (31.4 GB), cache, work")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu-mem", default="24GiB")
    ap.add_argument("--mem-cap", default="64GiB", help="the host's memory cgroup; 'none' to run without")
    ap.add_argument("--distill-steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-path", type=Path, help="an existing checkpoint instead of writing the full-size one")
    ap.add_argument("--shaped", action="store_true", help="the checkpoint is shaped, not full-size (smoke runs)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    ckpt = a.model_path or a.dir / "ds"
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not a.model_path and not (ckpt / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        report["checkpoint_bytes"] = write_checkpoint(ckpt, REPO / "bench" / "model_facts" / "ds.json", log)
        report["checkpoint_write_s"] = time.perf_counter() - t0
    write_corpus(a.dir / "work")
    env = dict(os.environ, DRAFTEXPERT_WORK=str(a.dir / "work"), DRAFTEXPERT_CACHE=str(a.dir / "cache"))
    if a.shaped:
        env["DRAFTEXPERT_ALLOW_SHAPED"] = "1"
    results = a.dir / "results_ds"
    cmd = [sys.executable, "-m", "bench.cli", "reproduce", "--model", "ds", "--model-path", str(ckpt),
           "--platform", "cg", "--device", a.device, "--per-suite", "1", "--max-new-tokens", str(a.tokens),
           "--distill-steps", str(a.distill_steps), "--results", str(results), "--json"]  # fmt: skip
    if a.device == "cuda":
        cmd += ["--gpu-mem", a.gpu_mem]
    cap = None if a.mem_cap == "none" else MemoryCap(parse_size(a.mem_cap))
    try:
        r = run_child(cmd, cap, env, a.dir / "scratch")
    finally:
        if cap:
            cap.close()
    report.update(command=" ".join(cmd), rc=r["rc"], wall_s=r["seconds"], peak_rss=r["peak_rss"],
                  group_peak=r["group_peak"], stderr_tail=r["stderr"][-4000:])  # fmt: skip
    if r["rc"] == 0:
        summary = json.loads(r["stdout"])
        report.update(steps=summary["steps"], tokens_equal_ar=summary["tokens_equal_ar"],
                      all_tokens_equal_ar=all(summary["tokens_equal_ar"].values()))  # fmt: skip
        per_step = {}
        for hist in sorted((a.dir / "work" / "draft_experts").rglob("*.history.jsonl")):
            secs = [json.loads(ln)["seconds"] for ln in hist.read_text().splitlines() if '"loss"' in ln]
            per_step[hist.name.removesuffix(".history.jsonl")] = secs
        report["distill_step_seconds"] = per_step
    (a.out / "gpu_reproduce.json").write_text(json.dumps(report, indent=1) + "\n")
    if results.exists():
        with tarfile.open(a.out / "results_ds.tar.gz", "w:gz") as tar:
            for p in sorted(results.rglob("*")):
                if p.is_file() and p.stat().st_size < (4 << 20):
                    tar.add(p, arcname=str(p.relative_to(results.parent)))
    subprocess.run(["nvidia-smi"], check=False) if a.device == "cuda" else None
    print(json.dumps({k: v for k, v in report.items() if k != "stderr_tail"}, indent=1))
    return r["rc"]


if __name__ == "__main__":
    raise SystemExit(main())
