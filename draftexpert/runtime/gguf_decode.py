"""File bytes of one matrix → a tensor: F32, F16, BF16 by a view and a cast, Q4_0 by ggml or torch ops.

Types: F32, F16, BF16, Q4_0 (18-byte blocks of 32 weights: an f16 scale d, then 16 bytes whose low
nibbles are weights 0–15 and high nibbles 16–31; w = d · (q − 8)), bit-identical to llama.cpp's.
Q4_0 is dequantised by ggml's own `dequantize_row_q4_0` (the format's reference code, from the
llama-cpp-python package, through ctypes: it releases the GIL, so the reader threads dequantise
in parallel; measured ~4× faster than the same arithmetic as torch ops on this CPU), else by
torch ops — the two are tested equal.

"""

from __future__ import annotations

import ctypes

import torch

from draftexpert.runtime.ggml_kernel import ggml_library


def _ggml_q4_0():
    """ggml's `dequantize_row_q4_0(src, dst, n)` from the llama-cpp-python package, or None."""
    path = ggml_library("ggml-base")
    if path is None:
        return None
    fn = ctypes.CDLL(str(path)).dequantize_row_q4_0
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


_Q4_0 = _ggml_q4_0()


def decode(
    buf,
    offset: int,
    nbytes: int,
    qtype: str,
    shape: tuple[int, int],
    device,
    dtype,
    use_ggml: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`nbytes` file bytes at `offset` of `buf` holding a [rows, cols] matrix → a tensor in `dtype`
    on `device`, new or `out` (dequantised on the host by ggml for Q4_0 on a CPU accelerator, else
    moved raw and dequantised there; never a view of the staging buffer)."""
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    if (
        qtype == "q4_0"
        and use_ggml
        and _Q4_0 is not None
        and torch.device(device).type == "cpu"
        and (out is None or out.dtype == torch.float32)
    ):
        dst = out if out is not None else torch.empty(shape, dtype=torch.float32)
        _Q4_0(raw.data_ptr(), dst.data_ptr(), dst.numel())
        return dst if dtype == torch.float32 else dst.to(dtype)
    if out is not None and qtype in ("f32", "f16", "bf16"):  # converted as it is copied: no temporary
        src = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[qtype]
        return out.copy_(raw.to(device).view(src).view(shape))
    if out is not None:
        return out.copy_(decode(buf, offset, nbytes, qtype, shape, device, dtype, use_ggml))
    raw = raw.to(device)
    if qtype in ("f32", "f16", "bf16"):
        src = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[qtype]
        return raw.view(src).view(shape).to(dtype, copy=True)
    rows, cols = shape  # q4_0: [rows, cols/32 blocks, 18 bytes]
    blocks = raw.view(rows, cols // 32, 18)
    d = blocks[..., :2].contiguous().view(torch.float16).to(dtype)  # [rows, nb, 1]
    qs = blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(dtype) - 8.0  # [rows, nb, 32]
    return (d * q).view(rows, cols)
