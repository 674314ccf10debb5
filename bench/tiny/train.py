"""Resumable pre-training of the tiny MoE targets with load balancing.

transformers' DeepseekV2/V3 losses add no balance term and never update V3's correction bias,
and a MoE trained without balancing collapses onto a few experts. So:
- ds-tiny (V2): DeepSeek-V2's expert-level balance loss, per MoE layer l,
      L_bal,l = α · Σ_i f_i · P_i,  f_i = E / (K·T) · #{t : i ∈ TopK(t)},  P_i = 1/T · Σ_t s_{i,t}
  (E = 64 experts, K = 6, T tokens in the batch, s = softmax router scores); summed over layers.
- ml-tiny (V3): DeepSeek-V3's auxiliary-loss-free balancing: after every step, for each layer,
      b_i ← b_i + u · sign(mean_j c_j − c_i)   (c_i = tokens routed to expert i in the batch)
  plus V3's small sequence-wise balance loss (α = 1e-4, same f·P form computed per sequence).

Everything else: AdamW, linear warm-up then cosine decay to 10%, bf16 autocast over fp32
master weights, grad-norm clip 1.0, fixed seeds; the batch at step s is drawn from
`np.random.default_rng(seed + s)`, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.tiny.configs import TINY_CONFIGS, V3_KEYS_TO_KEEP
from bench.tiny.evaluate import NEAR_TIE


@dataclass
class TrainConfig:
    model: str = "ds-tiny"
    steps: int = 1200
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_alpha: float = 0.01  # V2 expert-level balance loss weight
    seq_balance_alpha: float = 1e-4  # V3 sequence-wise balance loss weight
    bias_update_speed: float = 1e-2  # V3 correction-bias update u (V3 used 1e-3 over 14T tokens; 800 steps need faster)
    seed: int = 1234
    threads: int = 1
    ckpt_every: int = 100
    eval_every: int = 100
    eval_batches: int = 8
    bf16: bool = True
    device: str = "cpu"  # "cuda": the same recipe on an accelerator (bf16 autocast there too)


SHARD = 15 << 20  # bytes: weights in shards a machine that returns files of at most 16 MiB can send back


def save_weights(model, folder: Path) -> None:
    """`save_pretrained` in shards of at most SHARD, after removing the folder's earlier weights (a
    single file left beside a new index would be read as another shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=SHARD)


# fields that change how fast a run goes, not what it computes: a run resumes across them
SPEED_ONLY = ("threads", "device")


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class RouterTap:
    """Forward hooks on every MoE router: keeps (logits [T, E], topk_indices [T, K]) of the last forward."""

    def __init__(self, model):
        self.taps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        logits, _, idx = output
        self.taps.append((logits, idx))

    def pop(self):
        out, self.taps = self.taps, []
        return out


def balance_loss(logits: torch.Tensor, idx: torch.Tensor, n_experts: int, k: int, scoring: str) -> torch.Tensor:
    """Σ_i f_i P_i for one layer (f_i = E/(K·T)·count_i, P_i = mean_t s_{i,t}); logits [T, E]."""
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    if scoring == "sigmoid":  # V3's P uses normalised affinities
        scores = scores / scores.sum(-1, keepdim=True)
    t = logits.shape[0]
    counts = torch.bincount(idx.reshape(-1), minlength=n_experts).to(scores.dtype)
    f = counts * n_experts / (k * t)
    return (f * scores.mean(0)).sum()


