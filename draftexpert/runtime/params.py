"""Parameter breakdown of a DeepseekV2/V3 MoE from its config alone (the paper's Fig. 1a).

Counts follow the tensors of transformers' DeepseekV2/V3 classes (and of the checkpoints):
  attention (MLA), per layer:
    q:  q_lora_rank null → q_proj  H · n_h·(d_nope + d_rope)
        else             → q_a_proj H·r_q + q_a_layernorm r_q + q_b_proj r_q · n_h·(d_nope + d_rope)
    kv_a_proj_with_mqa H·(r_kv + d_rope) + kv_a_layernorm r_kv + kv_b_proj r_kv · n_h·(d_nope + d_v)
    o_proj n_h·d_v · H
  dense MLP (layers < first_k_dense_replace): 3 · H · I
  MoE layer: routed experts E · 3 · H · I_moe; shared experts 3 · H · (n_shared · I_moe);
             router E · H (+ E correction-bias entries for V3's noaux_tc)
  norms: 2·H per layer + H final; embedding V·H; lm_head V·H unless tied.
A decoded token reads every non-routed matrix but the embedding (one row of it; a tied embedding is
read whole as the head), and k routed experts per MoE layer: `token_params`; `token_routed_share` =
the routed experts' part of it (DeepSeek-V2-Lite: 55%).
Bytes: bf16 = 2 B/param. Q4_0 = 18 B per 32 weights (4.5 bits) for every matrix, vectors kept
f32 (4 B) as llama.cpp keeps norms; real GGUF files may keep a few matrices at higher precision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1 << 30
Q4_0_BYTES_PER_WEIGHT = 18 / 32


@dataclass
class Breakdown:
    embedding: int = 0
    lm_head: int = 0
    attention: int = 0
    dense_mlp: int = 0
    shared_experts: int = 0
    router: int = 0
    norms: int = 0
    routed_experts: int = 0
    vectors: int = 0  # of the above, 1-D tensors (norms, router bias): kept f32 in Q4_0 files
    routed_expert_params_each: int = 0
    n_routed_experts_total: int = 0  # MoE layers × experts per layer
    routed_per_token: int = 0  # k experts per MoE layer: what a decoded token computes with
    hidden: int = 0

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.lm_head
            + self.attention
            + self.dense_mlp
            + self.shared_experts
            + self.router
            + self.norms
            + self.routed_experts
        )

    @property
    def non_routed(self) -> int:
        return self.total - self.routed_experts

    @property
    def token_params(self) -> int:
        """Parameters one decoded token reads (see the module docstring)."""
        head = self.lm_head or self.embedding
        return self.non_routed - self.embedding - self.lm_head + head + self.hidden + self.routed_per_token

    def summary(self) -> dict:
        """Counts, shares and sizes; `*_gib_bf16` = params · 2 / 2^30,
        `*_gib_q4_0` = (matrix params · 18/32 + vector params · 4) / 2^30."""
        nr_vec = self.vectors
        out = {k: v for k, v in asdict(self).items()}
        out.update(
            {
                "total": self.total,
                "non_routed": self.non_routed,
                "routed_share": self.routed_experts / self.total,
                "token_params": self.token_params,
                "token_routed_share": self.routed_per_token / self.token_params,
                "routed_gib_bf16": 2 * self.routed_experts / GIB,
                "non_routed_gib_bf16": 2 * self.non_routed / GIB,
                "routed_gib_q4_0": self.routed_experts * Q4_0_BYTES_PER_WEIGHT / GIB,
                "non_routed_gib_q4_0": ((self.non_routed - nr_vec) * Q4_0_BYTES_PER_WEIGHT + 4 * nr_vec) / GIB,
                "routed_expert_mib_bf16": 2 * self.routed_expert_params_each / (1 << 20),
                "routed_expert_mib_q4_0": self.routed_expert_params_each * Q4_0_BYTES_PER_WEIGHT / (1 << 20),
            }
        )
        return out


def is_moe_layer(cfg: dict, layer: int) -> bool:
    return (
        cfg.get("n_routed_experts") is not None
        and layer >= cfg.get("first_k_dense_replace", 0)
        and layer % cfg.get("moe_layer_freq", 1) == 0
    )


def breakdown(cfg: dict) -> Breakdown:
    """Parameter counts of a DeepseekV2/V3 config (a config.json as a dict)."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    d_nope, d_rope, d_v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r_q, r_kv = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    b = Breakdown()
    b.embedding = V * H
    b.lm_head = 0 if cfg.get("tie_word_embeddings") else V * H
    b.norms = H  # final norm
    q_out = nh * (d_nope + d_rope)
    attn = H * (r_kv + d_rope) + r_kv * nh * (d_nope + d_v) + nh * d_v * H
    attn_vec = r_kv
    if r_q:
        attn += H * r_q + r_q * q_out
        attn_vec += r_q
    else:
        attn += H * q_out
    v3_bias = cfg.get("topk_method") == "noaux_tc" or cfg.get("model_type") == "deepseek_v3"
    for layer in range(L):
        b.attention += attn + attn_vec
        b.norms += 2 * H
        b.vectors += attn_vec + 2 * H
        if is_moe_layer(cfg, layer):
            E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            b.routed_experts += E * 3 * H * inter
            b.n_routed_experts_total += E
            b.shared_experts += 3 * H * cfg.get("n_shared_experts", 0) * inter
            b.router += E * H + (E if v3_bias else 0)
            b.vectors += E if v3_bias else 0
            b.routed_expert_params_each = 3 * H * inter
            b.routed_per_token += cfg["num_experts_per_tok"] * 3 * H * inter
        else:
            b.dense_mlp += 3 * H * cfg["intermediate_size"]
    b.vectors += H
    b.hidden = H
    return b


