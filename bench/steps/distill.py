"""`bench distill` / `bench distill-eval`: train the draft experts of a target on the corpus's
training split (never the evaluation prompts: the corpus is decontaminated against them) and
measure Table 5 on held-out text and prompts.

Where things go: `bench.cells.artifacts.experts_dir` (embedded models beside their weights,
`models/<name>/draft_experts/<preset>.safetensors` + `.history.jsonl`, `.loss.png`; real models
under `work/draft_experts/<name>/<weights sha256[:12]>/`).
Training state (resumable: the same options resume) lives in `work/distill/<name>-<preset>-<options hash>/`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch

from bench.cells import registry
from bench.cells.artifacts import WORK, expert_file_for, experts_dir, find_draft_experts
from bench.suites.prompts import render_prompt
from bench.tiny.evaluate import load_split
from bench.tiny.tokenizer import token_data_for
from draftexpert import metrics
from draftexpert.engines.torch_engine import TorchEngine
from draftexpert.runtime.checkpoint import load_target, load_tokenizer, weights_fingerprint
from draftexpert.runtime.loader import build_model
from draftexpert.runtime.params import available_host_bytes, check_distill_fits, distill_plan, plan
from draftexpert.speculation.drafters import DraftExperts, draftexpert
from draftexpert.speculation.round import SpecConfig, SpeculativeDecoder
from draftexpert.training.distill import (
    PRESETS,
    DistillConfig,
    DraftExpertModule,
    RuntimeTeacher,
    TransformersTeacher,
    eval_windows,
    evaluate,
    evaluate_continuations,
    load_draft_experts,
    save_draft_experts,
    train,
)
from paper_figs import paper

PRESET_ORDER = ["top1", "residual", "logit-token", "full"]  # Table 5's rows
EVAL_WINDOWS = 32  # held-out windows of `seq_len` tokens for KL / agreement


def token_splits(folder: Path, log):
    d = token_data_for(folder, WORK / "corpus", WORK / "data", log=log)
    return load_split(d, "train"), load_split(d, "val")


TEACHERS = ("auto", "transformers", "runtime")


def teacher_kind(model: str, kind: str) -> str:
    """`auto`: the transformers model for the embedded targets (the whole model is a few MB), the
    offload runtime for real ones (a 16B target does not fit whole: 31 GB in bf16)."""
    if kind not in TEACHERS:
        raise ValueError(f"--teacher: {kind!r} is not one of {', '.join(TEACHERS)}")
    return kind if kind != "auto" else "transformers" if registry.get(model).embedded else "runtime"


def check_plan(folder: Path, cfg, kind: str, platform: str, expert_type: str, device: str) -> dict:
    """The distillation's memory plan (`draftexpert.runtime.params.distill_plan`) checked against
    this machine before anything loads; raises WontFit with the numbers."""
    config = json.loads((folder / "config.json").read_text())
    cuda = device == "cuda"
    p = plan(config, platform, cuda, 4, expert_type)
    d = distill_plan(config, p, cfg.intermediate, cfg.seq_len, cfg.batch_size, kind)
    gpu = None
    if cuda:
        gpu = torch.cuda.mem_get_info()[0]
    check_distill_fits(d, available_host_bytes(), gpu)
    return d


def make_teacher(model: str, folder: Path, kind: str, platform: str, expert_type: str, device: str, log):
    """The frozen target both training paths run through: the transformers model (fp32, eager
    experts) or the offload runtime over the platform's store (mn: the GGUF expert file of
    `expert_type`, written once; cg: the host pool)."""
    if kind == "transformers":
        hf, _ = load_target(folder)
        hf = hf.float()
        hf.set_experts_implementation("eager")
        return TransformersTeacher(hf)
    gguf = expert_file_for(model, folder, expert_type, log=log) if platform == "mn" else None
    return RuntimeTeacher(build_model(folder, {"mn": "flash", "cg": "host"}[platform], device=device, gguf_path=gguf))


def state_dir(model: str, folder: Path, cfg, kind: str, platform: str, expert_type: str) -> Path:
    """Where a distillation's resumable state lives: keyed by the configuration *and* the target's
    weights, so that a retrained target never resumes (and silently finishes with) the draft experts
    of the target it replaced."""
    key = hashlib.sha256(
        json.dumps({**asdict(cfg), "target": weights_fingerprint(folder)}, sort_keys=True).encode()
    ).hexdigest()[:8]
    suffix = "" if kind == "transformers" else f"-{platform}-{expert_type}" if platform == "mn" else f"-{platform}"
    return WORK / "distill" / f"{model}-{cfg.preset}-{key}{suffix}"


def distill(
    model: str,
    folder: Path,
    cfg,
    out: Path | None,
    log,
    teacher: str = "auto",
    platform: str = "mn",
    expert_type: str = "q4_0",
    device: str = "cpu",
    data=None,
    held_out: int = EVAL_WINDOWS,
) -> dict:
    """Train, save the paired checkpoint with its history and loss curve. `data`: (train tokens,
    held-out tokens) instead of the corpus's splits in the model's tokenizer; `held_out`: windows
    of the validation split evaluated every `eval_every` steps and at the end."""
    kind = teacher_kind(model, teacher)
    if platform not in ("mn", "cg"):
        raise ValueError(f"--platform: {platform!r} is not one of mn, cg (where the runtime teacher's experts live)")
    plan = check_plan(folder, cfg, kind, platform, expert_type, device)
    train_data, val_data = data or token_splits(folder, log)
    windows = eval_windows(val_data, held_out, cfg.seq_len)
    where = (
        "transformers, whole model"
        if kind == "transformers"
        else f"the offload runtime on {platform}" + (f" ({expert_type} expert file)" if platform == "mn" else "")
    )
    log(
        f"distilling {model}'s draft experts ({cfg.preset}) through {where}; planned "
        f"{plan['distill_host'] / 2**30:.1f} GiB host"
        + (f", {plan['distill_accelerator'] / 2**30:.1f} GiB GPU" if plan["distill_accelerator"] else "")
    )
    t = make_teacher(model, folder, kind, platform, expert_type, device, log)
    t0 = time.perf_counter()
    try:
        draft, history = train(
            t, train_data, windows, cfg, state_dir(model, folder, cfg, kind, platform, expert_type), log=log
        )
    finally:
        if kind == "runtime":
            t.model.experts.close()
    out = out or experts_dir(model, folder) / f"{cfg.preset}.safetensors"
    steps = [h for h in history if "loss" in h]
    teacher_desc = {"kind": kind} | (
        {"platform": platform, "expert_type": expert_type if platform == "mn" else None, "device": device}
        if kind == "runtime"
        else {}
    )
    meta = {
        "preset": cfg.preset,
        "config": asdict(cfg),
        "steps": len(steps),
        "teacher": teacher_desc,
        "tokens": sum(h["tokens"] for h in steps),
        "train_seconds": sum(h["seconds"] for h in steps),
        "command": f"bench distill --model {model} --preset {cfg.preset}"
        + (
            f" --teacher runtime --platform {platform}" + (f" --expert-type {expert_type}" if platform == "mn" else "")
            if kind == "runtime"
            else ""
        ),
    }
    save_draft_experts(out, draft.export(), folder, meta)
    with open(out.with_suffix(".history.jsonl"), "w") as f:
        for h in history:
            f.write(json.dumps(h) + "\n")
    if steps:
        loss_curve(history, out.with_suffix(".loss.png"), f"{model} draft experts, preset {cfg.preset}")
    log(f"wrote {out} ({time.perf_counter() - t0:.0f} s this session)")
    return {"model": model, "out": str(out), **meta}


def loss_curve(history: list[dict], path: Path, title: str) -> None:
    matplotlib.use("Agg")
    terms = [k for k in ("loss", "logit", "tok", "res", "router") if k in history[0]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in terms:
        ax.plot([h["step"] for h in history], [h[k] for h in history], label=k, lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss term")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


def distill_eval(
    model: str,
    folder: Path,
    presets: list[str],
    prompts: list[dict],
    max_new_tokens: int,
    seq_len: int,
    log,
    held_out: int = EVAL_WINDOWS,
    files: dict[str, Path] | None = None,
    teacher: str = "auto",
    platform: str = "mn",
    expert_type: str = "q4_0",
    device: str = "cpu",
) -> dict:
    """Table 5 per preset: KL, token agreement, router agreement on held-out windows; acceptance
    and prefetch hit rate of DraftExpert at K = 4 (no truncation, prefetch on).
    `files`: rows for other checkpoints (row name → file), e.g. an ablation's, after the presets'.
    The target runs as `bench distill`'s does (`teacher_kind`): the whole transformers model for the
    embedded models (decoding on a cold host store), the offload runtime over the platform's store
    for real ones (`platform`, `expert_type`, `device`; its memory plan checked first), which the
    decoder then runs on too."""
    kind = teacher_kind(model, teacher)
    if platform not in ("mn", "cg"):
        raise ValueError(f"--platform: {platform!r} is not one of mn, cg (where the runtime teacher's experts live)")
    moe_inter = json.loads((folder / "config.json").read_text())["moe_intermediate_size"]
    # before anything loads: the transformers teacher holds the whole model in fp32 (refused for a 16B one)
    check_plan(folder, DistillConfig(seq_len=seq_len, batch_size=4, intermediate=moe_inter), kind, platform,
               expert_type, device)  # fmt: skip
    tok = load_tokenizer(folder)
    _, val_data = token_splits(folder, log)
    windows = eval_windows(val_data, held_out, seq_len)
    if kind == "transformers":
        hf, _ = load_target(folder)
        hf = hf.float()
        hf.set_experts_implementation("eager")
        target = TransformersTeacher(hf)
        lean = build_model(folder, "host")
    else:
        target = make_teacher(model, folder, kind, platform, expert_type, device, log)
        lean = target.model
    layers = target.moe_layers
    rows = {}
    files = files or {}
    for preset in [*presets, *(f for f in files if f not in presets)]:
        if preset == "top1":
            experts, meta = DraftExperts.zeros(layers, lean.cfg.hidden, lean.cfg.moe_inter), {"preset": "top1"}
        else:
            path = files.get(preset) or find_draft_experts(model, folder, preset)
            if path is None:
                log(
                    f"{preset}: no checkpoint in {experts_dir(model, folder)}; run `bench distill --model {model} "
                    f"--preset {preset}`"
                )
                continue
            experts, meta = load_draft_experts(path, folder)
        module = DraftExpertModule(layers, lean.cfg.hidden, experts.intermediate, seed=0)
        module.load_experts(experts)
        row = evaluate(target, module, windows)
        dec = SpeculativeDecoder(
            TorchEngine(lean, draftexpert(lean, experts)), SpecConfig(k_max=4, truncate=False, prefetch=True)
        )
        outs = [
            (ids, dec.generate(ids, max_new_tokens, tok.eos_token_id))
            for ids in (render_prompt(tok, p["prompt"]) for p in prompts)
        ]
        spec = metrics.aggregate([o.stats for _, o in outs])
        # exact decoding: every preset emits the target's greedy continuation, so each is read on the same tokens
        row["continuations"] = evaluate_continuations(target, module, [(ids, o.tokens) for ids, o in outs])
        row.update(
            acceptance_k4=spec["acceptance"],
            prefetch_hit_rate=spec["prefetch_hit_rate"],
            steps=meta.get("steps", 0),
            tokens=meta.get("tokens", 0),
            train_seconds=meta.get("train_seconds", 0.0),
        )
        rows[preset] = row
        log(
            f"{preset}: KL {row['kl']:.4f}, token agreement {row['token_agreement']:.3f}, router agreement "
            f"{row['router_agreement']:.3f}, α(K=4) {row['acceptance_k4']:.3f}, prefetch hit "
            f"{row['prefetch_hit_rate']:.3f}"
        )
    lean.experts.close()
    return {
        "model": model,
        "held_out_windows": len(windows) * 4,
        "seq_len": seq_len,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "teacher": {"kind": kind}
        | ({"platform": platform, "expert_type": expert_type, "device": device} if kind == "runtime" else {}),
        "presets": rows,
    }


def table(result: dict) -> str:
    """Table 5, with the paper's KL / acceptance / router agreement / prefetch hit for the real model
    of the same routing (`paper_figs.paper.TABLE5`) beside each row."""
    ref = paper.TABLE5.get(paper.real(result.get("model", "")), {})
    lines = [
        "| preset | KL(target‖draft) | token agreement | router agreement | α at K=4 | prefetch hit | steps "
        "| tokens | train s | paper KL / α / router / hit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, r in result["presets"].items():
        q = ref.get(p)
        lines.append(
            f"| {p} | {r['kl']:.4f} | {r['token_agreement']:.3f} | {r['router_agreement']:.3f} | "
            f"{r['acceptance_k4']:.3f} | {r['prefetch_hit_rate']:.3f} | {r['steps']} | {r['tokens']:,} | "
            f"{r['train_seconds']:.0f} | " + (f"{q[0]:.2f} / {q[1]:.3f} / {q[2]:.2f} / {q[3]:.2f}" if q else "–") + " |"
        )
    return "\n".join(lines)


def margin_table(result: dict) -> str:
    """Where the drafts disagree with the target: per bucket of the target's top-1 margin, the share
    of positions and each preset's token agreement, on held-out text / the target's own greedy
    continuations (the tokens α is measured on)."""
    rows = {p: r for p, r in result["presets"].items() if "by_target_margin" in r and "continuations" in r}
    if not rows:
        return ""
    first = next(iter(rows.values()))
    held, cont = first["by_target_margin"], first["continuations"]["by_target_margin"]
    edges = held["edges"]

    def f(x: float) -> str:
        return "–" if x != x else f"{x:.3f}"  # NaN: no position in the bucket

    lines = [
        f"Where the drafts disagree: the target's top-1 margin p(1st) − p(2nd), mean top-1 probability "
        f"{first['target_top1_prob']:.3f} on held-out text and "
        f"{first['continuations']['target_top1_prob']:.3f} on its own greedy continuations "
        f"({first['continuations']['tokens']} positions); per margin bucket the share of positions and each "
        "preset's token agreement, held-out / continuations.",
        "",
        "| target margin | share | " + " | ".join(rows) + " |",
        "|---|---|" + "---|" * len(rows),
    ]
    for b in range(len(edges) - 1):
        lines.append(
            f"| [{edges[b]:.2f}, {edges[b + 1]:.2f}) | {f(held['share'][b])} / {f(cont['share'][b])} | "
            + " | ".join(
                f"{f(r['by_target_margin']['token_agreement'][b])} / "
                f"{f(r['continuations']['by_target_margin']['token_agreement'][b])}"
                for r in rows.values()
            )
            + " |"
        )
    lines.append(
        "| all | 1 / 1 | "
        + " | ".join(f"{r['token_agreement']:.3f} / {r['continuations']['token_agreement']:.3f}" for r in rows.values())
        + " |"
    )
    return "\n".join(lines)


def report(result: dict) -> str:
    """Table 5 and, where the result carries them, its per-margin agreements: what every view prints."""
    return "\n\n".join(part for part in (table(result), margin_table(result)) if part)


def write_card(model: str, folder: Path, result: dict) -> Path:
    """models/<m>/draft_experts/README.md: what was trained, how, and Table 5 on held-out data."""
    d = experts_dir(model, folder)
    lines = [
        f"# Draft experts for `{model}`",
        "",
        "One resident draft expert per MoE layer (an MLP of the routed experts' form, scaled by a learned γ_l), "
        "self-distilled from the frozen target so that shared + top-1 + draft expert agrees with the full MoE "
        "(Eq. 5–11; `draftexpert/training/distill.py`). Each checkpoint is paired with the target's weights "
        "(sha256 in its metadata) and refused by any other target.",
        "",
        "| preset | loss terms | steps | tokens | train wall s | file |",
        "|---|---|---|---|---|---|",
    ]
    for preset in PRESET_ORDER[1:]:
        p = d / f"{preset}.safetensors"
        if not p.exists():
            continue
        _, meta = load_draft_experts(p, folder)
        lines.append(
            f"| {preset} | {', '.join(PRESETS[preset])} | {meta['steps']} | {meta['tokens']:,} | "
            f"{meta['train_seconds']:.0f} | `{p.name}` |"
        )
    cfg = meta["config"]
    lines += [
        "",
        f"Training: corpus training split (decontaminated against every evaluation prompt), teacher-forced "
        f"windows of {cfg['seq_len']} tokens, batch {cfg['batch_size']}, AdamW lr {cfg['lr']} (warm-up "
        f"{cfg['warmup']}, cosine to 10%), draft-expert width {cfg['intermediate']}, γ "
        f"{'learned' if cfg['learn_gamma'] else 'fixed at 1'}, α = {cfg['alpha']}, β = {cfg['beta']}, "
        f"η = {cfg['eta']}, T = {cfg['temperature']}, {cfg['threads']} thread(s), seed {cfg['seed']}. "
        f"Reproduce: `bench distill --model {model} --preset <preset> --steps {cfg['steps']} --threads "
        f"{cfg['threads']}`.",
        "",
        "## Table 5 (`bench distill-eval --model " + model + " --card`)",
        "",
        f"Held-out: {result['held_out_windows']} validation windows of {result['seq_len']} tokens; α and "
        f"prefetch hit rate from DraftExpert at K = 4 (greedy, no truncation, prefetch on) on "
        f"{result['prompts']} prompts of five suites, {result['max_new_tokens']} new tokens. `top1` is the "
        "untrained (zero) draft expert, i.e. shared + top-1.",
        "",
        report(result),
        "",
    ]
    for preset in PRESET_ORDER[1:]:
        if (d / f"{preset}.loss.png").exists():
            lines += [f"![{preset} loss]({preset}.loss.png)", ""]
    (d / "README.md").write_text("\n".join(lines))
    return d / "README.md"
