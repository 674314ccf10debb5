"""Streaming loader: a DeepseekV2/V3 checkpoint folder → a lean `MoEModel` over an expert store.

Safetensors shards are opened lazily (`safe_open`) and read one tensor at a time: non-routed
weights go to the accelerator, routed experts go one layer at a time into their store (the host
pool, or a GGUF file written once), so the whole model is never in memory at once. Checkpoints
store experts one by one (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, as
`save_pretrained` and the real DeepSeek/Moonlight checkpoints do) or fused
(`...mlp.experts.gate_up_proj` [E, 2I, H], `...down_proj` [E, H, I]); both are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig

from draftexpert.runtime.experts import ExpertStore, FlashStore, HostPool, HostStore, ResidentStore
from draftexpert.runtime.ggml_kernel import check_kernel
from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.gguf_write import write_expert_gguf
from draftexpert.runtime.ledger import Ledger
from draftexpert.runtime.model import ModelConfig, MoEModel

SUPPORTED = ("deepseek_v2", "deepseek_v3")


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be loaded: missing, corrupt, incomplete or unsupported."""


def load_config(folder: Path):
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json — not a Hugging Face model folder")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    if raw.get("model_type") not in SUPPORTED:
        raise CheckpointError(
            f"{cfg_path}: model_type {raw.get('model_type')!r} is not supported; this runtime "
            f"reads {', '.join(SUPPORTED)} (DeepSeek-V2-Lite, Moonlight and their tiny versions)"
        )
    return AutoConfig.from_pretrained(folder, local_files_only=True)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Checkpoint:
    """Lazy, shard-aware access to the tensors of a safetensors checkpoint."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not shards:
            raise CheckpointError(f"{self.folder}: no *.safetensors weights")
        self.handles = {}
        for s in shards:
            path = self.folder / s
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json is missing")
            try:
                self.handles[s] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError on damage
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
        self.where = weight_map or {k: s for s, h in self.handles.items() for k in h.keys()}

    def keys(self):
        return self.where.keys()

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype, from the shard's header (nothing read)."""
        shard = self.where.get(name)
        if shard is None:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        return SAFETENSORS_DTYPES[self.handles[shard].get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        shard = self.where.get(name)
        if shard is None:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        try:
            return self.handles[shard].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a truncated shard fails here
            raise CheckpointError(
                f"{self.folder / shard}: cannot read tensor {name} ({e}) — truncated or corrupt?"
            ) from e


def non_routed_weights(ckpt: Checkpoint, device, dtype) -> dict[str, torch.Tensor]:
    out = {}
    for k in ckpt.keys():
        if ".mlp.experts." in k:
            continue
        t = ckpt.get(k)
        out[k] = t.to(device, torch.float32 if k.endswith("e_score_correction_bias") else dtype)
    return out


def routed_experts(ckpt: Checkpoint, hf_config) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, gate_up [E, 2I, H], down [E, H, I]) for each MoE layer, one layer in memory at a time."""
    for layer in range(hf_config.first_k_dense_replace, hf_config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in ckpt.where:
            yield layer, ckpt.get(p + "gate_up_proj"), ckpt.get(p + "down_proj")
            continue
        E = hf_config.n_routed_experts
        gate_up = torch.stack(
            [torch.cat([ckpt.get(f"{p}{e}.gate_proj.weight"), ckpt.get(f"{p}{e}.up_proj.weight")]) for e in range(E)]
        )
        down = torch.stack([ckpt.get(f"{p}{e}.down_proj.weight") for e in range(E)])
        yield layer, gate_up, down


def pool_dtype(ckpt: Checkpoint, hf_config, compute: torch.dtype) -> torch.dtype:
    """The host pool's dtype: the checkpoint's own (bf16 for DS-V2-Lite / Moonlight), or the
    compute dtype when that is narrower — never widened on the host."""
    layer = hf_config.first_k_dense_replace
    p = f"model.layers.{layer}.mlp.experts."
    name = p + "gate_up_proj" if p + "gate_up_proj" in ckpt.where else p + "0.gate_proj.weight"
    stored = ckpt.dtype(name)
    return stored if stored.itemsize <= compute.itemsize else compute


def fill_host_pool(ckpt: Checkpoint, hf_config, dtype: torch.dtype):
    """The cg host pool (`HostPool`) filled expert by expert from the shards: each tensor read,
    copied into its place, dropped — memory is the pool plus one tensor (a fused checkpoint's
    per-layer `gate_up_proj`: one layer)."""
    layers = list(range(hf_config.first_k_dense_replace, hf_config.num_hidden_layers))
    E, H, inter = hf_config.n_routed_experts, hf_config.hidden_size, hf_config.moe_intermediate_size
    pool = HostPool(layers, E, H, inter, dtype)
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts."
        gu, dn = pool.gate_up[layer], pool.down[layer]
        if p + "gate_up_proj" in ckpt.where:
            gu.copy_(ckpt.get(p + "gate_up_proj"))
            dn.copy_(ckpt.get(p + "down_proj"))
            continue
        for e in range(E):
            gu[e, :inter].copy_(ckpt.get(f"{p}{e}.gate_proj.weight"))
            gu[e, inter:].copy_(ckpt.get(f"{p}{e}.up_proj.weight"))
            dn[e].copy_(ckpt.get(f"{p}{e}.down_proj.weight"))
    return pool


def expert_file_layers(
    path: Path, device, dtype, kernel: str = "dequant"
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, gate_up [E, 2I, H], down [E, H, I]) of a GGUF expert file, dequantised, a layer at a
    time (kernel "ggml": the Q4_0 bytes, uint8 [E, 2I, H/32·18] and [E, H, I/32·18])."""
    f = ExpertFile(Path(path), staging_buffers=1)
    if kernel != "dequant":
        check_kernel(kernel, f.qtype, device)
    take = (lambda raw: f.quantized(raw)) if kernel == "ggml" else (lambda raw: f.dequantize(raw, device, dtype))
    try:
        for layer in f.layers:
            pairs = [take(f.read_expert(layer, e)) for e in range(f.n_experts(layer))]
            yield layer, torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    finally:
        f.close()