def sample_batch(data: np.ndarray, step: int, cfg: TrainConfig) -> torch.Tensor:
    rng = np.random.default_rng(cfg.seed + step)
    starts = rng.integers(0, len(data) - cfg.seq_len - 1, size=cfg.batch_size)
    rows = torch.from_numpy(np.stack([data[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
    return rows.to(cfg.device)


def _same_run(saved: dict, cfg: TrainConfig) -> dict:
    """What differs between a checkpoint's configuration and `cfg`, beyond speed-only fields (a field
    the checkpoint predates counts as its default)."""
    defaults = asdict(TrainConfig())
    return {
        k: (saved.get(k, defaults[k]), v)
        for k, v in asdict(cfg).items()
        if k not in SPEED_ONLY and saved.get(k, defaults[k]) != v
    }


def eval_windows(data: np.ndarray, cfg: TrainConfig) -> list[torch.Tensor]:
    """Fixed, non-overlapping validation windows (the same every evaluation)."""
    n = cfg.eval_batches * cfg.batch_size
    stride = max(cfg.seq_len + 1, (len(data) - cfg.seq_len - 1) // n)
    starts = [i * stride for i in range(n) if i * stride + cfg.seq_len + 1 <= len(data)]
    rows = np.stack([data[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
    return [torch.from_numpy(rows[i : i + cfg.batch_size]).to(cfg.device) for i in range(0, len(rows), cfg.batch_size)]


@torch.no_grad()
def evaluate(model, tap: RouterTap, windows, n_experts: int, bf16: bool) -> dict:
    device = windows[0].device.type
    model.eval()
    tot, n, p1, ties = 0.0, 0, 0.0, 0
    usage = None
    for w in windows:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        tot, n = tot + loss.item(), n + w[:, 1:].numel()
        top2 = logits.float().softmax(-1).topk(2, dim=-1).values  # [B, T, 2]: how sure the model is
        p1 += top2[..., 0].sum().item()
        ties += (top2[..., 0] - top2[..., 1] < NEAR_TIE).sum().item()
        counts = torch.stack([torch.bincount(i.reshape(-1), minlength=n_experts) for _, i in tap.pop()])
        usage = counts if usage is None else usage + counts
    model.train()
    share = usage.double().cpu() / usage.sum(1, keepdim=True).cpu()  # [layers, E]
    entropy = (-(share * share.clamp_min(1e-12).log()).sum(1) / math.log(n_experts)).tolist()
    return {
        "val_loss": tot / n,
        "val_ppl": math.exp(tot / n),
        "val_top1_prob": p1 / n,  # mean top-1 probability on held-out text
        "val_near_ties": ties / n,  # share of positions with p(1st) − p(2nd) < NEAR_TIE (the drafting bound)
        "usage_entropy": entropy,
        "max_share_x_uniform": (share.max(1).values * n_experts).tolist(),
    }


def _truncate_log(log_path: Path, step: int) -> None:
    if not log_path.exists():
        return
    keep = []
    for line in log_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a kill
            continue
        if rec["step"] <= step:
            keep.append(line)
    tmp = log_path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, log_path)


def _last_elapsed(log_path: Path) -> float:
    if not log_path.exists():
        return 0.0
    lines = log_path.read_text().splitlines()
    return json.loads(lines[-1]).get("elapsed_s", 0.0) if lines else 0.0


def _atomic_save(obj, path: Path):
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(cfg: TrainConfig, data_dir: Path, out_dir: Path, log=print, model_config=None) -> Path:
    """Train (or resume) `cfg.model` on `data_dir/{train,val}.bin`; returns the checkpoint folder
    `out_dir/final` in Hugging Face format. Progress: `out_dir/log.jsonl`; state: `out_dir/state.pt`.
    `model_config` replaces the registered shape (tests train a smaller one)."""
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out_dir / "state.pt", out_dir / "log.jsonl"
    train_data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    val_data = np.memmap(data_dir / "val.bin", dtype=np.uint16, mode="r")

    torch.manual_seed(cfg.seed)
    mcfg = model_config if model_config is not None else TINY_CONFIGS[cfg.model]()
    model = AutoModelForCausalLM.from_config(mcfg).to(cfg.device)
    v3 = mcfg.model_type == "deepseek_v3"
    scoring = "sigmoid" if v3 else "softmax"
    n_experts, k = mcfg.n_routed_experts, mcfg.num_experts_per_tok
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    step = 0
    if state_path.exists():
        st = torch.load(state_path, weights_only=False, map_location=cfg.device)
        diff = _same_run(st["config"], cfg)
        if diff:
            raise SystemExit(
                f"{state_path} was made with another configuration {diff}; use a new --out folder or the same flags"
            )
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        _truncate_log(log_path, step)  # records after the checkpoint will be written again
        log(f"resumed {cfg.model} at step {step}")
    tap = RouterTap(model)
    windows = eval_windows(val_data, cfg)
    model.train()
    t_last, tok_since = time.time(), 0
    t_start, elapsed0 = time.time(), _last_elapsed(log_path)
    with open(log_path, "a") as logf:
        while step < cfg.steps:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            batch = sample_batch(train_data, step, cfg)
            with torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = model(input_ids=batch[:, :-1]).logits
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            taps = tap.pop()
            if v3:  # sequence-wise: per sequence, then averaged
                per_seq = [
                    balance_loss(
                        lg.view(cfg.batch_size, cfg.seq_len, -1)[b],
                        ix.view(cfg.batch_size, cfg.seq_len, -1)[b],
                        n_experts,
                        k,
                        scoring,
                    )
                    for lg, ix in taps
                    for b in range(cfg.batch_size)
                ]
                aux = cfg.seq_balance_alpha * torch.stack(per_seq).sum() / cfg.batch_size
            else:
                aux = cfg.balance_alpha * sum(balance_loss(lg, ix, n_experts, k, scoring) for lg, ix in taps)
            loss = ce + aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            if v3:  # aux-loss-free bias update: under-loaded experts up, over-loaded down
                with torch.no_grad():
                    for router, (_, ix) in zip(tap.routers, taps):
                        c = torch.bincount(ix.reshape(-1), minlength=n_experts).float()
                        router.e_score_correction_bias += cfg.bias_update_speed * torch.sign(c.mean() - c)
            step += 1
            tok_since += batch[:, 1:].numel()
            rec = {
                "step": step,
                "loss": loss.item(),
                "ce": ce.item(),
                "aux": float(aux.detach()),
                "lr": lr_at(step - 1, cfg),
                "grad_norm": gnorm.item(),
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                rec.update(evaluate(model, tap, windows, n_experts, cfg.bf16))
            if step % 10 == 0 or "val_loss" in rec:
                now = time.time()
                rec["tokens_per_s"] = tok_since / (now - t_last)
                t_last, tok_since = now, 0
                msg = (
                    f"{cfg.model} step {step}/{cfg.steps} ce {rec['ce']:.3f} aux {rec['aux']:.4f} "
                    f"{rec['tokens_per_s']:.0f} tok/s"
                )
                if "val_loss" in rec:
                    msg += (
                        f" val {rec['val_loss']:.3f} near-ties {rec['val_near_ties']:.3f} "
                        f"ent {min(rec['usage_entropy']):.3f} max {max(rec['max_share_x_uniform']):.2f}x"
                    )
                log(msg)
            rec["tokens_seen"] = step * cfg.batch_size * cfg.seq_len
            rec["elapsed_s"] = elapsed0 + time.time() - t_start  # wall seconds over every session
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                _atomic_save(
                    {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "config": asdict(cfg)},
                    state_path,
                )
    final = out_dir / "final"
    save_weights(model.cpu().to(torch.bfloat16), final)
    AutoTokenizer.from_pretrained(data_dir / "tokenizer").save_pretrained(final)
    if v3:
        cfg_path = final / "config.json"
        conf = json.loads(cfg_path.read_text())
        conf.update(V3_KEYS_TO_KEEP)
        cfg_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    (final / "training_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return final


def install(final: Path, model_dir: Path, train_dir: Path, corpus_dir: Path) -> Path:
    """Copy a finished training run into the embedded-model folder (models/<name>): weights,
    config, tokenizer, training config and log, and the corpus manifest."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for old in model_dir.glob("model*.safetensors*"):  # the weights it replaces, sharded or not
        old.unlink()
    for f in final.iterdir():
        shutil.copy2(f, model_dir / f.name)
    shutil.copy2(train_dir / "log.jsonl", model_dir / "training_log.jsonl")
    shutil.copy2(corpus_dir / "manifest.json", model_dir / "corpus_manifest.json")
    return model_dir


BIAS_BALANCE_STEPS = 200  # ml-tiny: bias-update-only steps after the learning-rate schedule has ended


@torch.no_grad()
def rebalance_bias(
    folder: Path,
    data_dir: Path,
    steps: int = BIAS_BALANCE_STEPS,
    speed: float = 1e-2,
    batch_size: int = 8,
    seq_len: int = 512,
    seed: int = 1234,
    threads: int = 1,
    log=print,
    device: str = "cpu",
) -> dict:
    """DeepSeek-V3's aux-loss-free balancing continued with every weight frozen: for `steps` training
    batches (drawn with seeds seed + 1_000_000 + k, disjoint from the training draws), route them,
    then b_i ← b_i + u·sign(mean load − load_i) in each MoE layer. Only the correction bias changes
    (it picks experts; it never weighs them). Rewrites the folder's weights in place."""
    if device == "cpu":
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval().to(device)
    if model.config.model_type != "deepseek_v3":
        raise ValueError("bias rebalancing applies to sigmoid/noaux_tc (DeepseekV3) routers only")
    tap = RouterTap(model)
    data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    cfg = TrainConfig(batch_size=batch_size, seq_len=seq_len, seed=seed + 1_000_000, device=device)
    n_experts = model.config.n_routed_experts
    for k in range(steps):
        batch = sample_batch(data, k, cfg)
        with torch.autocast(device, dtype=torch.bfloat16):
            model(input_ids=batch[:, :-1])
        loads = []
        for router, (_, ix) in zip(tap.routers, tap.pop()):
            c = torch.bincount(ix.reshape(-1), minlength=n_experts).float()
            router.e_score_correction_bias += speed * torch.sign(c.mean() - c)
            loads.append((c.max() / c.mean()).item())
        if (k + 1) % 50 == 0:
            log(f"bias rebalance {k + 1}/{steps}: max load × mean per layer {[round(x, 2) for x in loads]}")
    model.cpu()
    biases = [r.e_score_correction_bias.clone() for r in tap.routers]
    model.to(torch.bfloat16)
    for r, b in zip(tap.routers, biases):  # the bias keeps fp32: a 0.01 step is below bf16's resolution at 1
        r.e_score_correction_bias = b
    save_weights(model, folder)
    info = {
        "bias_balance_steps": steps,
        "bias_update_speed": speed,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "seed": seed + 1_000_000,
    }
    tc = folder / "training_config.json"
    conf = json.loads(tc.read_text())
    conf["bias_rebalance"] = info
    tc.write_text(json.dumps(conf, indent=2) + "\n")
    return info
