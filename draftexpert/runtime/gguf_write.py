"""Writing a GGUF expert file: streamed layer by layer, encoded (F32, F16, BF16, Q4_0 through gguf's
own quantiser, bit-identical to llama.cpp's), moved into place atomically with its checksums
(`gguf_checksums`). The layout is `gguf_layout`'s.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from draftexpert.runtime.gguf_checksums import digest, publish
from draftexpert.runtime.gguf_layout import ALIGN, ARCH, PARTS, TYPES, qtype_of


def write_expert_gguf(path: Path, experts, meta: dict, qtype: str = "q4_0") -> Path:
    """Write experts into `path` (atomically), streaming: every tensor's shape is known from
    `meta` (n_layer, n_expert, n_embd, n_ff_exp, first_dense), so the header and tensor infos go
    first and each layer's tensors are encoded and written as `experts` yields them — (layer,
    gate_up [E, 2I, H], down [E, H, I]) float tensors, MoE layers in order. Memory stays at one
    layer (DS-V2-Lite: ~2 GiB in fp32), never the whole file (26.8 GiB in bf16)."""
    if qtype not in TYPES:
        raise ValueError(f"unsupported expert type {qtype!r}; choose one of {', '.join(TYPES)}")
    E, H, inter = meta["n_expert"], meta["n_embd"], meta["n_ff_exp"]
    if qtype == "q4_0" and (H % 32 or inter % 32):
        raise ValueError(
            f"Q4_0 quantises rows in blocks of 32 weights: hidden {H} and "
            f"moe_intermediate {inter} must both be multiples of 32 (use f16 or bf16)"
        )
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    digests: dict[str, str] = {}
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_custom_alignment(ALIGN)
    w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, 1)  # split 2 of the llama.cpp model (llama_gguf)
    w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 2)
    w.add_block_count(meta["n_layer"])
    w.add_embedding_length(H)
    w.add_expert_count(E)
    w.add_expert_feed_forward_length(inter)
    w.add_leading_dense_block_count(meta["first_dense"])
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q4_0": 2}[qtype])
    w.add_string("draftexpert.content", "routed experts")
    qt = qtype_of(qtype)
    shapes = {"gate_up": (E, 2 * inter, H), "down": (E, H, inter)}
    plan = [(layer, part) for layer in range(meta["first_dense"], meta["n_layer"]) for part in PARTS]
    for layer, part in plan:  # numpy order; element shapes, byte counts of the encoded type
        shape = shapes[part]
        n = int(np.prod(shape))
        nbytes = {"f32": 4 * n, "f16": 2 * n, "bf16": 2 * n, "q4_0": n // 32 * 18}[qtype]
        dtype = {"f32": np.float32, "f16": np.float16}.get(qtype, np.float32)
        w.add_tensor_info(
            f"blk.{layer}.ffn_{part}_exps.weight",
            shape,
            dtype,
            nbytes,
            raw_dtype=qt if qtype in ("bf16", "q4_0") else None,
        )
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        todo = iter(plan)
        for layer, gate_up, down in experts:
            for part, t in (("gate_up", gate_up), ("down", down)):
                if next(todo, None) != (layer, part):
                    raise ValueError(f"expert tensors out of order: layer {layer} {part} was not expected next")
                arr = t.detach().float().contiguous().numpy()
                data = (
                    arr
                    if qtype == "f32"
                    else arr.astype(np.float16)
                    if qtype == "f16"
                    else gguf.quants.quantize(arr, qt)
                )
                data = np.ascontiguousarray(data)
                digests[f"blk.{layer}.ffn_{part}_exps.weight"] = digest(data)
                w.write_tensor_data(data)
            del gate_up, down
        if next(todo, None) is not None:
            raise ValueError("the checkpoint yielded fewer MoE layers than its config declares")
        w.close()
        return publish(tmp, path, digests)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)  # written and renamed, or abandoned: no half file stays
