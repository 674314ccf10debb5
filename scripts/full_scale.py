"""The full-scale check (a benchmark script, not a test): a DS-V2-Lite-shaped checkpoint of random
bf16 weights (the real config, Hugging Face layout, per-expert tensors, ~4 GB shards: 31.4 GB)
through the user's own commands under a memory cap, then everything it wrote deleted.

    python scripts/full_scale.py --dir /a/disk/with/70GB [--mem-cap 18GiB] [--types q4_0,bf16] [--tokens 4] [--keep]

For each expert type (one at a time: its expert file is deleted before the next is written) it runs
`bench run --model ds --model-path DIR --platform mn --expert-type T --method ar|draftexpert
--engine torch|llama.cpp` on one GSM8K prompt in a child process placed in a memory cgroup
(v1 `memory.limit_in_bytes` or v2 `memory.max`; root), and prints wall seconds, the child's peak
RSS and the group's peak (RSS + page cache it charged), tok/s and the loading share from the
records; then cg's plan for the paper's host (`bench plan --model ds --platform cg --host-mem
64GiB --gpu-mem 24GiB`) and a 24 GiB one. DraftExpert runs the zero draft expert (= shared+top-1:
ds has no distilled draft experts), then — after `--distill-steps` of `bench distill --teacher runtime`
(the teacher streamed from the Q4_0 expert file, in the same cap) — the draft experts it wrote.
The first run of a type includes writing its expert file.

`--platforms cg` (a CUDA GPU; `--cg-device cpu` only to smoke-test the path) runs the user's cg
commands for real: `bench run --platform cg` for AR, shared+top-1 and DraftExpert (zero draft
expert) in bf16 and fp32, beside `--platform resident` (every expert on the GPU: the upper bound,
where it fits), and says whether each speculative run's tokens equal AR's in the same dtype.
On a CUDA machine the random weights are drawn on the GPU (fast; other numbers than the CPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 4 << 30


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V2(-Lite)'s tensor names and shapes as its safetensors checkpoint holds them."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, nope, rope, vdim = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    kv, E, inter = cfg["kv_lora_rank"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    S = inter * cfg["n_shared_experts"]
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "post_attention_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (heads * (nope + rope), H)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv + rope, H)),
            (p + "self_attn.kv_a_layernorm.weight", (kv,)),
            (p + "self_attn.kv_b_proj.weight", (heads * (nope + vdim), kv)),
            (p + "self_attn.o_proj.weight", (H, heads * vdim)),
        ]
        if i < cfg["first_k_dense_replace"]:
            D = cfg["intermediate_size"]
            out += [
                (p + "mlp.gate_proj.weight", (D, H)),
                (p + "mlp.up_proj.weight", (D, H)),
                (p + "mlp.down_proj.weight", (H, D)),
            ]
            continue
        out += [
            (p + "mlp.gate.weight", (E, H)),
            (p + "mlp.shared_experts.gate_proj.weight", (S, H)),
            (p + "mlp.shared_experts.up_proj.weight", (S, H)),
            (p + "mlp.shared_experts.down_proj.weight", (H, S)),
        ]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (inter, H)),
                (q + "up_proj.weight", (inter, H)),
                (q + "down_proj.weight", (H, inter)),
            ]
    return out + [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]


def write_checkpoint(folder: Path, config: Path, log) -> int:
    """The random checkpoint of `config`, shard by shard (one shard in memory); returns its bytes."""
    cfg = json.loads(config.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # any tokenizer serves random weights
        if (REPO / "models" / "ds-tiny" / f).exists():
            shutil.copy(REPO / "models" / "ds-tiny" / f, folder / f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 15.7G normals on the GPU takes seconds
    g = torch.Generator(dev).manual_seed(0)
    shapes = tensor_shapes(cfg)
    shard, size, n, weight_map, total = {}, 0, 0, {}, 0
    names = []

    def flush():
        nonlocal shard, size, n
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
        log(f"  shard {n}: {size / 2**30:.2f} GiB")
        shard, size = {}, 0

    for key, shape in shapes:
        t = (
            torch.ones(shape, dtype=torch.bfloat16)
            if key.endswith("norm.weight")
            else (torch.randn(shape, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
        )
        shard[key] = t
        size += t.nbytes
        total += t.nbytes
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    renamed = {}  # the Hugging Face names: model-0000k-of-0000n.safetensors
    for i, old in enumerate(names, 1):
        new = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        (folder / old).rename(folder / new)
        renamed[old] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


class MemoryCap:
    """A memory cgroup (v1 or v2) the child runs are placed in; root only."""

    def __init__(self, limit: int):
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").exists():
            self.group, self.v1 = v1 / f"draftexpert-fullscale-{os.getpid()}", True
        elif (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
            self.group, self.v1 = v2 / f"draftexpert-fullscale-{os.getpid()}", False
        else:
            raise SystemExit("no memory cgroup controller here: run without --mem-cap, or as root on cgroup v1/v2")
        try:
            self.group.mkdir()
            (self.group / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
        except OSError as e:
            raise SystemExit(f"cannot create the memory cgroup {self.group} ({e.strerror}): run as root") from None

    def reset_peak(self) -> None:
        if self.v1:
            (self.group / "memory.max_usage_in_bytes").write_text("0")

    def peak(self) -> int | None:
        f = self.group / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(f.read_text()) if f.exists() else None

    def enter(self) -> None:  # in the child, before exec
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        try:
            self.group.rmdir()
        except OSError:
            pass


def run_child(args: list[str], cap: MemoryCap | None, env: dict, scratch: Path) -> dict:
    """One command in the memory cap: rc, wall seconds, its peak RSS (wait4), the group's peak."""
    if cap:
        cap.reset_peak()
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(scratch / "stdout", "wb") as out, open(scratch / "stderr", "wb") as err:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err, preexec_fn=cap.enter if cap else None)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "seconds": time.perf_counter() - t0,
        "stdout": (scratch / "stdout").read_text(),
        "stderr": (scratch / "stderr").read_text(),
        "peak_rss": usage.ru_maxrss * 1024,
        "group_peak": cap.peak() if cap else None,
    }


