"""A lean, decode-oriented forward for DeepseekV2 / DeepseekV3 checkpoints (batch 1).

Shapes: T = tokens in this forward (1 when decoding, the block length when verifying, the
prompt length when prefilling), H = hidden, n_h heads, r_kv = kv_lora_rank, d_n / d_r / d_v =
qk_nope / qk_rope / v head dims, E routed experts, I = moe_intermediate_size.

- **Absorbed MLA** (DeepSeek's inference form): the cache holds the compressed latent
  c_kv [L, r_kv] and the shared rope key k_pe [L, d_r]; kv_b_proj is folded into the query
  (q_nope · W_uk → [T, n_h, r_kv]) and the output (· W_uvᵀ), so nothing is re-expanded per step.
- **KV cache** preallocated to `max_len`, cropped back by setting its length (speculation).
- **One routing rule** (`router_scores` → `route`) for every path, every engine and any r: V2
  softmax / greedy top-r, times the scaling factor, no renormalisation; V3 sigmoid scores +
  correction bias choose (group-limited), the un-biased scores weigh, normalised over the chosen
  r when `norm_topk_prob`, times the scale. `router_logits` taps its input (eager forwards).
- **One layer** (`pre_ffn` = attention + norms + routing, `mix` / `moe`, `head`) that the eager
  forward runs and `compile_decode` compiles into one graph per step (offloaded experts through
  the op `draftexpert::routed_experts`, outside the graph): attention always writes rows `pos` of the
  preallocated cache and masks keys past each row's position, so the same code serves a
  variable-length eager forward and the static-shape compiled step.
- **Routed experts come from an `ExpertStore`** (`draftexpert.runtime.experts`): the model never knows
  where they live; the store's ledger sees every request and load. Only
  the unique experts a forward needs are asked for, and each runs once on all its tokens
  (a loop over unique experts, never over tokens). Shared experts are resident.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from draftexpert.runtime.experts import ExpertStore, ResidentStore
from draftexpert.runtime.ggml_kernel import KernelError, expert_mlp, q4_0_linear, quantize_q4_0


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    hidden: int
    layers: int
    first_dense: int
    heads: int
    d_nope: int
    d_rope: int
    d_v: int
    r_q: int | None
    r_kv: int
    n_experts: int
    n_shared: int
    top_k: int
    moe_inter: int
    v3: bool  # sigmoid + correction bias (noaux_tc); else softmax (greedy)
    norm_topk: bool
    scale: float  # routed_scaling_factor
    n_group: int
    topk_group: int
    eps: float
    max_positions: int = 2048  # max_position_embeddings: the context

    @classmethod
    def from_hf(cls, c) -> ModelConfig:
        v3 = c.model_type == "deepseek_v3"
        if not v3 and getattr(c, "topk_method", "greedy") != "greedy":
            raise ValueError(f"routing {c.topk_method!r} is not supported (DeepSeek-V2-Lite uses 'greedy')")
        return cls(
            vocab=c.vocab_size,
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            first_dense=c.first_k_dense_replace,
            heads=c.num_attention_heads,
            d_nope=c.qk_nope_head_dim,
            d_rope=c.qk_rope_head_dim,
            d_v=c.v_head_dim,
            r_q=c.q_lora_rank,
            r_kv=c.kv_lora_rank,
            n_experts=c.n_routed_experts,
            n_shared=c.n_shared_experts,
            top_k=c.num_experts_per_tok,
            moe_inter=c.moe_intermediate_size,
            v3=v3,
            norm_topk=bool(getattr(c, "norm_topk_prob", False)) and v3,
            scale=float(c.routed_scaling_factor),
            n_group=c.n_group or 1,
            topk_group=c.topk_group or 1,
            eps=c.rms_norm_eps,
            max_positions=c.max_position_embeddings,
        )

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense


def router_scores(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None):
    """Router logits [T, E] (fp32) → (s, choice) [T, E]: the top-k of `choice` are the experts a
    token runs, `s` weighs them. The one selection rule: the runtime, the llama.cpp engine's
    predicted verifier experts and the engines' cross-check all choose through it.
    V2 (softmax, greedy): s = choice = softmax(logits).
    V3 (sigmoid, noaux_tc): s = sigmoid(logits); choice = s + bias, zeroed outside the best
    `topk_group` of `n_group` groups (group score = sum of its top-2)."""
    if not cfg.v3:
        s = logits.softmax(-1)
        return s, s
    s = logits.sigmoid()
    choice = s + bias if bias is not None else s
    if cfg.n_group > 1:
        g = choice.view(-1, cfg.n_group, cfg.n_experts // cfg.n_group)
        best = g.topk(2, dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1)[1]
        mask = torch.zeros_like(g[..., 0]).scatter_(1, best, 1.0).bool()
        choice = g.masked_fill(~mask[..., None], 0.0).view_as(choice)
    return s, choice


def route(logits: torch.Tensor, cfg: ModelConfig, r: int, bias: torch.Tensor | None = None):
    """Router logits [T, E] (fp32) → (weights [T, r], experts [T, r]), best first: the top-r of
    `router_scores`' choice; w = s[experts] (V3: normalised over the r chosen when
    norm_topk_prob) · routed_scaling_factor."""
    s, choice = router_scores(logits, cfg, bias)
    if not cfg.v3:
        w, idx = torch.topk(s, r, dim=-1)
        return w * cfg.scale, idx
    idx = torch.topk(choice, r, dim=-1)[1]
    w = s.gather(-1, idx)
    if cfg.norm_topk:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.scale, idx


class KVCache:
    """Compressed MLA cache: per layer c_kv [max_len, r_kv] and k_pe [max_len, d_r]."""

    def __init__(self, cfg: ModelConfig, max_len: int, device=None, dtype=torch.float32):
        self.c_kv = torch.zeros(cfg.layers, max_len, cfg.r_kv, device=device, dtype=dtype)
        self.k_pe = torch.zeros(cfg.layers, max_len, cfg.d_rope, device=device, dtype=dtype)
        self.length = 0
        self.max_len = max_len
        self.positions = torch.arange(max_len, device=device)  # key positions: the attention mask's columns

    @classmethod
    def for_model(cls, model: MoEModel, max_len: int) -> KVCache:
        """A cache on the model's device, in its dtype; for a compiled model its length is rounded
        up to a multiple of 256, so that the compiled step sees few distinct shapes."""
        if model._compiled is not None:
            max_len = -(-max_len // 256) * 256
        return cls(model.cfg, max_len, device=model.embed.device, dtype=model.embed.dtype)

    def crop(self, length: int) -> None:
        """Forget every position ≥ length (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] → [T, out]: `F.linear`, or ggml's kernel for a matrix held as Q4_0 blocks (uint8)."""
    return q4_0_linear(x, w) if w.dtype == torch.uint8 else F.linear(x, w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle θ_i; x [..., T, (n,) d_r], cos/sin [T, d_r/2].
    The output keeps the pairs' halves apart ([x', x'']) — the same layout for q and k, so
    q·k is that of transformers' V2 (complex pairs) and V3 (interleave) formulations."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MoEModel:
    """Lean forward over the weights of a DeepseekV2/V3 checkpoint.

    `forward(ids [T], cache, path=None)` appends T positions to `cache` and returns logits [T, V].
    `path=None` is the frozen target (top_k routed experts per token); a `DraftPath`
    (`draftexpert.speculation.drafters`) is a cheaper configuration of the same weights: its top-r routed
    experts and, for DraftExpert, a widened shared expert that carries the draft expert.
    Router taps: after each forward, `self.last_routing` holds the router's top_k experts
    [T, top_k] of every MoE layer (layer → tensor) — on a draft path, the predicted verifier
    experts (Eq. 12) — and `self.last_fetched` the (layer, experts) the forward actually ran."""

    def __init__(self, hf_config, weights: dict[str, torch.Tensor], experts: ExpertStore):
        # transformers' DeepSeek-V2 modelling costs ~1.7 s to import on top of its config classes; only building
        # the torch model needs it, and the llama.cpp engine imports this module (route) without building one
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale  # noqa: PLC0415

        self.cfg = c = ModelConfig.from_hf(hf_config)
        self.experts = experts
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        rope_type = hf_config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base, dim = hf_config.rope_parameters["rope_theta"], c.d_rope
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.rope_scale = 1.0
        else:
            self.inv_freq, self.rope_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        self.softmax_scale = yarn_apply_mscale(hf_config.rope_parameters, (c.d_nope + c.d_rope) ** -0.5)
        self.layers = []
        for i in range(c.layers):
            p = f"model.layers.{i}."
            kv_b = w[p + "self_attn.kv_b_proj.weight"].view(c.heads, c.d_nope + c.d_v, c.r_kv)
            lay = {
                "ln1": w[p + "input_layernorm.weight"],
                "ln2": w[p + "post_attention_layernorm.weight"],
                "kv_a": w[p + "self_attn.kv_a_proj_with_mqa.weight"],
                "kv_ln": w[p + "self_attn.kv_a_layernorm.weight"],
                "w_uk": kv_b[:, : c.d_nope].contiguous(),  # [n_h, d_n, r_kv]
                "w_uv_t": kv_b[:, c.d_nope :].transpose(1, 2).contiguous(),  # [n_h, r_kv, d_v]
                "o": w[p + "self_attn.o_proj.weight"],
            }
            if c.r_q:
                lay.update(
                    q_a=w[p + "self_attn.q_a_proj.weight"],
                    q_ln=w[p + "self_attn.q_a_layernorm.weight"],
                    q_b=w[p + "self_attn.q_b_proj.weight"],
                )
            else:
                lay["q"] = w[p + "self_attn.q_proj.weight"]
            if c.is_moe(i):
                gate = w[p + "mlp.gate.weight"]  # the router runs in fp32 at least (as transformers')
                lay["gate"] = gate.to(torch.promote_types(gate.dtype, torch.float32))
                lay["bias"] = w.get(p + "mlp.gate.e_score_correction_bias")
                sh = [w[p + f"mlp.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")]
                lay["shared_gate_up"] = torch.cat(sh[:2], 0)  # [2·n_s·I, H]
                lay["shared_down"] = sh[2]
            else:
                d = [w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
                lay["dense_gate_up"] = torch.cat(d[:2], 0)
                lay["dense_down"] = d[2]
            self.layers.append(lay)
        self.last_routing: dict[int, torch.Tensor] = {}
        self.last_fetched: dict[int, list[int]] = {}
        self.router_logits: dict[int, torch.Tensor] | None = None  # set to {} to tap router logits [T, E] (eager)
        self._compiled = None  # the compiled one-token step (compile_decode())
        self._indexed = False  # whether it indexes resident experts in the graph (else: the store, in the op)
        self._warm: set[tuple[int, int]] = set()  # (cache rows, id of the draft path) compiled so far
        self._cos = self._sin = torch.empty(0, c.d_rope // 2)  # rope tables, grown on demand

    def rope_tables(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d_r/2] for positions start … start+T−1 (cached; attention_scaling applied)."""
        if start + T > self._cos.shape[0]:
            n = max(start + T, 2 * self._cos.shape[0], 256)
            ang = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None]
            dev, dt = self.embed.device, self.embed.dtype
            self._cos, self._sin = (ang.cos() * self.rope_scale).to(dev, dt), (ang.sin() * self.rope_scale).to(dev, dt)
        return self._cos[start : start + T], self._sin[start : start + T]

    # -- one layer: attention, then the dense MLP or the MoE --------------------------------
    # The eager forward and the compiled one-token step run these same functions; compiling
    # wraps them (gpt-fast), it does not copy them.

    def attention(
        self,
        L: dict,
        x: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor,
        cos,
        sin,
        masked: bool = True,
    ) -> torch.Tensor:
        """x [T, H] (normed) → [T, H]. Writes rows `pos` [T] of the layer's cache (c_kv [S_max, r_kv],
        k_pe [S_max, d_r]) and attends causally to its rows `keys` [S] = 0 … S−1: eager, the cache's
        live length (`masked` False for one token: it sees every key); the compiled step, the whole
        preallocated cache (static shapes, the rows past the current position masked)."""
        c = self.cfg
        T = x.shape[0]
        q = F.linear(rms_norm(F.linear(x, L["q_a"]), L["q_ln"], c.eps), L["q_b"]) if c.r_q else F.linear(x, L["q"])
        q = q.view(T, c.heads, c.d_nope + c.d_rope)
        q_nope, q_pe = q[..., : c.d_nope], rope(q[..., c.d_nope :], cos[:, None], sin[:, None])
        kv = F.linear(x, L["kv_a"])  # [T, r_kv + d_r]
        c_kv.index_copy_(0, pos, rms_norm(kv[:, : c.r_kv], L["kv_ln"], c.eps))
        k_pe.index_copy_(0, pos, rope(kv[:, c.r_kv :], cos, sin))
        ckv, kpe = c_kv[: keys.shape[0]], k_pe[: keys.shape[0]]  # [S, r_kv], [S, d_r]
        q_c = torch.bmm(q_nope.transpose(0, 1), L["w_uk"])  # absorbed: [n_h, T, d_n] @ [n_h, d_n, r_kv]
        scores = (q_c @ ckv.T + (q_pe.transpose(0, 1) @ kpe.T)) * self.softmax_scale  # [n_h, T, S]
        if masked:
            scores = scores.masked_fill(keys > pos[:, None], float("-inf"))  # a row sees keys up to its own position
        out_c = scores.softmax(-1) @ ckv  # [n_h, T, r_kv]
        out = torch.bmm(out_c, L["w_uv_t"]).transpose(0, 1).reshape(T, c.heads * c.d_v)  # [n_h, T, d_v] → [T, n_h·d_v]
        return F.linear(out, L["o"])

    def pre_ffn(self, L: dict, x: torch.Tensor, c_kv, k_pe, pos, keys, cos, sin, masked: bool = True):
        """x [T, H] → (x + attention, h = its post-attention norm, and on MoE layers the router's
        logits [T, E] with (w, idx) [T, top_k] best first; None on dense layers)."""
        c = self.cfg
        x = x + self.attention(L, rms_norm(x, L["ln1"], c.eps), c_kv, k_pe, pos, keys, cos, sin, masked)
        h = rms_norm(x, L["ln2"], c.eps)
        if "gate" not in L:
            return x, h, None, None, None
        logits = F.linear(h.to(L["gate"].dtype), L["gate"])  # the router runs in fp32 at least
        w, idx = route(logits, c, c.top_k, L["bias"])
        return x, h, logits, w.to(x.dtype), idx

    @staticmethod
    def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.uint8:  # an expert kept as its Q4_0 blocks (`--expert-kernel ggml`)
            return expert_mlp(x, gate_up, down)
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    def mix(self, x, h, gate_up, down, weights, experts) -> torch.Tensor:
        """One token's FFN: x + MLP(h) + Σ_k w_k · expert_k(h) (x, h [1, H]; weights [r]; `experts`
        the (gate_up, down) pairs as the store hands them over, no gather — eager, an iterator
        that yields each as it lands, so expert k computes while k+1 still loads)."""
        out = self.mlp(h, gate_up, down)
        for k, (expert_gate_up, expert_down) in enumerate(experts):
            out = torch.addcmul(out, weights[k], self.mlp(h, expert_gate_up, expert_down))  # out + w_k · e_k(h)
        return x + out

    @staticmethod
    def routed_indexed(h, w, idx, gate_up, down) -> torch.Tensor:
        """Σ_k w_k · expert_k(h) with every expert resident (gate_up [E, 2I, H], down [E, H, I]): the
        chosen rows indexed inside the kernels as reductions — no gathered copy (the fused step)."""
        g, u = (gate_up[idx] * h).sum(-1).chunk(2, dim=-1)  # [r, I] each
        y = (down[idx] * (F.silu(g) * u)[:, None, :]).sum(-1)  # [r, H]
        return (w[:, None] * y).sum(0, keepdim=True)

    def moe_experts(self, i: int, w: torch.Tensor, idx: torch.Tensor, path):
        """(shared MLP, the first r of each token's top-k with the target's gate weights (Eq. 4; a
        drafter keeps the target's weights for the experts it runs, so its e1 term is the target's
        e1 term exactly)) for layer i; sets the routing tap."""
        L = self.layers[i]
        self.last_routing[i] = idx
        shared = (L["shared_gate_up"], L["shared_down"]) if path is None else path.shared_for(i, L)
        r = self.cfg.top_k if path is None else path.r
        return shared, w[:, :r], idx[:, :r]

    def moe(self, x: torch.Tensor, h: torch.Tensor, i: int, w, idx, path, phase: str) -> torch.Tensor:
        """x + the MoE of h [T, H]: a loop over the unique experts the tokens chose (never over
        tokens), each fetched from the store once and run on all its tokens as soon as it lands."""
        (gate_up, down), w, idx = self.moe_experts(i, w, idx, path)
        if h.shape[0] == 1:  # decoding: r distinct experts, no gather / scatter needed
            chosen = idx[0].tolist()
            self.last_fetched[i] = chosen
            return self.mix(x, h, gate_up, down, w[0], self.experts.fetch_iter(i, chosen, phase))
        out = self.mlp(h, gate_up, down)
        for tok, slot, gu, dn in self.routed_groups(i, idx, phase):  # each computes as it lands
            out.index_add_(0, tok, self.mlp(h[tok], gu, dn) * w[tok, slot, None])
        return x + out

    def routed_groups(self, i: int, idx: torch.Tensor, phase: str):
        """For each unique expert that the tokens chose at layer i (idx [T, r]), fetched once, as it
        lands: (tok, slot, gate_up, down) — the tokens that chose it and in which of their r slots."""
        r = idx.shape[1]
        flat = idx.flatten()  # [T·r], row-major: (token, slot)
        order = torch.argsort(flat, stable=True)  # grouped by expert, (token, slot) ascending within each
        unique, counts = torch.unique(flat, return_counts=True)
        unique, counts = torch.stack([unique, counts]).tolist()  # the layer's one host sync: what to fetch
        self.last_fetched[i] = unique
        start = 0
        for j, (gu, dn) in enumerate(self.experts.fetch_iter(i, unique, phase)):
            rows = order[start : start + counts[j]]
            start += counts[j]
            yield rows // r, rows % r, gu, dn

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.norm, self.cfg.eps), self.lm_head)

    def quantize_head(self) -> MoEModel:
        """`--head-type q4_0`: the MLPs outside the routed experts (shared experts, dense layers) and
        the LM head held as Q4_0 blocks and computed by ggml's kernels (`mlp`, `linear`): the bytes
        llama.cpp's Q4_0 head holds for them (`llama_gguf`), 11 of ds-tiny's 16 MB of fp32 weights
        read per token down to 1.6. Attention stays as loaded (its small matrices cost ggml's call
        overhead what they save in bytes: measured no faster), as do norms, router and embedding.
        Batch-invariant like the routed experts' kernel, so speculation stays exact; a different
        model from the checkpoint's (its tokens are this model's, not transformers'). CPU only; not
        with --compile."""
        if self.embed.device.type != "cpu":
            raise KernelError(f"--head-type q4_0 computes on the CPU (ggml's kernels), not {self.embed.device}")
        if self._compiled is not None:
            raise KernelError("--head-type q4_0 runs ggml's kernels outside a compiled graph: not with --compile")
        for L in self.layers:
            for name in ("shared_gate_up", "shared_down", "dense_gate_up", "dense_down"):
                if name in L:
                    L[name] = quantize_q4_0(L[name])
        self.lm_head = quantize_q4_0(self.lm_head)
        return self

    def widen_shared(self, i: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        """Layer i's shared MLP with extra rows appended (gate, up [I_d, H]; down [H, I_d]), in the
        layer's own storage: (gate_up [2·(I_s+I_d), H], down [H, I_s+I_d]). A Q4_0 head holds blocks
        of 32 along rows, so the extra rows are zero-padded to whole blocks (adds 0) and joined as bytes."""
        L = self.layers[i]
        dev, dt = L["shared_gate_up"].device, L["shared_gate_up"].dtype
        if dt == torch.uint8:
            pad = -down.shape[1] % 32
            gate, up = (quantize_q4_0(F.pad(t, (0, 0, 0, pad))) for t in (gate, up))
            down = quantize_q4_0(F.pad(down, (0, pad)))
        s_gate, s_up = L["shared_gate_up"].chunk(2, dim=0)
        gate_up = torch.cat([s_gate, gate.to(dev, dt), s_up, up.to(dev, dt)], dim=0)
        return gate_up, torch.cat([L["shared_down"], down.to(dev, dt)], dim=1)

    # -- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, phase: str = "ar", path=None) -> torch.Tensor:
        """ids [T] → logits [T, V]; appends T positions to the cache. `path`: None for the
        target, else a `DraftPath`."""
        T = ids.shape[0]
        if cache.length + T > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {T} > {cache.max_len}")
        with self.experts.ledger.forward(phase, T):
            if T == 1 and self._compiled is not None:
                logits = self._decode_compiled(ids, cache, path)
            else:
                logits = self._forward(ids, cache, path, phase)
            self.experts.end_forward()
        cache.length += T
        return logits

    def _forward(self, ids, cache, path, phase, moe=None):
        """The eager forward; `moe` replaces `self.moe` (same signature) — the distillation
        teacher's taps (`draftexpert.training.distill.RuntimeTeacher`)."""
        moe = moe or self.moe
        T, start = ids.shape[0], cache.length
        cos, sin = self.rope_tables(start, T)  # [T, d_r/2]
        pos, keys = cache.positions[start : start + T], cache.positions[: start + T]
        x = self.embed[ids.to(self.embed.device)]
        layers = enumerate(self.layers)
        if phase == "prefill":  # a long prefill of a large model: a bar on a terminal once it passes 2 s
            layers = tqdm(
                layers,
                total=len(self.layers),
                desc=f"prefill {T} tokens",
                unit="layer",
                delay=2,
                leave=False,
                disable=None,
            )
        for i, L in layers:
            x, h, logits, w, idx = self.pre_ffn(L, x, cache.c_kv[i], cache.k_pe[i], pos, keys, cos, sin, T > 1)
            if idx is None:
                x = x + self.mlp(h, L["dense_gate_up"], L["dense_down"])
                continue
            if self.router_logits is not None:
                self.router_logits[i] = logits
            x = moe(x, h, i, w, idx, path, phase)
        return self.head(x)

    # -- compiled one-token step ------------------------------------------------------------

    def compile_decode(self) -> MoEModel:
        """Compile the one-token step with `torch.compile` (static shapes): one graph per step, the
        same `pre_ffn`, `mlp` and `head` as the eager forward, attending over the whole preallocated
        cache. The routed experts: resident, indexed inside the kernels (`routed_indexed`);
        offloaded, through the store in the op `draftexpert::routed_experts` (`routed_experts`),
        which the graph calls as an opaque function — its loads, prefetch hits, ledger and expert
        kernel (the ggml one included) are the eager path's. One graph instead of two per layer
        around the store (the first version): dynamo's guards and the graph boundaries cost more
        than the fusion gained there (ds-tiny flash, 1 thread: ~0.2 ms/token gained split, ~0.8
        one graph). Multi-token forwards (prefill, verify) stay eager. Costs ~20 s of compilation
        the first time each shape is seen (then cached by inductor on disk)."""
        if self.lm_head.dtype == torch.uint8:
            raise KernelError("--compile traces torch ops; a --head-type q4_0 model runs ggml's kernels: not both")
        store = self.experts
        # resident fp experts are indexed in the graph; offloaded ones, and Q4_0 blocks for the ggml
        # kernel (`--expert-kernel ggml`), go through the store in the op
        self._indexed = isinstance(store, ResidentStore) and all(
            t.dtype.is_floating_point for t in store.gate_up.values()
        )
        offloaded, handle = not self._indexed, _MODELS.add(self)

        def step(tok, layers, shared, r, gate_ups, downs, c_kvs, k_pes, pos, keys, cos, sin):
            """The whole one-token step: x [1, H] through every layer, logits [1, V] and the routing."""
            x = self.embed[tok]  # [1, H]
            routing = []
            for i, L in enumerate(layers):
                x, h, _, w, idx = self.pre_ffn(L, x, c_kvs[i], k_pes[i], pos, keys, cos, sin)
                if idx is None:
                    x = x + self.mlp(h, L["dense_gate_up"], L["dense_down"])
                    continue
                routing.append(idx)
                if offloaded:  # x + (shared + Σ_k w_k e_k(h)), summed in `mix`'s order
                    x = x + torch.ops.draftexpert.routed_experts(
                        self.mlp(h, *shared[i]), h, w[0, :r], idx[0, :r], handle, i
                    )
                else:
                    x = (
                        x
                        + self.mlp(h, *shared[i])
                        + self.routed_indexed(h, w[0, :r], idx[0, :r], gate_ups[i], downs[i])
                    )
            return self.head(x), routing

        self._compiled = torch.compile(step, dynamic=False)
        return self

    def warm_compiled(self, max_len: int, paths) -> None:
        """Compile the step for caches of `max_len` rows on each of `paths` (None: the target) now, so
        that a sequence's timing never includes compilation (a cache bucket of 512 rows is a new
        static shape: compiled inside the first such prompt it cost ~1.4 s, 22 ms on each of its 63
        tokens). A scratch cache; the store's loads happen outside any ledgered forward (uncounted)."""
        if self._compiled is None:
            return
        for path in paths:
            if (max_len, id(path)) in self._warm:
                continue
            self._warm.add((max_len, id(path)))
            # as a sequence's: the cache and token made outside inference mode, stepped inside it (guards see both)
            cache = KVCache(self.cfg, max_len, device=self.embed.device, dtype=self.embed.dtype)
            tok = torch.zeros(1, dtype=torch.long)
            with torch.inference_mode():
                self._decode_compiled(tok, cache, path)
            self.experts.end_forward()

    def _decode_compiled(self, ids, cache, path):
        """The compiled step (`compile_decode`); taps set as the eager forward sets them; the ledger
        by the store's fetches (in the op) or as `fetch` would record resident experts (no loads)."""
        c, store = self.cfg, self.experts
        start = cache.length
        cos, sin = self.rope_tables(start, 1)
        pos, keys = cache.positions[start : start + 1], cache.positions  # every row: static shapes
        moe = [i for i in range(c.layers) if c.is_moe(i)]
        r = c.top_k if path is None else path.r
        shared = [
            None
            if not c.is_moe(i)
            else path.shared_for(i, L)
            if path is not None
            else (L["shared_gate_up"], L["shared_down"])
            for i, L in enumerate(self.layers)
        ]
        gate_ups = [store.gate_up.get(i) for i in range(c.layers)] if self._indexed else []
        downs = [store.down.get(i) for i in range(c.layers)] if self._indexed else []
        logits, routing = self._compiled(
            ids.to(self.embed.device),
            self.layers,
            shared,
            r,
            gate_ups,
            downs,
            cache.c_kv,
            cache.k_pe,
            pos,
            keys,
            cos,
            sin,
        )
        for i, idx in zip(moe, routing):
            self.last_routing[i] = idx
            if self._indexed:
                self.last_fetched[i] = idx[0, :r].tolist()
                store.ledger.record(i, r, 0, 0, 0.0)
        return logits