class WontFit(ValueError):
    """A model that cannot be held where a platform puts it; raised before anything is loaded."""


def available_host_bytes() -> int | None:
    """What this process can allocate without swapping or being killed: MemAvailable, and at most
    what its memory cgroup's limit leaves (v1 `memory.limit_in_bytes`, v2 `memory.max`; the
    group's page cache counts as free, it is reclaimed first); None where neither can be read."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = _cgroup_room()
    return room if avail is None else avail if room is None else min(avail, room)


def _cgroup_room(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """limit − (usage − page cache) of this process's memory cgroup, or None (no limit / unreadable)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if not v1 and controllers != "":
            continue
        group = (root / "memory" if v1 else root) / path.lstrip("/")
        names = (
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
            if v1
            else ("memory.max", "memory.current", "file")
        )
        try:
            limit = (group / names[0]).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v2 "max"; v1's "no limit" is a huge number
                continue
            usage = int((group / names[1]).read_text())
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            return int(limit) - (usage - int(stat.get(names[2], 0)))
        except (OSError, ValueError):
            continue
    return None


STORES = {"mn": "flash", "cg": "host", "resident": "resident"}
EXPERT_FILE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q4_0": Q4_0_BYTES_PER_WEIGHT}
STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # a config's torch_dtype: the checkpoint's weights