def distill_rows(a, bench: list[str], ckpt: Path, cap, env: dict, log) -> list[dict]:
    """A few distillation steps where inference runs (the runtime teacher over the Q4_0 expert
    file, 1 window of 64 tokens a step), then DraftExpert decoding with the draft experts written."""
    out = a.dir / "runs" / "draft_experts.safetensors"
    cmds = [
        (
            "distill",
            [
                *bench,
                "distill",
                "--model",
                a.model,
                "--model-path",
                str(ckpt),
                "--teacher",
                "runtime",
                "--platform",
                "mn",
                "--expert-type",
                "q4_0",
                "--steps",
                str(a.distill_steps),
                "--batch-size",
                "1",
                "--seq-len",
                "64",
                "--held-out",
                "4",
                "--threads",
                "2",
                "--out",
                str(out),
                "--json",
            ],
        ),
        (
            "draftexpert, distilled",
            [
                *bench,
                "run",
                "--model",
                a.model,
                "--model-path",
                str(ckpt),
                "--platform",
                "mn",
                "--expert-type",
                "q4_0",
                "--method",
                "draftexpert",
                "--suite",
                "gsm8k",
                "--limit",
                "1",
                "--max-new-tokens",
                str(a.tokens),
                "--out",
                str(a.dir / "runs" / "q4_0-torch-draftexpert-distilled"),
                "--json",
                "--draft-experts",
                str(out),
            ],
        ),
    ]
    rows = []
    for what, cmd in cmds:
        log(f"== q4_0 torch {what}")
        row = run_row(
            cmd,
            cap,
            env,
            a.dir / "scratch",
            log,
            distill_stats if what == "distill" else record_stats,
            type="q4_0",
            engine="torch",
            method=what,
            args="",
        )
        row.pop("tokens", None)
        rows.append(row)
        if row["rc"]:
            break
    return rows


def record_stats(stdout: str) -> dict:
    """What a row keeps of `bench run --json`: its one record's speed, loading share and tokens."""
    rec = json.loads(stdout)["records"][0]
    return {
        "tok_s": rec["decode_tps"],
        "loading_share": rec.get("loading_share"),
        "new_tokens": rec["new_tokens"],
        "tokens": rec["tokens"],
    }


def distill_stats(stdout: str) -> dict:
    d = json.loads(stdout)
    return {"steps": d["steps"], "s_per_step": round(d["train_seconds"] / max(1, d["steps"]), 1)}


