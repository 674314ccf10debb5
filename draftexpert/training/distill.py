"""Self-distilled draft experts (Eq. 6–11): one resident draft expert per MoE layer, trained so that
shared + top-1 + γ·draft expert agrees with the frozen full MoE.

Paths, on the same teacher-forced tokens x [B, T] through the frozen target — the transformers
model (`TransformersTeacher`) or the offload runtime over the user's expert store (`RuntimeTeacher`,
the one a 16B target fits in):
  target path  the unmodified model: h*_l enters MoE layer l, y*_l leaves it, z* are the logits.
  draft path   every MoE layer computes y^d_l = S_l(h^d) + g_{l,e1} E_{l,e1}(h^d) + γ_l E^d_l(h^d)
               (Eq. 5), e1 the router's first choice on h^d; z^d are its logits. The gate weight
               g_{l,e1} is the target's weight for e1 (see `draftexpert.speculation.drafters`).
Losses (each term a mean over tokens, and over MoE layers for the per-layer terms):
  L_res    = ‖γ_l E^d_l(h^d_l) − m*_l‖²,  m*_l = y*_l − S_l(h*_l) − g_{l,e1} E_{l,e1}(h*_l)   (Eq. 6–7)
             the draft expert sees the draft path's state (what it sees when drafting); the
             target is the residual the draft path is missing, measured on the target path.
  L_logit  = T² · KL(softmax(z*/T) ‖ softmax(z^d/T))                                       (Eq. 8)
  L_tok    = CE(argmax z*, softmax(z^d))                                                   (Eq. 9)
  L_router = KL(R_l(h*_l) ‖ R_l(h^d_l)),  R = softmax of the router logits (V2), the sigmoid
             scores normalised to sum 1 (V3)                                                (Eq. 10)
  L = L_logit + α L_tok + β L_res + η L_router                                             (Eq. 11)
Only the draft experts and γ train; the target's parameters have requires_grad False and are
checked unchanged. Teacher activations are computed once per batch under no_grad.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from tqdm.auto import tqdm

from draftexpert.runtime.checkpoint import weights_fingerprint
from draftexpert.runtime.model import ModelConfig, route
from draftexpert.speculation.drafters import DraftExperts

# Table 5's rows, cumulative: which terms each preset switches on (weights α, β, η below).
PRESETS = {
    "top1": (),  # no training: the zero draft expert, i.e. shared + top-1
    "residual": ("res",),
    "logit-token": ("res", "logit", "tok"),
    "full": ("res", "logit", "tok", "router"),
}
PRESETS["router"] = PRESETS["full"]  # Table 5's "+ Router" row is Eq. 11 in full


class DistillError(ValueError):
    """A draft-expert checkpoint that does not belong to this target, or a bad preset."""


CHECKPOINT_SECONDS = 180  # and every `checkpoint_every` steps: a slow step (a 16B target) still saves every few minutes


@dataclass
class DistillConfig:
    preset: str = "full"
    intermediate: int = 128  # I_d of each draft expert (the routed experts' size by default)
    learn_gamma: bool = True  # γ_l learned (initialised at 1) or fixed at 1
    # Weights of Eq. 11 (the paper gives none), chosen by held-out KL / token agreement on ds-tiny: the
    # raw L_res (Σ over hidden of the squared error, ≈ 100–230 there) would otherwise drown L_logit
    # (≈ 0.05) and L_router (≈ 0.002); β = 1e-3 brings it to L_logit's size (docs/RUNTIME.md, the loss weights).
    alpha: float = 0.1  # L_tok weight (L_tok ≈ 1.9: CE to a weak teacher's argmax, kept a nudge)
    beta: float = 1e-3  # L_res weight
    eta: float = 10.0  # L_router weight
    temperature: float = 1.0  # T of L_logit
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 30
    seed: int = 0
    threads: int = 1
    eval_every: int = 100
    checkpoint_every: int = 50

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise DistillError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")


class DraftExpertModule(nn.Module):
    """The trainable part: per MoE layer gate_up [2·I_d, H] (gate rows, then up rows), down [H, I_d]
    and log-free scale γ_l. down starts at 0, so training starts exactly at shared + top-1."""

    def __init__(self, moe_layers: list[int], hidden: int, intermediate: int, learn_gamma: bool = True, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = list(moe_layers)
        self.gate_up = nn.ParameterDict(
            {
                str(i): nn.Parameter(torch.randn(2 * intermediate, hidden, generator=g) * hidden**-0.5)
                for i in moe_layers
            }
        )
        self.down = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(hidden, intermediate)) for i in moe_layers})
        self.gamma = nn.ParameterDict(
            {str(i): nn.Parameter(torch.ones(()), requires_grad=learn_gamma) for i in moe_layers}
        )

    def forward(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """γ_l E^d_l(h): h [N, H] → [N, H]."""
        g, u = F.linear(h, self.gate_up[str(layer)]).chunk(2, dim=-1)
        return self.gamma[str(layer)] * F.linear(F.silu(g) * u, self.down[str(layer)])

    @torch.no_grad()
    def load_experts(self, experts: DraftExperts) -> None:
        for i in self.layers:
            self.gate_up[str(i)].copy_(experts.gate_up[i])
            self.down[str(i)].copy_(experts.down[i])
            self.gamma[str(i)].fill_(experts.gamma[i])

    def export(self) -> DraftExperts:
        return DraftExperts(
            {i: self.gate_up[str(i)].detach().cpu().clone() for i in self.layers},
            {i: self.down[str(i)].detach().cpu().clone() for i in self.layers},
            {i: float(self.gamma[str(i)].detach()) for i in self.layers},
        )


# -- the two paths ------------------------------------------------------------------------------


def moe_layers(hf_model) -> list[tuple[int, nn.Module]]:
    return [(i, layer.mlp) for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate")]


def router_choice(moe: nn.Module, cfg: ModelConfig, h: torch.Tensor):
    """h [N, H] → (router logits [N, E] fp32, target gate weights [N, k], experts [N, k]) through the
    runtime's own `route` (so e1 and g_{l,e1} are the ones the drafter uses when decoding)."""
    logits = F.linear(h.float(), moe.gate.weight.float())
    bias = getattr(moe.gate, "e_score_correction_bias", None)
    w, idx = route(logits, cfg, cfg.top_k, bias)
    return logits, w, idx


