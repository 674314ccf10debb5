"""A lean, decode-oriented forward for DeepseekV2 / DeepseekV3 checkpoints (batch 1).

Shapes: T = tokens in this forward (1 when decoding, the block length when verifying, the
prompt length when prefilling), H = hidden, n_h heads, r_kv = kv_lora_rank, d_n / d_r / d_v =
qk_nope / qk_rope / v head dims, E routed experts, I = moe_intermediate_size.

- **Absorbed MLA** (DeepSeek's inference form): the cache holds the compressed latent
  c_kv [L, r_kv] and the shared rope key k_pe [L, d_r]; kv_b_proj is folded into the query
  (q_nope · W_uk → [T, n_h, r_kv]) and the output (· W_uvᵀ), so nothing is re-expanded per step.
- **KV cache** preallocated to `max_len`, cropped back by setting its length (speculation).
- **One routing function** (`route`) for every path and any r: V2 softmax / greedy top-r, times
  the scaling factor, no renormalisation; V3 sigmoid scores + correction bias choose, the
  un-biased scores weigh, normalised over the chosen r when `norm_topk_prob`, times the scale.
- **Routed experts come from an `ExpertStore`** (`draftexpert.experts`): the model never knows
  where they live; the store's ledger sees every request and load. Only
  the unique experts a forward needs are asked for, and each runs once on all its tokens
  (a loop over unique experts, never over tokens). Shared experts are resident.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F

from draftexpert.experts import ExpertStore, ResidentStore


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

    @classmethod
    def from_hf(cls, c) -> ModelConfig:
        v3 = c.model_type == "deepseek_v3"
        if not v3 and getattr(c, "topk_method", "greedy") != "greedy":
            raise ValueError(f"routing {c.topk_method!r} is not supported (DeepSeek-V2-Lite uses 'greedy')")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   first_dense=c.first_k_dense_replace, heads=c.num_attention_heads, d_nope=c.qk_nope_head_dim,
                   d_rope=c.qk_rope_head_dim, d_v=c.v_head_dim, r_q=c.q_lora_rank, r_kv=c.kv_lora_rank,
                   n_experts=c.n_routed_experts, n_shared=c.n_shared_experts, top_k=c.num_experts_per_tok,
                   moe_inter=c.moe_intermediate_size, v3=v3, norm_topk=bool(getattr(c, "norm_topk_prob", False)) and v3,
                   scale=float(c.routed_scaling_factor), n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                   eps=c.rms_norm_eps)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense


def route(logits: torch.Tensor, cfg: ModelConfig, r: int, bias: torch.Tensor | None = None):
    """Router logits [T, E] (fp32) → (weights [T, r], experts [T, r]).

    V2 (softmax, greedy): s = softmax(logits); experts = top-r of s; w = s[experts] · scale.
    V3 (sigmoid, noaux_tc): s = sigmoid(logits); experts = top-r of s + bias within the best
    `topk_group` of `n_group` groups (group score = sum of its top-2); w = s[experts],
    normalised over the r chosen when norm_topk_prob, · scale."""
    if not cfg.v3:
        s = logits.softmax(-1)
        w, idx = torch.topk(s, r, dim=-1)
        return w * cfg.scale, idx
    s = logits.sigmoid()
    choice = s + bias if bias is not None else s
    if cfg.n_group > 1:
        g = choice.view(-1, cfg.n_group, cfg.n_experts // cfg.n_group)
        best = g.topk(2, dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1)[1]
        mask = torch.zeros_like(g[..., 0]).scatter_(1, best, 1.0).bool()
        choice = g.masked_fill(~mask[..., None], 0.0).view_as(choice)
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
        self.positions: torch.Tensor | None = None  # arange(max_len), for the compiled step's mask

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
    (`draftexpert.drafters`) is a cheaper configuration of the same weights: its top-r routed
    experts and, for DraftExpert, a widened shared expert that carries the draft expert.
    Router taps: after each forward, `self.last_routing` holds the router's top_k experts
    [T, top_k] of every MoE layer (layer → tensor) — on a draft path, the predicted verifier
    experts (Eq. 12) — and `self.last_fetched` the (layer, experts) the forward actually ran."""

    def __init__(self, hf_config, weights: dict[str, torch.Tensor], experts: ExpertStore):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

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
                "ln1": w[p + "input_layernorm.weight"], "ln2": w[p + "post_attention_layernorm.weight"],
                "kv_a": w[p + "self_attn.kv_a_proj_with_mqa.weight"], "kv_ln": w[p + "self_attn.kv_a_layernorm.weight"],
                "w_uk": kv_b[:, :c.d_nope].contiguous(),  # [n_h, d_n, r_kv]
                "w_uv_t": kv_b[:, c.d_nope:].transpose(1, 2).contiguous(),  # [n_h, r_kv, d_v]
                "o": w[p + "self_attn.o_proj.weight"],
            }
            if c.r_q:
                lay.update(q_a=w[p + "self_attn.q_a_proj.weight"], q_ln=w[p + "self_attn.q_a_layernorm.weight"],
                           q_b=w[p + "self_attn.q_b_proj.weight"])
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
        self._compiled: dict | None = None  # compile_decode()
        self._cos = self._sin = torch.empty(0, c.d_rope // 2)  # rope tables, grown on demand

    def rope_tables(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d_r/2] for positions start … start+T−1 (cached; attention_scaling applied)."""
        if start + T > self._cos.shape[0]:
            n = max(start + T, 2 * self._cos.shape[0], 256)
            ang = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None]
            dev, dt = self.embed.device, self.embed.dtype
            self._cos, self._sin = (ang.cos() * self.rope_scale).to(dev, dt), (ang.sin() * self.rope_scale).to(dev, dt)
        return self._cos[start:start + T], self._sin[start:start + T]

    # -- blocks ---------------------------------------------------------------------------

    def attention(self, i: int, x: torch.Tensor, cache: KVCache, cos, sin) -> torch.Tensor:
        """x [T, H] → [T, H]; writes positions [cache.length, cache.length + T) of layer i."""
        c, L = self.cfg, self.layers[i]
        T, start = x.shape[0], cache.length
        q = F.linear(rms_norm(F.linear(x, L["q_a"]), L["q_ln"], c.eps), L["q_b"]) if c.r_q else F.linear(x, L["q"])
        q = q.view(T, c.heads, c.d_nope + c.d_rope)
        q_nope, q_pe = q[..., :c.d_nope], rope(q[..., c.d_nope:], cos[:, None], sin[:, None])
        kv = F.linear(x, L["kv_a"])  # [T, r_kv + d_r]
        cache.c_kv[i, start:start + T] = rms_norm(kv[:, :c.r_kv], L["kv_ln"], c.eps)
        cache.k_pe[i, start:start + T] = rope(kv[:, c.r_kv:], cos, sin)
        ckv, kpe = cache.c_kv[i, :start + T], cache.k_pe[i, :start + T]  # [S, r_kv], [S, d_r]
        q_c = torch.bmm(q_nope.transpose(0, 1), L["w_uk"])  # absorbed: [n_h, T, d_n] @ [n_h, d_n, r_kv]
        scores = (q_c @ ckv.T + (q_pe.transpose(0, 1) @ kpe.T)) * self.softmax_scale  # [n_h, T, S]
        if T > 1:  # causal within the new block; every cached position is visible
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).triu(start + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        out_c = scores.softmax(-1) @ ckv  # [n_h, T, r_kv]
        out = torch.bmm(out_c, L["w_uv_t"]).transpose(0, 1).reshape(T, c.heads * c.d_v)  # [n_h, T, d_v] → [T, n_h·d_v]
        return F.linear(out, L["o"])

    @staticmethod
    def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    def moe(self, i: int, x: torch.Tensor, path, phase: str) -> torch.Tensor:
        """x [T, H] → shared(x) + Σ_k w_k · expert_k(x) over each token's first r of the target's
        top_k experts, with the target's gate weights w_k (Eq. 4; a drafter keeps the target's
        weights for the experts it runs, so its e1 term is the target's e1 term exactly)."""
        L, k = self.layers[i], self.cfg.top_k
        w, idx = route(F.linear(x.to(L["gate"].dtype), L["gate"]), self.cfg, k, L["bias"])  # [T, k], best first
        self.last_routing[i] = idx
        gate_up, down = (L["shared_gate_up"], L["shared_down"]) if path is None else path.shared_for(i, L)
        out = self.mlp(x, gate_up, down)
        if path is not None and path.r < k:
            w, idx = w[:, :path.r], idx[:, :path.r]
        if x.shape[0] == 1:  # decoding: r distinct experts, no gather / scatter needed
            chosen, weights = idx[0].tolist(), w[0].tolist()  # one host sync for all r
            self.last_fetched[i] = chosen
            for wk, (gu, dn) in zip(weights, self.experts.fetch(i, chosen, phase)):
                out.add_(self.mlp(x, gu, dn), alpha=wk)
            return out
        unique = torch.unique(idx).tolist()
        self.last_fetched[i] = unique
        for e, (gu, dn) in zip(unique, self.experts.fetch(i, unique, phase)):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # the tokens that chose e
            out.index_add_(0, tok, self.mlp(x[tok], gu, dn) * w[tok, slot, None].to(x.dtype))
        return out

    # -- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, phase: str = "ar", path=None) -> torch.Tensor:
        """ids [T] → logits [T, V]; appends T positions to the cache. `path`: None for the
        target, else a `DraftPath`."""
        T = ids.shape[0]
        if cache.length + T > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {T} > {cache.max_len}")
        with self.experts.ledger.forward(phase, T):
            return self._forward(ids, cache, path, phase)

    def _forward(self, ids, cache, path, phase):
        c, T = self.cfg, ids.shape[0]
        if T == 1 and self._compiled is not None:
            return self._decode_compiled(ids, cache, path, phase)
        ids = ids.to(self.embed.device)
        cos, sin = self.rope_tables(cache.length, T)  # [T, d_r/2]
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            x = x + self.attention(i, rms_norm(x, L["ln1"], c.eps), cache, cos, sin)
            h = rms_norm(x, L["ln2"], c.eps)
            x = x + (self.moe(i, h, path, phase) if c.is_moe(i) else
                     self.mlp(h, L["dense_gate_up"], L["dense_down"]))
        cache.length += T
        return F.linear(rms_norm(x, self.norm, c.eps), self.lm_head)

    # -- compiled one-token step ------------------------------------------------------------

    def compile_decode(self) -> MoEModel:
        """Compile the one-token step with `torch.compile` (static shapes). Offloaded stores: per layer
        (a) attention + norms + routing, attending over the whole preallocated cache with positions
        past the current one masked, so the shapes never change; (b) the MLP mix shared + Σ_k w_k ·
        expert_k with the chosen experts passed in as they are (no gather, no copy). The expert
        store stays in Python between them, so loads, prefetch and the ledger are those
        of the eager path. Resident store: the whole step is one graph (nothing moves, so there is
        no store round trip to keep), the chosen experts' rows indexed inside the kernels —
        measured 4.2–4.5 vs 4.4–4.8 ms/token split (ds-tiny, 1 thread), 3.5 vs 4.8 (2 threads). Multi-token forwards (prefill, verify) stay eager. Costs ~20 s of
        compilation the first time each shape is seen (then cached by inductor on disk)."""
        c, scale = self.cfg, self.softmax_scale

        def attention(x, L, c_kv, k_pe, pos, positions, cos, sin):  # x [1, H]; c_kv [S, r_kv]; pos [1]
            h = rms_norm(x, L["ln1"], c.eps)
            q = F.linear(rms_norm(F.linear(h, L["q_a"]), L["q_ln"], c.eps), L["q_b"]) if c.r_q else F.linear(h, L["q"])
            q = q.view(1, c.heads, c.d_nope + c.d_rope)
            q_nope, q_pe = q[..., :c.d_nope], rope(q[..., c.d_nope:], cos[:, None], sin[:, None])
            kv = F.linear(h, L["kv_a"])
            c_kv.index_copy_(0, pos, rms_norm(kv[:, :c.r_kv], L["kv_ln"], c.eps))
            k_pe.index_copy_(0, pos, rope(kv[:, c.r_kv:], cos, sin))
            q_c = torch.bmm(q_nope.transpose(0, 1), L["w_uk"])  # [n_h, 1, r_kv]
            scores = (q_c @ c_kv.T + q_pe.transpose(0, 1) @ k_pe.T) * scale  # [n_h, 1, S]
            out_c = scores.masked_fill(positions > pos, float("-inf")).softmax(-1) @ c_kv
            x = x + F.linear(torch.bmm(out_c, L["w_uv_t"]).transpose(0, 1).reshape(1, -1), L["o"])
            h = rms_norm(x, L["ln2"], c.eps)
            if "gate" not in L:  # dense layer
                return x, h, None, None
            w, idx = route(F.linear(h.to(L["gate"].dtype), L["gate"]), c, c.top_k, L["bias"])  # routing in the graph
            return x, h, w.to(x.dtype), idx

        def mix(x, h, gate_up, down, weights, expert_gate_ups, expert_downs):  # x + shared(h) + Σ_k w_k E_k(h)
            x = x + self.mlp(h, gate_up, down)
            for k in range(len(expert_gate_ups)):
                x = x + weights[k] * self.mlp(h, expert_gate_ups[k], expert_downs[k])
            return x

        def head(x, norm, lm_head):
            return F.linear(rms_norm(x, norm, c.eps), lm_head)

        def step(tok, layers, shared, r, gate_ups, downs, c_kvs, k_pes, pos, positions, cos, sin, embed, norm, lm_head):
            """The whole one-token step as one graph, every expert resident: each MoE layer runs its
            chosen experts' rows indexed inside the kernel (a reduction, no gathered copy)."""
            x = embed[tok]  # [1, H]
            routing = []
            for i, L in enumerate(layers):
                x, h, w, idx = attention(x, L, c_kvs[i], k_pes[i], pos, positions, cos, sin)
                if idx is None:
                    x = x + self.mlp(h, L["dense_gate_up"], L["dense_down"])
                    continue
                routing.append(idx)
                x = x + self.mlp(h, *shared[i])
                chosen = idx[0, :r]  # [r]
                g, u = (gate_ups[i][chosen] * h).sum(-1).chunk(2, dim=-1)  # [r, I] each
                y = (downs[i][chosen] * (F.silu(g) * u)[:, None, :]).sum(-1)  # [r, H]
                x = x + (w[0, :r, None] * y).sum(0, keepdim=True)
            return head(x, norm, lm_head), routing

        compile_ = lambda f: torch.compile(f, dynamic=False)  # noqa: E731
        self._compiled = {"attention": compile_(attention), "mix": compile_(mix), "head": compile_(head)}
        if isinstance(self.experts, ResidentStore):  # nothing moves: one graph per step, no store round trip
            self._compiled["step"] = compile_(step)
        return self

    def _decode_compiled(self, ids, cache, path, phase):
        c, f = self.cfg, self._compiled
        pos = cache.length
        cos, sin = self.rope_tables(pos, 1)
        p = torch.tensor([pos], device=self.embed.device)
        if cache.positions is None:
            cache.positions = torch.arange(cache.max_len, device=self.embed.device)
        if "step" in f:
            return self._step_resident(ids, cache, path, p, cos, sin)
        x = self.embed[ids.to(self.embed.device)]
        no_experts = x.new_zeros(0)
        for i, L in enumerate(self.layers):
            x, h, w, idx = f["attention"](x, L, cache.c_kv[i], cache.k_pe[i], p, cache.positions, cos, sin)
            if idx is None:
                x = f["mix"](x, h, L["dense_gate_up"], L["dense_down"], no_experts, [], [])
                continue
            self.last_routing[i] = idx
            r = c.top_k if path is None else path.r
            chosen = idx[0, :r].tolist()
            self.last_fetched[i] = chosen
            experts = self.experts.fetch(i, chosen, phase)
            gate_up, down = (L["shared_gate_up"], L["shared_down"]) if path is None else path.shared_for(i, L)
            x = f["mix"](x, h, gate_up, down, w[0, :r], [e[0] for e in experts], [e[1] for e in experts])
        cache.length += 1
        return f["head"](x, self.norm, self.lm_head)


    def _step_resident(self, ids, cache, path, p, cos, sin):
        """The fused step (`compile_decode`); taps and ledger as the store's `fetch` would set them
        (requested = the experts run, no loads)."""
        c, store = self.cfg, self.experts
        moe = [i for i in range(c.layers) if c.is_moe(i)]
        r = c.top_k if path is None else path.r
        shared = [None if not c.is_moe(i) else path.shared_for(i, L) if path is not None
                  else (L["shared_gate_up"], L["shared_down"]) for i, L in enumerate(self.layers)]
        gate_ups = [store.gate_up.get(i) for i in range(c.layers)]
        downs = [store.down.get(i) for i in range(c.layers)]
        logits, routing = self._compiled["step"](ids.to(self.embed.device), self.layers, shared, r, gate_ups, downs,
                                                 cache.c_kv, cache.k_pe, p, cache.positions, cos, sin, self.embed,
                                                 self.norm, self.lm_head)
        for i, idx in zip(moe, routing):
            self.last_routing[i] = idx
            self.last_fetched[i] = idx[0, :r].tolist()
            store.ledger.record(i, r, 0, 0, 0.0)
        cache.length += 1
        return logits


def from_hf_model(model) -> MoEModel:
    """A lean model over the weights of a loaded transformers DeepseekV2/V3 model, experts resident."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gate_up, down = {}, {}
    for i in range(model.config.num_hidden_layers):
        key = f"model.layers.{i}.mlp.experts."
        if key + "gate_up_proj" in sd:
            gate_up[i], down[i] = sd[key + "gate_up_proj"], sd[key + "down_proj"]
    return MoEModel(model.config, sd, ResidentStore(gate_up, down, dtype=model.dtype))