def run_row(cmd: list[str], cap, env: dict, scratch: Path, log, stats=record_stats, **tags) -> dict:
    """One command in the cap: a row of wall seconds, peaks and `stats` of its JSON output (or its error)."""
    r = run_child(cmd, cap, env, scratch)
    row = {
        **tags,
        "rc": r["rc"],
        "seconds": round(r["seconds"], 1),
        "peak_rss_gib": round(r["peak_rss"] / 2**30, 2),
        "group_peak_gib": r["group_peak"] and round(r["group_peak"] / 2**30, 2),
    }
    if r["rc"] == 0:
        row.update(stats(r["stdout"]))
    else:
        row["error"] = r["stderr"].strip().splitlines()[-3:] or ["(killed)"]
    log(json.dumps({k: v for k, v in row.items() if k != "tokens"}))
    return row


def cg_rows(a, bench: list[str], ckpt: Path, cap, env: dict, log) -> list[dict]:
    """The user's cg commands on the GPU (`--cg-cells`, e.g. resident AR: the upper bound; AR;
    shared+top-1; DraftExpert with the zero draft expert) in each of `--cg-dtypes`; every row's
    `tokens_equal_ar` is against cg's AR in its dtype (greedy: equal in fp32, a near-tie may flip in bf16)."""
    rows = []
    for dtype in a.cg_dtypes.split(","):
        for cell in a.cg_cells.split(","):
            platform, method = cell.split(":")
            cmd = [
                *bench,
                "run",
                "--model",
                a.model,
                "--model-path",
                str(ckpt),
                "--platform",
                platform,
                "--method",
                method,
                "--dtype",
                dtype,
                "--device",
                a.cg_device,
                "--suite",
                "gsm8k",
                "--limit",
                "1",
                "--max-new-tokens",
                str(a.tokens),
                "--out",
                str(a.dir / "runs" / f"{platform}-{dtype}-{method}"),
                "--json",
                *a.cg_args.split(),
            ] + (["--draft-experts", "zero"] if method == "draftexpert" else [])
            log(f"== {platform} {dtype} {method} ({a.cg_device}) {a.cg_args}")
            rows.append(
                run_row(
                    cmd,
                    cap,
                    env,
                    a.dir / "scratch",
                    log,
                    platform=platform,
                    dtype=dtype,
                    method=method,
                    device=a.cg_device,
                    args=a.cg_args,
                )
            )
        ar = next((r for r in rows if (r["platform"], r["dtype"], r["method"]) == ("cg", dtype, "ar")), {})
        for row in rows:
            if row["dtype"] == dtype and row is not ar and "tokens" in row and "tokens" in ar:
                row["tokens_equal_ar"] = row["tokens"] == ar["tokens"]
                log(f"{row['platform']} {dtype} {row['method']}: tokens equal cg AR's: {row['tokens_equal_ar']}")
    for r in rows:
        r.pop("tokens", None)
    return rows


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([0-9.]+)\s*(k|m|g|t)?(i)?b?", text.strip().lower())
    if not m:
        raise SystemExit(f"--mem-cap: {text!r} is not a size (e.g. 18GiB)")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** (" kmgt".index(m.group(2) or " ")))