def plan(
    cfg: dict,
    platform: str,
    cuda: bool,
    dtype_bytes: int = 4,
    expert_type: str = "q4_0",
    positions: int = 5,
    context: int = 2048,
    working_set_bytes: int = 0,
    draft_intermediate: int = 0,
) -> dict:
    """Where a lean model's bytes go on `platform`, from the config alone, as the runtime holds
    them (`build_model`: computing in `dtype_bytes`, fp32 = 4). Keys, in bytes:
      accelerator_weights  non-routed weights (+ every routed expert when resident)
      draft_weights        DraftExpert's drafter (`draft_intermediate` I_d > 0): its own fused shared MLP
                           per MoE layer, the shared experts' weights copied beside the draft expert's,
                           3 · H · (n_shared · I_moe + I_d) (DS-V2-Lite, zero draft expert: 2.5 GiB fp32)
      kv_cache             MLA cache for `context` positions (c_kv and k_pe per layer)
      demand_in_flight     with a working-set bound: one forward layer's demand loads (`positions` ×
                           top-k experts, at most every expert), which the store may hold in flight
                           beside a full budget; `working_set_bound` leaves room for them
      working_set          experts a cold round may stage at once: `positions` (AR 1, speculation
                           K_max + 1) × top-k per MoE layer (at most every expert), in the compute
                           dtype — the round keeps them until it ends, at most `working_set_bytes`
                           when given (`--working-set`: past it the round reloads on demand)
      host_pool            cg: the routed pool in host memory, in the checkpoint's dtype (the
                           config's torch_dtype; narrower compute narrows it), one exact-size
                           buffer; `host_pinned` the same bytes page-locked in place on CUDA
                           (`HostPool`), and `host_load_transient` what filling it holds besides
                           (one layer's tensors at most: a fused checkpoint's gate_up_proj)
      storage              mn: the expert file (`expert_type`); resident / cg: none
      conversion_peak      writing the expert file (streamed): about 1.5 × one layer in fp32 (the
                           layer as read, one part's copy) plus its encoding — an estimate
                           (DS-shaped layers measured 3.8 GiB Q4_0, 4.2 GiB bf16 peak RSS)
    `host` / `accelerator` sum what each memory holds (one memory when the CPU is the accelerator)."""
    b = breakdown(cfg)
    H, inter, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg.get("n_routed_experts") or 0
    k, L = cfg.get("num_experts_per_tok") or 0, cfg["num_hidden_layers"]
    moe_layers = [i for i in range(L) if is_moe_layer(cfg, i)]
    expert = 3 * H * inter
    p = {
        "platform": platform,
        "store": STORES[platform],
        "cuda": cuda,
        "dtype_bytes": dtype_bytes,
        "accelerator_weights": (b.non_routed + (b.routed_experts if platform == "resident" else 0)) * dtype_bytes,
        "draft_weights": len(moe_layers)
        * 3
        * H
        * (cfg.get("n_shared_experts", 0) * inter + draft_intermediate)
        * dtype_bytes
        if draft_intermediate
        else 0,
        "kv_cache": L * context * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes,
        "working_set": (
            0 if platform == "resident" else len(moe_layers) * min(E, positions * k) * expert * dtype_bytes
        ),
        "working_set_one_position": (
            0 if platform == "resident" else len(moe_layers) * min(E, k) * expert * dtype_bytes
        ),
        "host_pool": 0,
        "host_pinned": 0,
        "host_load_transient": 0,
        "storage": 0,
        "conversion_peak": 0,
    }
    if platform == "cg":
        stored = STORED_BYTES.get(cfg.get("torch_dtype") or cfg.get("dtype"), 4)
        p["pool_dtype_bytes"] = min(stored, dtype_bytes)
        p["host_pool"] = len(moe_layers) * E * expert * p["pool_dtype_bytes"]
        p["host_pinned"] = p["host_pool"] if cuda else 0
        p["host_load_transient"] = E * expert * stored
    if platform == "mn":
        p["storage"] = int(b.routed_experts * EXPERT_FILE_BYTES[expert_type])
        p["conversion_peak"] = int(E * expert * (1.5 * 4 + EXPERT_FILE_BYTES[expert_type]))
    if working_set_bytes and platform != "resident":  # never below what one layer's forward holds at once
        p["working_set"] = min(p["working_set"], max(working_set_bytes, min(E, positions * k) * expert * dtype_bytes))
        p["working_set_one_position"] = min(
            p["working_set_one_position"], max(working_set_bytes, min(E, k) * expert * dtype_bytes)
        )
    p["working_set_budget"] = working_set_bytes
    p["demand_one_layer"] = 0 if platform == "resident" else min(E, positions * k) * expert * dtype_bytes
    # a bounded round can hold one forward layer's demand loads beside a full budget (the loads in
    # flight, prefetches among them, that the store cannot drop): counted besides the bound
    p["demand_in_flight"] = (
        min(E, positions * k) * expert * dtype_bytes if working_set_bytes and platform != "resident" else 0
    )
    for suffix, ws in (
        ("", p["working_set"] + p["demand_in_flight"]),
        ("_least", p["working_set_one_position"] + p["demand_in_flight"]),
    ):
        device = p["accelerator_weights"] + p["draft_weights"] + p["kv_cache"] + ws
        host = p["host_pool"] + p["host_load_transient"]
        p["accelerator" + suffix], p["host" + suffix] = (device, host) if cuda else (0, host + device)
    return p


def check_fits(
    p: dict, host_bytes: int | None, accelerator_bytes: int | None = None, headroom: float = 0.9
) -> str | None:
    """Refuse a plan (`plan`) whose least need (a round that stages one position's experts) does
    not fit the given memories, with the numbers and what to do; return a warning when only its
    worst case (every position of a round staging new experts) does not."""
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    what = {
        "resident": "every weight",
        "host": "the routed-expert pool (platform cg) and the rest",
        "flash": "the non-routed weights and a round's staged experts",
    }[p["store"]]
    for mem, have, hint in (
        ("host", host_bytes, "use --platform mn (experts read from storage), or a machine with more memory"),
        ("accelerator", accelerator_bytes, "use --platform cg or mn"),
    ):
        if have is not None and p[mem + "_least"] > headroom * have:
            raise WontFit(
                f"{what} ({8 * p['dtype_bytes']}-bit compute) need {gib(p[mem + '_least'])} of {mem} "
                f"memory, but {gib(have)} is available: {hint} (`bench plan` shows where the bytes go)"
            )
    for mem, have in (("host", host_bytes), ("accelerator", accelerator_bytes)):
        if have is not None and p[mem] > headroom * have:
            return (
                f"a round that stages new experts at every position may need {gib(p[mem])} of {mem} memory "
                f"({gib(have)} available): --working-set bounds it (past the bound a round reloads on demand); "
                "truncation (the default) or a lower --k-max keeps it smaller"
            )
    return None