def gguf_meta(hf_config) -> dict:
    return dict(
        n_layer=hf_config.num_hidden_layers,
        n_expert=hf_config.n_routed_experts,
        n_embd=hf_config.hidden_size,
        n_ff_exp=hf_config.moe_intermediate_size,
        first_dense=hf_config.first_k_dense_replace,
    )


def convert_experts(folder: Path, out: Path, qtype: str = "q4_0") -> Path:
    """Write the checkpoint's routed experts into a GGUF expert file (once; later runs reuse it)."""
    cfg = load_config(folder)
    layers = tqdm(
        routed_experts(Checkpoint(folder), cfg),
        total=cfg.num_hidden_layers - cfg.first_k_dense_replace,
        desc=f"writing {Path(out).name}",
        unit="layer",
        delay=2,
        disable=None,
    )  # a terminal, past 2 s
    return write_expert_gguf(out, layers, gguf_meta(cfg), qtype)


# the torch engine's non-routed weights: as the checkpoint holds them (in the compute dtype), or its
# MLPs and LM head as Q4_0 blocks on ggml's kernels, as llama.cpp's Q4_0 model holds them
HEAD_TYPES = ("checkpoint", "q4_0")


def build_model(
    folder: Path,
    store: str = "resident",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    gguf_path: Path | None = None,
    cache_experts: int = 0,
    staging_budget_bytes: int = 0,
    io_threads: int = 6,
    ledger: Ledger | None = None,
    working_set_bytes: int = 0,
    staging: str = "demand",
    kernel: str = "dequant",
    head_type: str = "checkpoint",
) -> MoEModel:
    """A lean model over `store` ∈ {resident, host, flash}; flash reads `gguf_path` (see
    `convert_experts`); resident with a `gguf_path` holds that file's experts, dequantised (the
    resident upper bound of a quantised mn run: the same model, nothing moved). `working_set_bytes`
    bounds what a round keeps on the accelerator (offload stores; 0: unbounded); `staging` how the
    flash store reads (`experts.STAGING`); `kernel` how the experts of a Q4_0 file compute on a
    CPU (`ggml_kernel.KERNELS`: "ggml" keeps them as their Q4_0 blocks); `head_type` the non-routed
    weights (`HEAD_TYPES`: "q4_0", see `MoEModel.quantize_head`)."""
    if head_type not in HEAD_TYPES:
        raise ValueError(f"--head-type: {head_type!r} is not one of {', '.join(HEAD_TYPES)}")
    if kernel != "dequant" and (gguf_path is None or store not in ("flash", "resident")):
        raise ValueError(
            "--expert-kernel ggml computes the experts of a Q4_0 expert file (platform mn, or resident from the file)"
        )
    cfg = load_config(folder)
    ckpt = Checkpoint(folder)
    weights = non_routed_weights(ckpt, device, dtype)
    kw = dict(device=device, dtype=dtype, ledger=ledger, cache_experts=cache_experts)
    offload = dict(kw, working_set_bytes=working_set_bytes)
    experts: ExpertStore
    if store == "flash":
        if gguf_path is None:
            raise CheckpointError("the flash store needs a GGUF expert file (bench convert writes it)")
        experts = FlashStore(
            gguf_path,
            io_threads=io_threads,
            staging_budget_bytes=staging_budget_bytes,
            staging=staging,
            kernel=kernel,
            **offload,
        )
    elif store == "host":
        pool = fill_host_pool(ckpt, cfg, pool_dtype(ckpt, cfg, dtype))
        experts = HostStore(pool.gate_up, pool.down, pool=pool, **offload)
    elif store == "resident":
        gate_up, down = {}, {}
        layers = expert_file_layers(gguf_path, device, dtype, kernel) if gguf_path else routed_experts(ckpt, cfg)
        for layer, gu, dn in layers:
            gate_up[layer], down[layer] = (gu, dn) if kernel == "ggml" else (gu.to(dtype), dn.to(dtype))
        experts = ResidentStore(gate_up, down, **kw)
    else:
        raise ValueError(f"unknown expert store {store!r}; choose resident, host or flash")
    model = MoEModel(cfg, weights, experts)
    return model.quantize_head() if head_type == "q4_0" else model


def load_router(folder: Path) -> tuple[ModelConfig, dict[int, torch.Tensor]]:
    """The target's routing rule without its weights: (ModelConfig, V3 correction bias per MoE
    layer, fp32) — what another engine needs to choose experts as the runtime's `route` does."""
    cfg = load_config(folder)
    ckpt = Checkpoint(folder)
    names = {
        i: f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    }
    return ModelConfig.from_hf(cfg), {i: ckpt.get(n).float() for i, n in names.items() if n in ckpt.keys()}
