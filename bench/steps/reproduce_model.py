"""`bench reproduce --model ds|ml`: the paper's tables and figures on a real model, from its weights
to every page, into `results/<model>/` (never mixed with the embedded models' results).

Steps, in order; each is skipped when `STEPS.json` records it finished with the same settings, and
resumes inside (the results store keeps finished prompts of every cell, a distillation its last
checkpoint):

  expert-files      the GGUF expert files: Q4_0 (mn, the llama.cpp model's split 2), bf16 (Fig. 1b's row)
  distill-<preset>  Table 5's trained presets (residual, logit-token, full) through the runtime teacher
                    (`RECIPE`); DraftExpert never runs on the zero draft expert: without `full` the
                    steps that decode with it refuse
  table2-<platform>[-llama.cpp]  Tables 2 / 3: AR, the resident bound (where it fits), top-1/2/3,
                    DraftExpert, prompt lookup, AR + equal-memory cache; physical limit per row
  table4-mn[-llama.cpp], fig2, fig3, fig45, fig1b, table5 (`bench distill-eval` through the runtime
                    teacher), table1

Before anything loads, `plan` (what `bench plan --reproduce` prints) checks each step's memory and
disk against the machine and refuses naming the step that does not fit; its times are estimates
(bytes moved ÷ the measured storage read rate, a distillation step's measured time when one exists).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.cells import registry
from bench.cells.artifacts import WORK, expert_file_for, find_draft_experts
from bench.runs.results import write_json_atomic
from bench.runs.telemetry import collect, expert_storage
from bench.steps import distill as bd
from bench.steps import reproduce as rp
from bench.steps.compare import measured_read_bw
from draftexpert.engines.llamacpp import LlamaCppError, require_llama_cpp
from draftexpert.runtime.checkpoint import weights_fingerprint
from draftexpert.runtime.params import GIB, available_host_bytes, breakdown, distill_plan, plan
from draftexpert.training.distill import DistillConfig, load_draft_experts

REAL_MODELS = ("ds", "ml")
TRAINED_PRESETS = [p for p in bd.PRESET_ORDER if p != "top1"]  # top1 is the zero draft expert


@dataclass(frozen=True)
class Recipe:
    """The draft experts' distillation on the paper's CG machine (one 24 GB GPU, 64 GB host): the
    runtime teacher on cg (the routed experts in pinned host memory, bf16 as the checkpoint ships
    them, moved to the GPU a layer at a time), or on mn from the Q4_0 expert file where there is no
    GPU. I_d = the routed experts' width; AdamW, warm-up then cosine to 10%; the loss weights are
    the library's (`DistillConfig`). 2 × 512 = 1,024 tokens a step, 1.0M tokens per preset: batch 2
    is what fits the 24 GB card (planned 17.3 GiB for DS, 19.7 for Moonlight, whose vocabulary
    makes the logits larger; batch 4 plans 24.4 / 28.1 GiB)."""

    steps: int = 1000
    batch_size: int = 2
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 50
    held_out: int = 16  # validation windows evaluated during training and by Table 5

    def config(self, preset: str, intermediate: int, threads: int) -> DistillConfig:
        return DistillConfig(
            preset=preset,
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lr=self.lr,
            warmup=min(self.warmup, self.steps),
            intermediate=intermediate,
            threads=threads,
            eval_every=max(1, self.steps // 5),
            checkpoint_every=max(1, min(25, self.steps)),
        )


RECIPE = Recipe()
PLATFORMS = {"cg": ("cg",), "mn": ("mn",), "both": ("mn", "cg")}


class ReproduceError(RuntimeError):
    """A reproduction that cannot go on: what is missing and the command that supplies it."""


# -- the plan -----------------------------------------------------------------------------------


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def expert_types(platforms: tuple[str, ...], teacher_platform: str) -> list[str]:
    """The GGUF expert files a reproduction writes: mn's Q4_0 and Fig. 1b's bf16; the Q4_0 file for
    an mn teacher; none for cg alone on a GPU (its host pool is read from the checkpoint)."""
    if "mn" in platforms:
        return ["q4_0", "bf16"]
    return ["q4_0"] if teacher_platform == "mn" else []


def measured_step_seconds(model: str, folder: Path | None, recipe: Recipe) -> float | None:
    """Seconds per distillation step measured on this machine for this model and recipe (the
    newest history of a finished or running distillation), else None."""
    if folder is None:
        return None
    best = None
    for hist in sorted((WORK / "distill").glob(f"{model}-*/state.pt")):
        try:
            st = torch.load(hist, weights_only=False, map_location="cpu")
        except Exception:  # noqa: BLE001 - a damaged state only loses the estimate
            continue
        c = st.get("config", {})
        if (c.get("seq_len"), c.get("batch_size")) != (recipe.seq_len, recipe.batch_size):
            continue
        secs = [h["seconds"] for h in st.get("history", []) if "seconds" in h]
        if secs:
            best = sorted(secs)[len(secs) // 2]
    return best


def reproduce_plan(
    model: str,
    cfg: dict,
    platforms: tuple[str, ...],
    device: str,
    host: int | None,
    gpu: int | None,
    disk_free: int | None,
    read_bw: float | None,
    recipe: Recipe = RECIPE,
    per_suite: int = rp.FIG1B_PER_SUITE,
    tokens: int = rp.FIG1B_TOKENS,
    dtype: str = "fp32",
    folder: Path | None = None,
    headroom: float = 0.9,
    copy_in: dict | None = None,
) -> dict:
    """Every step's memory (host, GPU), disk and estimated time, from the config alone (no weights
    needed), and the first step that does not fit (`refused`, with why). `copy_in`: `bench env`'s
    copy-in rates (the GPU's from pinned memory when measured, else PCIe 4.0 ×16's nominal 25 GB/s,
    the paper's card; the CPU as the accelerator: its memcpy rate)."""
    cuda = device == "cuda"
    dbytes = {"fp32": 4, "bf16": 2}[dtype]
    b = breakdown(cfg).summary()
    n_prompts = 6 * per_suite
    pm = plan(cfg, "mn", False, 4, "q4_0", positions=5, draft_intermediate=cfg["moe_intermediate_size"])
    pc = plan(cfg, "cg", cuda, dbytes, "q4_0", positions=5, draft_intermediate=cfg["moe_intermediate_size"])
    bf16_file = plan(cfg, "mn", False, 4, "bf16")["storage"]
    # bytes a decoded token moves cold: the active routed experts (top-k of every MoE layer) + the rest once read
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_token_q4 = moe_layers * cfg["num_experts_per_tok"] * b["routed_expert_mib_q4_0"] * 2**20
    per_token_bf16 = per_token_q4 * b["routed_expert_mib_bf16"] / b["routed_expert_mib_q4_0"]
    copy_in = copy_in or {}
    if cuda:
        measured_h2d = copy_in.get("cuda_pinned_gb_per_s")
        h2d, h2d_basis = (measured_h2d * 1e9, "measured") if measured_h2d else (25e9, "PCIe 4.0 ×16 nominal")
    else:
        cpu_copy = copy_in.get("cpu_gb_per_s")
        h2d, h2d_basis = (cpu_copy * 1e9, "measured memcpy") if cpu_copy else (None, "unmeasured")
    rows = []

    def row(step, what, host_b, gpu_b, disk_b, seconds, basis):
        rows.append(
            {
                "step": step,
                "what": what,
                "host": int(host_b),
                "gpu": int(gpu_b),
                "disk": int(disk_b),
                "seconds": seconds,
                "time_basis": basis,
            }
        )

    rb = read_bw or None
    est = "estimate: bytes moved ÷ the measured storage read rate; compute not counted"
    teacher_platform = "cg" if "cg" in platforms and cuda else "mn"
    types = expert_types(platforms, teacher_platform)
    files = {"q4_0": pm["storage"], "bf16": bf16_file}
    row(
        "expert-files",
        "GGUF expert files: " + (", ".join(types) or "none (cg reads the checkpoint)") + ", one layer at a time",
        pm["conversion_peak"] if types else 0,
        0,
        sum(files[t] for t in types),
        sum(b["routed_gib_bf16"] * GIB + files[t] for t in types) / rb if rb else None,
        est,
    )
    p_teacher = pc if teacher_platform == "cg" else pm
    inter = cfg["moe_intermediate_size"]
    d = distill_plan(cfg, p_teacher, inter, recipe.seq_len, recipe.batch_size, "runtime")
    measured = measured_step_seconds(model, folder, recipe)
    # a step streams every MoE layer's experts about three times per window (target pass, draft pass,
    # the backward's top-1 recompute): a long window touches nearly every expert of a layer
    window_bytes = 3 * (b["routed_gib_q4_0"] if teacher_platform == "mn" else b["routed_gib_bf16"]) * GIB
    rate = (h2d if teacher_platform == "cg" else rb) or None
    step_s = measured or (recipe.batch_size * window_bytes / rate if rate else None)
    # the draft experts in fp32 (the checkpoint) and the resumable state (them, AdamW's two moments)
    ckpt_bytes = 16 * moe_layers * 3 * cfg["hidden_size"] * inter
    for preset in TRAINED_PRESETS:
        row(
            f"distill-{preset}",
            f"{recipe.steps} steps × {recipe.batch_size} × {recipe.seq_len} tokens, "
            f"runtime teacher on {teacher_platform}",
            d["distill_host"],
            d["distill_accelerator"],
            ckpt_bytes,
            recipe.steps * step_s if step_s else None,
            "measured s/step on this machine"
            if measured
            else est.replace("storage read rate", f"rate (cg: {h2d_basis} {(h2d or 0) / 1e9:.1f} GB/s)")
            + " (three passes over the experts a window)",
        )
    for platform in platforms:
        p = pm if platform == "mn" else pc
        per_tok, bw = (per_token_q4, rb) if platform == "mn" else (per_token_bf16, h2d)
        decode = n_prompts * tokens * per_tok / bw if bw else None
        engines = ["torch"] + (["llama.cpp"] if platform == "mn" else [])
        for engine in engines:
            tag = f"{platform}" + ("-llama.cpp" if engine == "llama.cpp" else "")
            row(
                f"table2-{tag}",
                f"Tables 2/3 on {platform} ({engine}): 8 rows × {n_prompts} prompts × {tokens} tokens",
                p["host_least"],  # a round's working set is bounded to what is left (`working_set_bound`)
                p["accelerator_least"],
                0,
                8 * decode if decode else None,
                est + " (AR's bytes a token as the bound of every row)",
            )
    if "mn" in platforms:
        decode = n_prompts * tokens * per_token_q4 / rb if rb else None
        row(
            "table4-mn",
            "Table 4: 4 policies, both engines",
            pm["host_least"],
            0,
            0,
            8 * decode if decode else None,
            est,
        )
        row(
            "fig3",
            "Fig. 3: 5 drafters at K = 8",
            pm["host_least"],
            0,
            0,
            5 * n_prompts * tokens * per_token_q4 / rb if rb else None,
            est,
        )
        k, n_exp = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
        dense = (b["total"] - b["routed_experts"] + moe_layers * k * b["routed_expert_params_each"]) * 2  # bf16
        # cold blocks of L = 1…8 at 3 starts: a block touches ~min(E, k·L) experts a layer; the dense
        # counterpart k "experts" a layer whatever L
        expert_q4 = b["routed_expert_mib_q4_0"] * 2**20
        sweep = sum(min(n_exp, k * n) for n in range(1, 9)) + 8 * k
        row(
            "fig45",
            "Figs. 4–5: verify blocks, the MoE and its dense counterpart",
            pm["host_least"],
            0,
            dense,
            n_prompts * 3 * sweep * moe_layers * expert_q4 / rb if rb else None,
            est,
        )
    # s/token of Fig. 1b's cells: mn Q4_0 and bf16 from storage, cg bf16 over PCIe
    fig1b_cells = ([(per_token_q4, rb), (per_token_bf16, rb)] if "mn" in platforms else []) + (
        [(per_token_bf16, h2d)] if "cg" in platforms else []
    )
    fig1b_per_token = None if any(bw is None for _, bw in fig1b_cells) else sum(b / bw for b, bw in fig1b_cells)
    row(
        "fig1b",
        "Fig. 1b: AR on " + ", ".join("mn (q4_0, bf16)" if p == "mn" else p for p in platforms),
        max(pm["host_least"] if "mn" in platforms else 0, pc["host_least"] if "cg" in platforms else 0),
        pc["accelerator_least"] if "cg" in platforms else 0,
        0,
        n_prompts * tokens * fig1b_per_token if fig1b_per_token is not None else None,
        est,
    )
    row(
        "table5",
        "Table 5: held-out KL / agreement and α of the four presets, runtime teacher",
        d["distill_host"],
        d["distill_accelerator"],
        0,
        4 * 2 * recipe.held_out * window_bytes / 3 / rate if rate else None,
        est,
    )
    refused = None
    for r in rows:
        for mem, have in (("host", host), ("gpu", gpu if cuda else None), ("disk", disk_free)):
            if have is not None and r[mem] > headroom * have:
                refused = {
                    "step": r["step"],
                    "why": f"{r['step']} needs {r[mem] / GIB:.1f} GiB of {mem} "
                    f"({'memory' if mem != 'disk' else 'space'}), {have / GIB:.1f} GiB is available, "
                    f"{headroom * have / GIB:.1f} GiB of it usable",
                }
                break
        if refused:
            break
    disk_total = sum(r["disk"] for r in rows)
    return {
        "model": model,
        "platforms": list(platforms),
        "device": device,
        "dtype": dtype,
        "recipe": asdict(recipe),
        "available": {"host": host, "gpu": gpu if cuda else None, "disk": disk_free},
        "read_bw": read_bw,
        "copy_bw": {"bytes_per_s": h2d, "basis": h2d_basis},
        "steps": rows,
        "disk_total": disk_total,
        "seconds_total": sum(r["seconds"] or 0 for r in rows),
        "refused": refused,
    }


def plan_text(p: dict) -> str:
    g = lambda n: f"{n / GIB:7.1f} GiB" if n else "      –    "  # noqa: E731
    a = p["available"]
    lines = [
        f"bench reproduce --model {p['model']} --platform {'+'.join(p['platforms'])} --device {p['device']} "
        f"({p['dtype']} compute); distillation {p['recipe']['steps']} steps × {p['recipe']['batch_size']} × "
        f"{p['recipe']['seq_len']} tokens per preset",
        f"  {'step':22s}{'host':>12s}{'GPU':>12s}{'disk':>12s}{'time':>10s}  what",
    ]
    for r in p["steps"]:
        lines.append(
            f"  {r['step']:22s}{g(r['host'])}{g(r['gpu']) if r['gpu'] else '      –    '}{g(r['disk'])}"
            f"{_fmt_s(r['seconds']):>10s}  {r['what']}"
        )
    lines.append(
        f"  {'= disk, time':22s}{'':12s}{'':12s}{g(p['disk_total'])}{_fmt_s(p['seconds_total']):>10s}"
        "  (times: estimates — see each step's basis with --json)"
    )
    lines.append(
        "  available: host "
        + (f"{a['host'] / GIB:.1f} GiB" if a["host"] else "?")
        + (f", GPU {a['gpu'] / GIB:.1f} GiB" if a["gpu"] else "")
        + (f", disk {a['disk'] / GIB:.1f} GiB" if a["disk"] else "")
        + (
            f"; storage read {p['read_bw'] / 1e9:.2f} GB/s (measured)"
            if p["read_bw"]
            else "; storage read rate unmeasured"
        )
    )
    lines.append(f"does not fit: {p['refused']['why']}" if p["refused"] else "fits")
    return "\n".join(lines)


# -- the steps ----------------------------------------------------------------------------------


class Peaks:
    """A step's wall time and peaks: the process's resident set (sampled every 50 ms) and the GPU's
    allocated memory (torch's own peak, reset at the start)."""

    def __enter__(self):
        self.t0, self.host, self._stop = time.perf_counter(), 0, threading.Event()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            try:
                with open("/proc/self/statm") as f:
                    self.host = max(self.host, int(f.read().split()[1]) * page)
            except OSError:
                self.host = max(self.host, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            self._stop.wait(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0
        self.gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return False


class Steps:
    """STEPS.json: each finished step with its settings' key, wall time, peaks and files."""

    def __init__(self, results_dir: Path, log):
        self.path, self.log = results_dir / "STEPS.json", log
        self.done = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.order: list[str] = []  # this run's steps, in order

    def run(self, name: str, key: dict, fn) -> list[str]:
        k = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
        self.order.append(name)
        if self.done.get(name, {}).get("key") == k:
            self.log(f"[{name}] done already ({self.done[name]['seconds']:.0f} s), kept")
            return self.done[name]["written"]
        self.log(f"[{name}] running")
        with Peaks() as pk:
            written = fn()
        self.done[name] = {
            "key": k,
            "settings": key,
            "seconds": round(pk.seconds, 2),
            "host_peak_bytes": pk.host,
            "gpu_peak_bytes": pk.gpu,
            "written": written,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_json_atomic(self.path, self.done)
        self.log(f"[{name}] finished in {pk.seconds:.0f} s, host peak {pk.host / GIB:.2f} GiB")
        return written


def _need_draft_experts(model: str, folder: Path) -> None:
    path = find_draft_experts(model, folder, "full")
    if path is None:
        raise ReproduceError(
            f"{model} has no distilled draft experts for {folder}: the distill-full step must finish first "
            "(DraftExpert is never reproduced on the zero draft expert)"
        )
    load_draft_experts(path, folder)  # paired with these weights, or DistillError


def reproduce_model(
    model: str,
    folder: Path,
    results_dir: Path,
    platforms: tuple[str, ...] = ("mn", "cg"),
    device: str = "cpu",
    per_suite: int = rp.FIG1B_PER_SUITE,
    tokens: int = rp.FIG1B_TOKENS,
    recipe: Recipe = RECIPE,
    threads: int = 1,
    gpu_mem: int | None = None,
    host_mem: int | None = None,
    dtype: str = "fp32",
    log=print,
) -> dict:
    """Every step for a real model (or a checkpoint of its shape), resumable; returns the summary
    REPRODUCE.json holds."""
    if model not in REAL_MODELS:
        raise ReproduceError(
            f"{model!r} is not a real model ({', '.join(REAL_MODELS)}); `bench reproduce` covers the embedded ones"
        )  # noqa: E501
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ReproduceError("--device cuda: no CUDA GPU is visible")
        if gpu_mem:  # the paper's card on a larger one: torch's allocator refuses past the fraction
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, gpu_mem / torch.cuda.get_device_properties(0).total_memory)
            )
    results_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    machine = collect(expert_storage(), keep_probe=True)
    write_json_atomic(results_dir / "machine.json", machine)
    p = reproduce_plan(
        model,
        cfg,
        platforms,
        device,
        host_mem or available_host_bytes(),
        gpu_mem or (torch.cuda.mem_get_info()[0] if device == "cuda" else None),
        shutil.disk_usage(expert_storage()).free,
        measured_read_bw(machine),
        recipe,
        per_suite,
        tokens,
        copy_in=machine.get("copy_in"),
        dtype=dtype,
        folder=folder,
    )
    write_json_atomic(results_dir / "plan.json", p)
    log(plan_text(p))
    if p["refused"]:
        raise ReproduceError(f"refused before loading: {p['refused']['why']} (`bench plan --reproduce`)")
    try:
        bd.token_splits(folder, log)
    except FileNotFoundError as e:
        raise ReproduceError(f"the distillation data is missing: {e}") from None
    folders = {model: folder}
    steps = Steps(results_dir, log)
    shaped = registry.is_shaped(model, cfg)
    base = {"weights": weights_fingerprint(folder), "per_suite": per_suite, "tokens": tokens}
    done = []
    torch.set_num_threads(threads)
    teacher_platform = "cg" if "cg" in platforms and device == "cuda" else "mn"
    done += steps.run(
        "expert-files",
        {"weights": base["weights"]},
        lambda: [str(expert_file_for(model, folder, t, log=log)) for t in expert_types(platforms, teacher_platform)],
    )
    inter = cfg["moe_intermediate_size"]
    for preset in TRAINED_PRESETS:
        dcfg = recipe.config(preset, inter, threads)

        def distill(dcfg=dcfg):
            r = bd.distill(
                model,
                folder,
                dcfg,
                None,
                log,
                teacher="runtime",
                platform=teacher_platform,
                expert_type="q4_0",
                device=device if teacher_platform == "cg" else "cpu",
                held_out=recipe.held_out,
            )
            return [r["out"]]

        done += steps.run(
            f"distill-{preset}",
            {"weights": base["weights"], "config": asdict(dcfg), "teacher": teacher_platform},
            distill,
        )
    _need_draft_experts(model, folder)
    cg_device = device
    llama = True
    try:
        require_llama_cpp()
    except LlamaCppError as e:
        llama = False
        log(f"llama.cpp rows skipped: {e}")
    for platform in platforms:
        engines = ["torch"] + (["llama.cpp"] if platform == "mn" and llama else [])
        for engine in engines:
            tag = platform + ("-llama.cpp" if engine == "llama.cpp" else "")
            done += steps.run(
                f"table2-{tag}",
                base
                | {"engine": engine, "device": cg_device if platform == "cg" else None}
                | ({"dtype": dtype} if platform == "cg" and dtype != "fp32" else {}),
                lambda platform=platform, engine=engine: rp.spec_compare(
                    results_dir,
                    log,
                    per_suite,
                    tokens,
                    engine=engine,
                    models=(model,),
                    platform=platform,
                    device=cg_device if platform == "cg" else None,
                    folders=folders,
                    dtype=dtype,
                ),
            )
    first = "mn" if "mn" in platforms else "cg"
    done += steps.run(
        "fig2", base | {"from": first}, lambda: rp.fig2(results_dir, log, models=(model,), platform=first)
    )
    if "mn" in platforms:
        for engine in ["torch"] + (["llama.cpp"] if llama else []):
            tag = "mn" + ("-llama.cpp" if engine == "llama.cpp" else "")
            done += steps.run(
                f"table4-{tag}",
                base | {"engine": engine},
                lambda engine=engine: rp.table4(
                    results_dir, log, per_suite, tokens, engine=engine, models=(model,), folders=folders
                ),
            )
        done += steps.run(
            "fig3", base, lambda: rp.fig3(results_dir, log, per_suite, tokens, models=(model,), folders=folders)
        )
        done += steps.run(
            "fig45",
            base,
            lambda: rp.fig45(results_dir, log, per_suite, quick=per_suite < 2, models=(model,), folders=folders),
        )
    cells = [c for c in rp.FIG1B_CELLS if c[0] in platforms]
    done += steps.run(
        "fig1b",
        base | {"cells": cells, "device": cg_device} | ({"dtype": dtype} if dtype != "fp32" else {}),
        lambda: rp.fig1b_runs(
            results_dir,
            log,
            per_suite,
            tokens,
            model=model,
            folders=folders,
            cells_to_run=cells,
            device=cg_device,
            dtype=dtype,
        ),
    )
    done += steps.run(
        "table5",
        base | {"recipe": asdict(recipe), "teacher": teacher_platform},
        lambda: rp.table5(
            results_dir,
            log,
            per_suite,
            tokens,
            quick=False,
            models=(model,),
            folders=folders,
            teacher="runtime",
            platform=teacher_platform,
            device=device if teacher_platform == "cg" else "cpu",
            held_out=recipe.held_out,
            seq_len=recipe.seq_len,
        ),
    )
    done += rp.table1(results_dir, log)
    done = [_where(results_dir, w) for w in done]
    summary = {
        "model": model,
        "folder": str(folder),
        "shaped": shaped,
        "platforms": list(platforms),
        "device": device,
        "written": done,
        "steps": {  # in the order they ran
            k: {x: steps.done[k][x] for x in ("seconds", "host_peak_bytes", "gpu_peak_bytes", "finished")}
            for k in steps.order
        },
        "tokens_equal_ar": tokens_equal_ar(results_dir),
    }
    write_json_atomic(results_dir / "REPRODUCE.json", summary)
    return summary


def _where(results_dir: Path, written: str) -> str:
    """A step's file as the reproduction wrote it (the embedded steps name theirs under results/)."""
    for prefix in ("results/", f"{results_dir.name}/"):
        if written.startswith(prefix):
            path = results_dir / written[len(prefix) :]
            return str(path.relative_to(registry.REPO_ROOT)) if path.is_relative_to(registry.REPO_ROOT) else str(path)
    return written


def tokens_equal_ar(results_dir: Path) -> dict[str, bool]:
    """Per table file and row: whether the row's tokens equal AR's (the comparisons record it)."""
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            res = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(res, dict) and isinstance(res.get("tokens_equal_ar"), dict):
            for label, ok in res["tokens_equal_ar"].items():
                out[f"{path.stem}:{label}"] = bool(ok)
    return out