def main() -> int:
    ap = argparse.ArgumentParser(description="DS-V2-Lite-shaped random checkpoint through mn and cg's plan")
    ap.add_argument("--dir", type=Path, required=True, help="a folder on a disk with ~70 GB free")
    ap.add_argument("--mem-cap", default="18GiB")
    ap.add_argument("--types", default="q4_0,bf16")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the expert files")
    ap.add_argument(
        "--distill-steps",
        type=int,
        default=2,
        help="steps of `bench distill --teacher runtime` "
        "on mn q4_0, then DraftExpert with those draft experts (0: skip)",
    )
    ap.add_argument("--model", default="ds", help="the registry name the checkpoint is run as (smoke runs: ds-tiny)")
    ap.add_argument("--config", type=Path, default=REPO / "bench" / "model_facts" / "ds.json")
    ap.add_argument(
        "--platforms",
        default="mn",
        help="mn (both engines, --types) and/or cg (a CUDA GPU: the user's cg commands for real, beside resident)",
    )
    ap.add_argument("--cg-dtypes", default="bf16,fp32")
    ap.add_argument(
        "--cg-cells",
        default="resident:ar,cg:ar,cg:top-r,cg:draftexpert",
        help="platform:method pairs run in each cg dtype",
    )
    ap.add_argument("--cg-args", default="", help="more `bench run` flags for the cg rows, e.g. --compile")
    ap.add_argument("--cg-device", default="cuda", help="cpu: smoke-test the cg rows without a GPU")
    a = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    limit = 0 if a.mem_cap.lower() == "none" else parse_size(a.mem_cap)
    ckpt, cache = a.dir / "ds-v2-lite-random", a.dir / "cache"
    bench = [sys.executable, "-m", "bench.cli"]
    env = dict(os.environ, DRAFTEXPERT_CACHE=str(cache), PYTHONPATH=str(REPO))
    rows, cap = [], MemoryCap(limit) if limit else None
    try:
        t0 = time.perf_counter()
        if not (ckpt / "model.safetensors.index.json").exists():
            log(f"writing the random checkpoint to {ckpt}")
            total = write_checkpoint(ckpt, a.config, log)
            log(f"checkpoint: {total / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s")
        platforms = a.platforms.split(",")
        if bad := set(platforms) - {"mn", "cg"}:
            raise SystemExit(f"--platforms: {', '.join(sorted(bad))} is not mn or cg")
        if "cg" in platforms:
            rows += cg_rows(a, bench, ckpt, cap, env, log)
        for qtype in a.types.split(",") if "mn" in platforms else []:
            cells = [(engine, method, []) for engine in ("torch", "llama.cpp") for method in ("ar", "draftexpert")]
            if qtype == "q4_0":  # every draft position's experts kept (the round's bound must hold), and cg
                cells += [
                    ("torch", "draftexpert", ["--no-truncate", "--k-max", "4"]),
                    ("torch", "ar", ["--platform", "cg", "--device", "cpu"]),
                ]  # must refuse before loading
            for engine, method, extra in cells:
                tag = "".join(x.strip("-")[:2] for x in extra)
                out = a.dir / "runs" / f"{qtype}-{engine}-{method}{tag}"
                cmd = [
                    *bench,
                    "run",
                    "--model",
                    a.model,
                    "--model-path",
                    str(ckpt),
                    "--platform",
                    "mn",
                    "--expert-type",
                    qtype,
                    "--method",
                    method,
                    "--engine",
                    engine,
                    "--suite",
                    "gsm8k",
                    "--limit",
                    "1",
                    "--max-new-tokens",
                    str(a.tokens),
                    "--out",
                    str(out),
                    "--json",
                    *extra,
                ]
                if method == "draftexpert":
                    cmd += ["--draft-experts", "zero"]
                log(f"== {qtype} {engine} {method} {' '.join(extra)}")
                row = run_row(
                    cmd,
                    cap,
                    env,
                    a.dir / "scratch",
                    log,
                    type=qtype,
                    engine=engine,
                    method=method,
                    args=" ".join(extra),
                )
                row.pop("tokens", None)
                rows.append(row)
            if qtype == "q4_0" and a.distill_steps:
                rows += distill_rows(a, bench, ckpt, cap, env, log)
            for f in cache.rglob(f"*{qtype}*"):  # this type's expert file and heads: room for the next
                f.unlink() if f.is_file() or f.is_symlink() else shutil.rmtree(f)
        for host in ("64GiB", "24GiB"):
            r = run_child(
                [
                    *bench,
                    "plan",
                    "--model",
                    "ds",
                    "--platform",
                    "cg",
                    "--host-mem",
                    host,
                    "--gpu-mem",
                    "24GiB",
                    "--json",
                ],
                None,
                env,
                a.dir / "scratch",
            )
            p = json.loads(r["stdout"])
            rows.append(
                {
                    "plan": f"cg, host {host}, GPU 24GiB",
                    "fits": p["fits"],
                    "pinned_gib": p["host_pinned"] / 2**30,
                    "host_gib": p["host"] / 2**30,
                    "warning": p["warning"],
                }
            )
            log(json.dumps(rows[-1]))
    finally:
        if cap:
            cap.close()
        if not a.keep:
            shutil.rmtree(a.dir / "runs", ignore_errors=True)
            shutil.rmtree(a.dir / "scratch", ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(ckpt, ignore_errors=True)
    print(json.dumps({"mem_cap": a.mem_cap, "tokens": a.tokens, "rows": rows}, indent=2))
    return 0 if all(r.get("rc", 0) == 0 or "--platform cg" in r.get("args", "") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
