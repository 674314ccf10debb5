"""The expert file's layout, shared by its writer (`gguf_write`), checksums (`gguf_checksums`), reader
(`gguf_experts`) and decoder (`gguf_decode`), and by llama.cpp's head split (`engines/llama_gguf`).

Layout (llama.cpp's deepseek2 names, its fused gate/up form): per MoE layer l,
`blk.l.ffn_gate_up_exps.weight` [E, 2I, H] (expert e's gate rows, then its up rows) and
`blk.l.ffn_down_exps.weight` [E, H, I] (numpy order; ggml lists dims reversed). The expert is the
outermost dimension, so expert e of a tensor is one contiguous byte range: offset = data_offset +
e · (n_bytes / E), and loading one expert is two contiguous reads (gate_up, down). Data aligned to
4 KiB, so O_DIRECT reads of bf16/f16/f32 slices are aligned already. Keeping llama.cpp's layout
means the same file serves llama.cpp (platform mn's second engine) as split 2 of the model
(`split.no = 1`; `llama_gguf` writes split 1, the head).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

ALIGN = 4096
ARCH = "deepseek2"
TYPES = ("f32", "f16", "bf16", "q4_0")
PARTS = ("gate_up", "down")


class ExpertFileError(RuntimeError):
    """The GGUF file is missing, truncated, corrupt, or not an expert file this runtime can read."""


def qtype_of(name: str):
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q4_0": Q.Q4_0}[name]