class _Registry:
    """Live models by a small int: what `draftexpert::routed_experts` receives instead of the model."""

    def __init__(self):
        self._models: weakref.WeakValueDictionary[int, MoEModel] = weakref.WeakValueDictionary()
        self._next = 0

    def add(self, model: MoEModel) -> int:
        self._next += 1
        self._models[self._next] = model
        return self._next

    def __getitem__(self, handle: int) -> MoEModel:
        return self._models[handle]


_MODELS = _Registry()


@torch.library.custom_op("draftexpert::routed_experts", mutates_args=())
def routed_experts(
    out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, model: int, layer: int
) -> torch.Tensor:
    """out + Σ_k w_k · expert_k(h) for one token (out, h [1, H]; w, idx [r]), the experts fetched from
    model `model`'s store as they land (`MoEModel.mix` without its residual) — the compiled step's
    one call out of the graph per MoE layer; sets the model's `last_fetched` tap."""
    m = _MODELS[model]
    chosen = idx.tolist()  # the layer's one host sync: what to fetch
    m.last_fetched[layer] = chosen
    acc = out
    for k, (gate_up, down) in enumerate(m.experts.fetch_iter(layer, chosen)):
        acc = torch.addcmul(acc, w[k], m.mlp(h, gate_up, down))
    return acc if acc is not out else out.clone()  # an op's output may not alias its input


@routed_experts.register_fake
def _(out, h, w, idx, model, layer):
    return torch.empty_like(out)


def from_hf_model(model) -> MoEModel:
    """A lean model over the weights of a loaded transformers DeepseekV2/V3 model, experts resident."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gate_up, down = {}, {}
    for i in range(model.config.num_hidden_layers):
        key = f"model.layers.{i}.mlp.experts."
        if key + "gate_up_proj" in sd:
            gate_up[i], down[i] = sd[key + "gate_up_proj"], sd[key + "down_proj"]
    return MoEModel(model.config, sd, ResidentStore(gate_up, down, dtype=model.dtype))