def working_set_bound(p: dict, host_bytes: int | None, accelerator_bytes: int | None, headroom: float = 0.9) -> int:
    """Bytes a round's working set may take so that a plan (`plan`) whose worst case does not fit
    does: what the memory holding it leaves after everything else (0: no bound needed, or unknown)."""
    mem, have = ("accelerator", accelerator_bytes) if p["cuda"] else ("host", host_bytes)
    if have is None or p[mem] <= headroom * have or p["store"] == "resident":
        return 0
    demand = p["demand_in_flight"] or (min(p["working_set"], p["demand_one_layer"]))
    return max(0, int(headroom * have) - (p[mem] - p["working_set"]) - demand)


def distill_plan(cfg: dict, p: dict, intermediate: int, seq_len: int, batch: int, teacher: str) -> dict:
    """What distilling draft experts adds to a platform's plan `p` (the store's, `plan`), in
    bytes — an estimate, from the config alone:
      distill_state        the draft experts in fp32 with their gradients and AdamW's two
                           moments: 16 bytes × n_moe · 3 · H · I_d
      distill_logits       the target's and the draft's logits over a batch (B · T · V, fp32),
                           with the log-softmax copies the losses make: 6 × B · T · V · 4
      distill_activations  what the draft pass keeps for its backward, per layer and token: the
                           residual stream and norms, attention's projections and scores, the
                           shared and draft experts' hidden units, the teacher's per-layer targets
      distill_experts      one layer's experts at a time (the teacher's union over a window, the
                           draft path's top-1 recomputed in the backward), in the compute dtype
    `teacher` runtime: those beside the store's non-routed weights (no round's working set);
    transformers: the whole model in fp32 instead (every expert resident)."""
    b = breakdown(cfg)
    H, V, L, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
    k, inter = cfg.get("num_experts_per_tok") or 0, cfg["moe_intermediate_size"]
    moe = sum(is_moe_layer(cfg, i) for i in range(L))
    heads, d_qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shared = (cfg.get("n_shared_experts") or 0) * inter
    per_token_layer = 4 * (
        8 * H + heads * (2 * d_qk + cfg["v_head_dim"]) + heads * seq_len + 3 * shared + 3 * intermediate + 2 * E
    )
    d = {
        "teacher": teacher,
        "distill_state": 16 * moe * 3 * H * intermediate,
        "distill_logits": 6 * batch * seq_len * V * 4,
        "distill_activations": batch * seq_len * L * per_token_layer,
        "distill_experts": min(E, seq_len * k) * 3 * H * inter * p["dtype_bytes"],
    }
    extra = d["distill_state"] + d["distill_logits"] + d["distill_activations"]
    device = p["accelerator_weights"] + d["distill_experts"] + extra  # training runs where the model computes
    host = p["host_pool"] + p["host_load_transient"]
    if teacher == "transformers":
        d["distill_host"], d["distill_accelerator"] = b.total * 4 + extra, 0
    else:
        d["distill_host"], d["distill_accelerator"] = (host, device) if p["cuda"] else (host + device, 0)
    return d


def check_distill_fits(d: dict, host_bytes: int | None, accelerator_bytes: int | None, headroom: float = 0.9) -> None:
    """Refuse a distillation plan (`distill_plan`) that does not fit, with the numbers and what to do."""
    for mem, have in (("host", host_bytes), ("accelerator", accelerator_bytes)):
        need = d[f"distill_{mem}"]
        if have is not None and need > headroom * have:
            hint = (
                "--teacher runtime streams the experts instead of holding the whole model"
                if d["teacher"] == "transformers"
                else "lower --seq-len / --batch-size / --intermediate"
            )
            raise WontFit(
                f"distilling with the {d['teacher']} teacher needs {need / GIB:.1f} GiB of {mem} memory, "
                f"but {have / GIB:.1f} GiB is available, {headroom * have / GIB:.1f} GiB of it usable "
                f"({1 - headroom:.0%} kept free for the allocator and the process): {hint} "
                "(`bench plan --distill` shows where the bytes go)"
            )
