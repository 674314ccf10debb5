"""Train the embedded targets on an accelerator, then distil and evaluate them: one command for a
device session, from the tokenized corpus pack (`bench data pack`; no package index, no network).

    python3 scripts/train_on_gpu.py --out $OUT [--pack work/pack] [--dir /dev/shm/tg] [--device cuda]
        [--models ds-tiny ml-tiny] [--tokens 100000000] [--budget-s 150] [--batch-size 64] [--lr 3e-3]
        [--distill-steps 300] [--threads 16]

Per model: a probe of `--probe-steps` measures training tokens/s here, and the run's length is
min(--tokens, rate × --budget-s) (a cosine schedule needs its length up front); then
`bench model train --device D` (installed into DIR/models/<name>: ml-tiny's bias rebalance, the
evaluation and card), `bench distill --preset full` (the CPU's threads), and α at K = 4 (gsm8k +
chat, 2 prompts each, `--no-truncate --no-prefetch`) of shared+top-1/2/3 and DraftExpert, decoded
on cg with D (precise experts; the tables' mn rows verify with Q4_0 ones).
Writes into --out: `train_on_gpu.json` (every command with its wall seconds and rc, the rates, the
steps chosen, the α's) and `models.tar.00`, `.01`, … (parts of ≤ 15 MiB: `cat models.tar.* | tar x`
rebuilds `models/<name>/` for each model). `--device cpu --tokens 20000` smoke-tests the path here.
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

from bench.tiny.pack import unpack  # noqa: E402
from draftexpert import metrics  # noqa: E402

PART = 15 << 20  # the device returns files of at most 16 MiB
DRAFTERS = [("top-1", ["--method", "top-r", "--r", "1"]), ("top-2", ["--method", "top-r", "--r", "2"]),
            ("top-3", ["--method", "top-r", "--r", "3"]), ("draftexpert", ["--method", "draftexpert"])]  # fmt: skip


def bench(args: list[str], env: dict, report: list, log) -> dict:
    """One `bench` command: its wall seconds and rc into `report`; its --json output back."""
    cmd = [sys.executable, "-m", "bench.cli", *args]
    log("$ bench " + " ".join(args))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    row = {"command": "bench " + " ".join(args), "rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 2)}
    report.append(row)
    if r.returncode:
        row["stderr_tail"] = r.stderr[-3000:]
        raise RuntimeError(f"bench {' '.join(args)} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    try:
        return json.loads(r.stdout) if "--json" in args else {}
    except ValueError:
        return {}


def rate(train_log: Path) -> float:
    """Training tokens/s of a run, over the second half of its steps (the first carry the start-up)."""
    recs = [json.loads(line) for line in train_log.read_text().splitlines()]
    a, b = recs[len(recs) // 2 - 1] if len(recs) > 1 else {"tokens_seen": 0, "elapsed_s": 0.0}, recs[-1]
    return (b["tokens_seen"] - a["tokens_seen"]) / max(1e-9, b["elapsed_s"] - a["elapsed_s"])


def split(path: Path, out: Path, part: int = PART) -> list[str]:
    names = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part), b"")):
            (out / f"{path.name}.{i:02d}").write_bytes(block)
            names.append(f"{path.name}.{i:02d}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pack", type=Path, default=REPO / "work" / "pack")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/train_on_gpu"), help="scratch: data, runs, models")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", default=["ds-tiny", "ml-tiny"])
    ap.add_argument("--tokens", type=int, default=100_000_000, help="training tokens per model, at most")
    ap.add_argument("--budget-s", type=float, default=150.0, help="training seconds per model, at most")
    ap.add_argument("--probe-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--distill-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-limit", type=int, help="validation sequences the cards are evaluated on (default all)")
    a = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    a.out.mkdir(parents=True, exist_ok=True)
    work, models = a.dir / "work", a.dir / "models"
    env = dict(os.environ, DRAFTEXPERT_WORK=str(work), DRAFTEXPERT_CACHE=str(a.dir / "cache"))
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": a.device,
                    "args": {k: str(v) for k, v in vars(a).items()}, "commands": [], "models": {}}  # fmt: skip
    t_start = time.perf_counter()
    rc = 0
    try:
        report["pack"] = unpack(a.pack, work / "data", work / "corpus", log=log)
        tokens_per_step = a.batch_size * a.seq_len
        common = ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
                  "--threads", str(a.threads), "--device", a.device]  # fmt: skip
        for name in a.models:
            m: dict = {}
            report["models"][name] = m
            probe = a.dir / "probe" / name
            bench(["model", "train", "--model", name, "--steps", str(a.probe_steps), "--out", str(probe),
                   "--no-install", *common], env, report["commands"], log)  # fmt: skip
            m["probe_tokens_per_s"] = rate(probe / "log.jsonl")
            want = min(a.tokens, m["probe_tokens_per_s"] * a.budget_s)
            m["steps"] = max(a.probe_steps, int(want // tokens_per_step))
            m["tokens"] = m["steps"] * tokens_per_step
            log(f"{name}: {m['probe_tokens_per_s']:,.0f} tokens/s → {m['steps']} steps, {m['tokens']:,} tokens")
            folder = models / name
            limit = ["--eval-limit", str(a.eval_limit)] if a.eval_limit else []
            bench(["model", "train", "--model", name, "--steps", str(m["steps"]), "--out", str(a.dir / "train" / name),
                   "--install-to", str(folder), *common, *limit], env, report["commands"], log)  # fmt: skip
            m["train_tokens_per_s"] = rate(a.dir / "train" / name / "log.jsonl")
            ev = json.loads((folder / "eval.json").read_text())
            m["eval"] = {k: v for k, v in ev.items() if k not in ("usage_share", "continuations", "repetition")}
            m["eval"]["repetition"] = {k: v for k, v in ev.get("repetition", {}).items() if k != "rows"}
            de = folder / "draft_experts" / "full.safetensors"
            bench(["distill", "--model", name, "--model-path", str(folder), "--preset", "full", "--steps",
                   str(a.distill_steps), "--threads", str(a.threads), "--out", str(de)],
                  env, report["commands"], log)  # fmt: skip
            m["alpha_k4"] = {}
            for label, flags in DRAFTERS:
                out = bench(["run", "--model", name, "--model-path", str(folder), *flags, "--platform", "cg",
                             "--device", a.device, "--k-max", "4", "--no-truncate", "--no-prefetch", "--suite",
                             "gsm8k", "--suite", "chat", "--limit", "2", "--max-new-tokens", str(a.max_new_tokens),
                             "--threads", str(a.threads), "--out", str(a.dir / "runs" / name / label), "--json",
                             *(["--draft-experts", str(de)] if label == "draftexpert" else [])],
                            env, report["commands"], log)  # fmt: skip
                m["alpha_k4"][label] = metrics.aggregate(out.get("records") or [])["acceptance"]
            log(f"{name}: α(K = 4) {m['alpha_k4']}")
    except Exception as e:  # noqa: BLE001 — what finished is still returned, with the failure named
        report["error"] = f"{type(e).__name__}: {e}"
        log(report["error"])
        rc = 1
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    if models.exists():
        tar_path = a.dir / "models.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(models, arcname="models")
        report["parts"] = split(tar_path, a.out)
        if len(report["parts"]) > 7:  # with train_on_gpu.json: what the device returns at most
            report["error"] = f"{len(report['parts'])} parts: more than the 7 a device run can return beside the report"
    (a.out / "train_on_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "commands"}, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