def top1_term(moe: nn.Module, h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """g_{l,e1} E_{l,e1}(h) for each token: h [N, H], w / idx [N, k] (best first) → [N, H]."""
    e1, g1 = idx[:, 0], w[:, 0:1].to(h.dtype)
    out = torch.zeros_like(h)
    for e in e1.unique().tolist():
        tok = (e1 == e).nonzero(as_tuple=True)[0]
        gate, up = F.linear(h[tok], moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        out = out.index_add(0, tok, F.linear(F.silu(gate) * up, moe.experts.down_proj[e]) * g1[tok])
    return out


def router_distribution(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """log R_l(h) [N, E]: log-softmax (V2); log of sigmoid scores normalised to 1 (V3)."""
    if not cfg.v3:
        return logits.log_softmax(-1)
    s = logits.sigmoid()
    return (s / s.sum(-1, keepdim=True)).clamp_min(1e-20).log()


@torch.no_grad()
def target_pass(model, cfg: ModelConfig, x: torch.Tensor) -> dict:
    """Teacher activations for x [B, T]: logits z*, and per MoE layer m*_l [B·T, H] and log R_l(h*)."""
    acts: dict[int, dict] = {}

    def hook(i):
        def fn(moe, inputs, output):
            h = inputs[0].reshape(-1, inputs[0].shape[-1])
            logits, w, idx = router_choice(moe, cfg, h)
            m = output.reshape(-1, h.shape[-1]) - moe.shared_experts(h) - top1_term(moe, h, w, idx)
            acts[i] = {"m": m, "log_r": router_distribution(logits, cfg), "topk": idx}

        return fn

    handles = [moe.register_forward_hook(hook(i)) for i, moe in moe_layers(model)]
    try:
        z = model(input_ids=x).logits
    finally:
        for h in handles:
            h.remove()
    return {"logits": z, "layers": acts}


def draft_pass(model, cfg: ModelConfig, draft: DraftExpertModule, x: torch.Tensor) -> dict:
    """The draft path on x [B, T] with gradients into `draft`: logits z^d and, per MoE layer, the
    draft expert's output γE^d(h^d), log R_l(h^d) and the draft router's top-k."""
    acts: dict[int, dict] = {}

    def make_forward(i, moe):
        def forward(hidden):
            shape = hidden.shape
            h = hidden.reshape(-1, shape[-1])
            logits, w, idx = router_choice(moe, cfg, h)
            de = draft(i, h)
            acts[i] = {"de": de, "log_r": router_distribution(logits, cfg), "topk": idx}
            return (moe.shared_experts(h) + top1_term(moe, h, w, idx) + de).reshape(shape)

        return forward

    for i, moe in moe_layers(model):
        moe.forward = make_forward(i, moe)
    try:
        z = model(input_ids=x).logits
    finally:
        for i, moe in moe_layers(model):
            del moe.forward  # the class's forward again
    return {"logits": z, "layers": acts}


# -- teachers: where the two paths run ----------------------------------------------------------


class TransformersTeacher:
    """Both paths through the frozen transformers model — the whole target in memory (the
    embedded models; a 16B checkpoint does not fit: `RuntimeTeacher`)."""

    def __init__(self, hf_model):
        self.model = hf_model.requires_grad_(False).eval()
        self.cfg, self.device = ModelConfig.from_hf(hf_model.config), next(hf_model.parameters()).device
        self.moe_layers = [i for i, _ in moe_layers(hf_model)]

    def target_pass(self, x: torch.Tensor) -> dict:
        return target_pass(self.model, self.cfg, x)

    def draft_pass(self, draft: DraftExpertModule, x: torch.Tensor) -> dict:
        return draft_pass(self.model, self.cfg, draft, x)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class RuntimeTeacher:
    """Both paths through the offload runtime (`MoEModel` over the user's store: the host pool on
    cg, the GGUF expert file on mn) — where the user's inference runs, so a 16B target never sits in
    memory whole: each layer's experts stream through the store as decoding's do. The teacher is
    the store's target (on mn: the Q4_0 experts verification uses). Windows run one after another
    (a fresh KV cache each); per layer the draft path's top-1 term is checkpointed, so its
    backward fetches that layer's experts again instead of autograd keeping every expert the
    pass touched (memory: one layer's experts, not the model's). Ledger phases `distill-target`,
    `distill-draft`, `distill-backward` count the loads."""

    def __init__(self, model):
        self.model, self.cfg, self.device = model, model.cfg, model.embed.device
        self.moe_layers = [i for i in range(self.cfg.layers) if self.cfg.is_moe(i)]
        self._tokens = 0

    def _routed(self, i: int, h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, phase: str):
        """(first-choice term, the other choices' terms) of layer i: Σ_k w_k E_k(h) split at k = 0,
        each unique expert fetched once and run on every token that chose it (h [T, H], w / idx [T, r])."""
        m = self.model
        first, rest = torch.zeros_like(h), torch.zeros_like(h)
        for tok, slot, gu, dn in m.routed_groups(i, idx, phase):
            y = m.mlp(h[tok], gu, dn) * w[tok, slot, None]
            top = slot == 0
            first = first.index_add(0, tok[top], y[top])
            rest = rest.index_add(0, tok[~top], y[~top])
        return first, rest

    class _Cache:
        """A window's KV cache with one tensor per layer: autograd keeps each layer's rows for the
        backward, and writing the next layer must not bump their version (the views of one
        [layers, S, r] tensor, `KVCache`'s, share a version counter)."""

        def __init__(self, model, T: int):
            c, dev, dt = model.cfg, model.embed.device, model.embed.dtype
            self.c_kv = [torch.zeros(T, c.r_kv, device=dev, dtype=dt) for _ in range(c.layers)]
            self.k_pe = [torch.zeros(T, c.d_rope, device=dev, dtype=dt) for _ in range(c.layers)]
            self.positions, self.length, self.max_len = torch.arange(T, device=dev), 0, T

    def _windows(self, x: torch.Tensor, moe, phase: str) -> torch.Tensor:
        """logits [B, T, V] of the runtime's forward over each window of x [B, T], MoE layers by `moe`."""
        m, out = self.model, []
        m.router_logits = {}
        try:
            for ids in x:
                with m.experts.ledger.forward(phase, ids.shape[0]):
                    out.append(m._forward(ids, self._Cache(m, ids.shape[0]), None, phase, moe=moe))
        finally:
            m.router_logits = None
        return torch.stack(out)

    def _gather(self, per_window: list[dict]) -> dict:
        """Per layer, each activation concatenated over windows ([B·T, …], row-major as [B, T])."""
        return {i: {k: torch.cat([w[i][k] for w in per_window]) for k in per_window[0][i]} for i in per_window[0]}

    @torch.no_grad()
    def target_pass(self, x: torch.Tensor) -> dict:
        m, acts = self.model, []

        def moe(x_, h, i, w, idx, path, phase):
            if i == self.moe_layers[0]:
                acts.append({})
            L = m.layers[i]
            first, rest = self._routed(i, h, w, idx, phase)
            acts[-1][i] = {"m": rest, "log_r": router_distribution(m.router_logits[i], self.cfg), "topk": idx}
            return x_ + m.mlp(h, L["shared_gate_up"], L["shared_down"]) + first + rest

        logits = self._windows(x, moe, "distill-target")
        return {"logits": logits, "layers": self._gather(acts)}

    def draft_pass(self, draft: DraftExpertModule, x: torch.Tensor) -> dict:
        m, acts = self.model, []

        def moe(x_, h, i, w, idx, path, phase):
            if i == self.moe_layers[0]:
                acts.append({})
            L = m.layers[i]
            e1 = idx[:, :1]
            with set_checkpoint_early_stop(False):  # the recompute runs to the end: its loads reach the ledger
                top1 = checkpoint(
                    lambda h_, w_: self._routed(i, h_, w_, e1, phase)[0], h, w[:, :1], use_reentrant=False
                )
            de = draft(i, h.float()).to(h.dtype)
            acts[-1][i] = {"de": de, "log_r": router_distribution(m.router_logits[i], self.cfg), "topk": idx}
            return x_ + m.mlp(h, L["shared_gate_up"], L["shared_down"]) + top1 + de

        self._tokens = x.numel()
        logits = self._windows(x, moe, "distill-draft")
        return {"logits": logits, "layers": self._gather(acts)}

    def backward(self, loss: torch.Tensor) -> None:
        with self.model.experts.ledger.forward("distill-backward", self._tokens):
            loss.backward()


def losses(target: dict, draft: dict, terms: tuple[str, ...], temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Each switched-on term of Eq. 6–10 as a scalar (mean over tokens, and MoE layers)."""
    out = {}
    zt, zd = target["logits"].flatten(0, 1).float(), draft["logits"].flatten(0, 1).float()
    if "res" in terms:
        out["res"] = torch.stack(
            [(draft["layers"][i]["de"] - a["m"]).pow(2).sum(-1).mean() for i, a in target["layers"].items()]
        ).mean()
    if "logit" in terms:
        T = temperature
        out["logit"] = (
            T * T * F.kl_div((zd / T).log_softmax(-1), (zt / T).log_softmax(-1), log_target=True, reduction="batchmean")
        )
    if "tok" in terms:
        out["tok"] = F.cross_entropy(zd, zt.argmax(-1))
    if "router" in terms:
        out["router"] = torch.stack(
            [
                F.kl_div(draft["layers"][i]["log_r"], a["log_r"], log_target=True, reduction="batchmean")
                for i, a in target["layers"].items()
            ]
        ).mean()
    return out


def total_loss(parts: dict[str, torch.Tensor], cfg: DistillConfig) -> torch.Tensor:
    """L = L_logit + α L_tok + β L_res + η L_router (Eq. 11), over the preset's terms."""
    w = {"logit": 1.0, "tok": cfg.alpha, "res": cfg.beta, "router": cfg.eta}
    return sum(w[k] * v for k, v in parts.items())


# -- metrics (Table 5) --------------------------------------------------------------------------

# The target's top-1 margin p(1st) − p(2nd) of its next-token distribution, in buckets: a draft
# flips the argmax where the target nearly ties, so agreement is read per bucket (near-ties first).
MARGIN_EDGES = (0.0, 0.05, 0.1, 0.2, 0.4, 1.0)


@torch.no_grad()
def token_counts(zt: torch.Tensor, zd: torch.Tensor) -> dict:
    """zt, zd [N, V] target / draft logits at the same positions: KL sum, argmax agreements, and per
    margin bucket the tokens and agreements; the sum of the target's top-1 probabilities."""
    zt, zd = zt.float(), zd.float()
    kl = F.kl_div(zd.log_softmax(-1), zt.log_softmax(-1), log_target=True, reduction="sum").item()
    ok = zt.argmax(-1) == zd.argmax(-1)
    top = zt.softmax(-1).topk(2, -1).values  # [N, 2]
    bucket = torch.bucketize(top[:, 0] - top[:, 1], torch.tensor(MARGIN_EDGES[1:-1]))
    n_b = torch.bincount(bucket, minlength=len(MARGIN_EDGES) - 1)
    a_b = torch.bincount(bucket[ok], minlength=len(MARGIN_EDGES) - 1)
    return {
        "kl_sum": kl,
        "agree": ok.sum().item(),
        "tokens": zt.shape[0],
        "p1_sum": top[:, 0].sum().item(),
        "margin_tokens": n_b.tolist(),
        "margin_agree": a_b.tolist(),
    }


@torch.no_grad()
def agreement(target: dict, draft: dict, k: int) -> dict:
    """Next-token KL(target ‖ draft), token agreement (argmax equal, also per target-margin bucket),
    router agreement |draft top-k ∩ target top-k| / k (mean over MoE layers and tokens) — sums and counts."""
    out = token_counts(target["logits"].flatten(0, 1), draft["logits"].flatten(0, 1))
    inter, n_route = 0.0, 0
    for i, a in target["layers"].items():
        t, d = a["topk"], draft["layers"][i]["topk"]
        inter += (t[:, :, None] == d[:, None, :]).any(-1).sum().item() / k
        n_route += t.shape[0]
    return {**out, "router_sum": inter, "router_n": n_route}


def add_counts(tot: dict, a: dict) -> dict:
    """tot += a, key by key (lists element by element)."""
    for key, v in a.items():
        tot[key] = (
            [x + y for x, y in zip(tot.get(key, [0] * len(v)), v)] if isinstance(v, list) else tot.get(key, 0) + v
        )
    return tot


def by_margin(tot: dict) -> dict:
    """Per target-margin bucket: the share of tokens there and the draft's agreement there (NaN where empty)."""
    n, a = tot["margin_tokens"], tot["margin_agree"]
    return {
        "edges": list(MARGIN_EDGES),
        "share": [x / tot["tokens"] for x in n],
        "token_agreement": [y / x if x else float("nan") for x, y in zip(n, a)],
    }


# -- checkpoints --------------------------------------------------------------------------------


def save_draft_experts(path: Path, experts: DraftExperts, target_folder: Path, meta: dict) -> None:
    """safetensors with `layers.<l>.{gate_up,down,gamma}` and metadata: the target's fingerprint,
    the preset and how it was trained."""
    tensors = {}
    for i in experts.gate_up:
        tensors[f"layers.{i}.gate_up"] = experts.gate_up[i].float().contiguous()
        tensors[f"layers.{i}.down"] = experts.down[i].float().contiguous()
        tensors[f"layers.{i}.gamma"] = torch.tensor([experts.gamma[i]], dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    save_file(
        tensors,
        str(tmp),
        metadata={"target_sha256": weights_fingerprint(target_folder), "draftexpert": json.dumps(meta)},
    )
    tmp.rename(path)


def load_draft_experts(path: Path, target_folder: Path) -> tuple[DraftExperts, dict]:
    """Draft experts paired with the target in `target_folder`; refuses any other target."""
    path = Path(path)
    if not path.is_file():
        raise DistillError(
            f"no draft-expert checkpoint at {path}: train one with "
            f"`bench distill --model <model> --preset full` or pass --draft-experts <file>"
        )
    try:
        f = safe_open(str(path), "pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad header
        raise DistillError(
            f"--draft-experts {path} is not a readable safetensors file ({str(e)[:120]}); "
            "pass a checkpoint written by `bench distill`"
        ) from None
    with f:
        meta = f.metadata() or {}
        names = list(f.keys())
        if "target_sha256" not in meta or not names or not all(n.startswith("layers.") for n in names):
            looks = " (it holds model weights)" if any(n.startswith("model.") for n in names) else ""
            raise DistillError(
                f"--draft-experts {path} is not a draft-expert checkpoint{looks}: it carries no "
                "`target_sha256` pairing; pass a file written by `bench distill`"
            )
        want = meta["target_sha256"]
        have = weights_fingerprint(target_folder)
        if want != have:
            raise DistillError(
                f"{path} was distilled from a different target (its weights hash "
                f"{str(want)[:12]}…, the model in {target_folder} hashes {have[:12]}…): draft "
                "experts only fit the exact target they were trained against"
            )
        layers = sorted({int(k.split(".")[1]) for k in names})
        de = DraftExperts(
            {i: f.get_tensor(f"layers.{i}.gate_up") for i in layers},
            {i: f.get_tensor(f"layers.{i}.down") for i in layers},
            {i: float(f.get_tensor(f"layers.{i}.gamma")[0]) for i in layers},
        )
    return de, json.loads(meta.get("draftexpert", "{}"))


# -- training -----------------------------------------------------------------------------------


def sample_batch(data, step: int, cfg: DistillConfig) -> torch.Tensor:
    """B windows of T tokens at positions drawn from a generator seeded by (seed, step): a resumed
    run sees the same batches."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(data) - cfg.seq_len, size=cfg.batch_size)
    return torch.from_numpy(np.stack([data[s : s + cfg.seq_len] for s in starts]).astype(np.int64))


def eval_windows(data, n: int, seq_len: int) -> list[torch.Tensor]:
    """n windows spread evenly over a held-out split, in batches of 4."""
    stride = max(seq_len, (len(data) - seq_len) // n)
    rows = [
        np.asarray(data[i * stride : i * stride + seq_len], dtype=np.int64)
        for i in range(n)
        if i * stride + seq_len <= len(data)
    ]
    return [torch.from_numpy(np.stack(rows[i : i + 4])) for i in range(0, len(rows), 4)]


@torch.no_grad()
def evaluate(teacher, draft: DraftExpertModule, windows: list[torch.Tensor]) -> dict:
    """Table 5's platform-independent metrics on held-out windows (teacher-forced):
    kl                = mean over tokens of KL(target ‖ draft) of the next-token distributions
    token_agreement   = fraction of tokens with draft argmax = target argmax
    router_agreement  = mean over MoE layers and tokens of |draft top-k ∩ target top-k| / k
    by_target_margin  = share of tokens and token agreement per bucket of the target's top-1 margin"""
    tot: dict = {}
    for x in windows:
        add_counts(tot, agreement(teacher.target_pass(x), teacher.draft_pass(draft, x), teacher.cfg.top_k))
    return {
        "kl": tot["kl_sum"] / tot["tokens"],
        "token_agreement": tot["agree"] / tot["tokens"],
        "router_agreement": tot["router_sum"] / tot["router_n"],
        "tokens": tot["tokens"],
        "target_top1_prob": tot["p1_sum"] / tot["tokens"],
        "by_target_margin": by_margin(tot),
    }


@torch.no_grad()
def evaluate_continuations(teacher, draft: DraftExpertModule, sequences: list[tuple[list[int], list[int]]]) -> dict:
    """Token agreement on the target's own greedy continuations (prompt ids, emitted ids): where α is
    measured. Each is teacher-forced whole; the positions that predict the emitted tokens count."""
    tot: dict = {}
    for prompt, emitted in sequences:
        x = torch.tensor([prompt + emitted[:-1]])
        at = slice(len(prompt) - 1, len(prompt) - 1 + len(emitted))
        zt, zd = teacher.target_pass(x)["logits"][0, at], teacher.draft_pass(draft, x)["logits"][0, at]
        add_counts(tot, token_counts(zt, zd))
    return {
        "kl": tot["kl_sum"] / tot["tokens"],
        "token_agreement": tot["agree"] / tot["tokens"],
        "tokens": tot["tokens"],
        "target_top1_prob": tot["p1_sum"] / tot["tokens"],
        "by_target_margin": by_margin(tot),
    }


def lr_at(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(
    teacher,
    train_data,
    val_windows: list[torch.Tensor],
    cfg: DistillConfig,
    state_dir: Path,
    log=print,
    progress: bool = True,
) -> tuple[DraftExpertModule, list[dict]]:
    """Distil draft experts against a frozen target (`TransformersTeacher` or `RuntimeTeacher`;
    resumable from `state_dir`).
    Returns the module and the history: one record per step (each loss term, lr, seconds) and an
    evaluation record every `eval_every` steps."""
    torch.set_num_threads(cfg.threads)
    draft = DraftExpertModule(teacher.moe_layers, teacher.cfg.hidden, cfg.intermediate, cfg.learn_gamma, cfg.seed).to(
        teacher.device
    )  # trained where the model computes
    terms = PRESETS[cfg.preset]
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    state_path, start, history = Path(state_dir) / "state.pt", 0, []
    if state_path.exists():
        st = torch.load(state_path, weights_only=False, map_location=teacher.device)
        if st["config"] != asdict(cfg):
            raise DistillError(
                f"{state_path} holds a run with another configuration ({st['config']}); "
                "delete it or pass the same options to resume"
            )
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        start, history = st["step"], st["history"]
        log(f"resuming {cfg.preset} at step {start}")
    steps = cfg.steps if terms else 0
    bar = None
    if progress:
        bar = tqdm(total=steps, initial=start, desc=f"distill {cfg.preset}", unit="step")
    t_run = t_saved = time.perf_counter()
    for step in range(start, steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = sample_batch(train_data, step, cfg)
        parts = losses(teacher.target_pass(x), teacher.draft_pass(draft, x), terms, cfg.temperature)
        loss = total_loss(parts, cfg)
        opt.zero_grad(set_to_none=True)
        teacher.backward(loss)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        rec = {
            "step": step + 1,
            "loss": loss.item(),
            **{k: v.item() for k, v in parts.items()},
            "lr": opt.param_groups[0]["lr"],
            "seconds": time.perf_counter() - t0,
            "tokens": x.numel(),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
            rec["eval"] = evaluate(teacher, draft, val_windows)
            log(
                f"step {step + 1}: loss {rec['loss']:.4f} "
                + " ".join(f"{k} {rec[k]:.4f}" for k in parts)
                + f" | held-out KL {rec['eval']['kl']:.4f}, token agreement {rec['eval']['token_agreement']:.3f}, "
                f"router agreement {rec['eval']['router_agreement']:.3f}"
            )
        history.append(rec)
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}")
        due = (step + 1) % cfg.checkpoint_every == 0 or time.perf_counter() - t_saved > CHECKPOINT_SECONDS
        if due or step + 1 == steps:
            t_saved = time.perf_counter()
            state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_path.with_suffix(".part")
            torch.save(
                {
                    "config": asdict(cfg),
                    "draft": draft.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step + 1,
                    "history": history,
                },
                tmp,
            )
            tmp.rename(state_path)
    if bar:
        bar.close()
    log(f"{cfg.preset}: {steps - start} steps in {time.perf_counter() - t_run:.0f} s this session")
    return draft, history
