"""Routed experts computed on their Q4_0 blocks by ggml's CPU kernels — llama.cpp's own (the input
quantised to Q8_0 per row, SIMD q4_0 · q8_0 dot products) — instead of dequantising every loaded
expert to fp32 first and multiplying that.

Why (ds-tiny, one expert of 98,304 weights, a 2-core x86 CPU, 1 thread): dequantising in place after the read
costs ~140 µs (ggml's scalar `dequantize_row_q4_0`) and the two fp32 matmuls ~40 µs more, while
the whole expert MLP on the blocks costs ~12 µs plus ~15 µs of Python/ctypes around it. A
decoded token runs 30 experts.

An expert in this form is the pair of raw Q4_0 matrices as uint8 tensors, the file's bytes
unchanged: gate_up [2I, H/32·18] (gate rows, then up rows) and down [H, I/32·18]. `expert_mlp`
is `MoEModel.mlp` for such a pair.

Batch-invariant: each output element is one dot product of one weight row with one input row
(each input row quantised to Q8_0 on its own), whatever the number of rows — a verify block computes
what one-token steps compute, so speculative decoding stays exact (llama.cpp built without
llamafile's sgemm, as the Makefile builds it; `tests/test_runtime.py` checks row by row).
No autograd: distillation through the runtime (`RuntimeTeacher`) uses the dequantising kernel.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import gguf
import torch

KERNELS = ("dequant", "ggml")  # `--expert-kernel`: how the torch engine computes a Q4_0 expert on a CPU
GGML_F32, GGML_Q4_0 = 0, 2  # enum ggml_type
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (fp16 scale + 16 bytes of nibbles)


class KernelError(ValueError):
    """The ggml kernel cannot run here (no llama-cpp-python build, or an expert it does not take)."""


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def ggml_library(name: str) -> Path | None:
    """The path of ggml library `name` (e.g. "ggml-base") shipped in the llama-cpp-python package, or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib"
    return next((p for p in (lib / f"lib{name}.so", lib / f"lib{name}.dylib", lib / f"{name}.dll") if p.exists()), None)


@functools.cache  # loaded and initialised once per process (a failure is not cached: it raises)
def _libs():
    paths = ggml_library("ggml-base"), ggml_library("ggml-cpu")
    if None in paths:
        raise KernelError(
            "--expert-kernel ggml needs llama-cpp-python (ggml's CPU kernels): `make install` "
            "builds it, or use --expert-kernel dequant"
        )
    lib = paths[0].parent
    try:
        base, cpu = (ctypes.CDLL(str(p)) for p in paths)
    except OSError as e:
        raise KernelError(f"ggml's libraries in {lib} did not load ({e}); use --expert-kernel dequant") from e
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, args, res in [
        ("ggml_init", [_InitParams], vp),
        ("ggml_free", [vp], None),
        ("ggml_new_tensor_2d", [vp, ctypes.c_int, i64, i64], vp),
        ("ggml_mul_mat", [vp, vp, vp], vp),
        ("ggml_swiglu", [vp, vp], vp),
        ("ggml_get_data", [vp], vp),
        ("ggml_new_graph_custom", [vp, ctypes.c_size_t, ctypes.c_bool], vp),
        ("ggml_build_forward_expand", [vp, vp], None),
    ]:
        f = getattr(base, name)
        f.argtypes, f.restype = args, res
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    cpu.ggml_cpu_init()
    return base, cpu


class _Ggml:
    """ggml contexts over Python-owned arenas (nothing allocated by ggml itself): one-row calls
    (decoding) reuse a graph built once per expert shape; a call of n rows builds its own in a
    reused arena. Nothing is copied in or out: for each call the graph's weights, input and output
    point at the caller's tensors (the expert's bytes as the store holds them, as llama.cpp computes
    on its mmapped file). The Q8_0 work buffer of each compute lives in a scratch context freed
    after it. A one-row call costs ~10 µs of Python and ctypes beside ggml's compute."""

    def __init__(self):
        self.base, self.cpu = _libs()
        self.arena = ctypes.create_string_buffer(1 << 20)
        self.scratch = ctypes.create_string_buffer(64 << 10)
        # the weights' shapes → (arena, ctx, graph, the data pointers of the weights, X and y)
        self.one_row: dict[tuple[int, int, int], tuple] = {}
        self.data_field = self._data_field()

    def _data_field(self) -> int:
        """The byte offset of `data` in `struct ggml_tensor` (ggml.h has a getter, no setter): the
        one word of a fresh tensor that holds `ggml_get_data`'s answer — found once, checked unique."""
        b, arena = self.base, ctypes.create_string_buffer(16 << 10)
        ctx = b.ggml_init(_InitParams(len(arena), ctypes.addressof(arena), False))
        try:
            t = b.ggml_new_tensor_2d(ctx, GGML_F32, 4, 4)
            want = b.ggml_get_data(t)
            found = [8 * i for i, w in enumerate((ctypes.c_void_p * 64).from_address(t)) if w == want]
        finally:
            b.ggml_free(ctx)
        if len(found) != 1:
            raise KernelError(
                "this ggml build's tensor struct is not the one this kernel knows; use --expert-kernel dequant"
            )
        return found[0]

    def _graph(self, arena, n: int, H: int, shapes: tuple[tuple[int, int], ...]):
        """A graph over `len(shapes)` Q4_0 weights W_j [rows_j, cols_j] (numpy order) and an input
        X [n, H]: one weight, W·x (a linear layer); two, the MLP W_2 · swiglu(W_1 · x)."""
        b = self.base
        ctx = b.ggml_init(_InitParams(len(arena), ctypes.addressof(arena), False))
        W = [b.ggml_new_tensor_2d(ctx, GGML_Q4_0, cols, rows) for rows, cols in shapes]  # ggml order: ne0 = row length
        X = b.ggml_new_tensor_2d(ctx, GGML_F32, H, n)
        y = b.ggml_mul_mat(ctx, W[0], X)
        if len(W) == 2:
            y = b.ggml_mul_mat(ctx, W[1], b.ggml_swiglu(ctx, y))
        graph = b.ggml_new_graph_custom(ctx, 8, False)
        b.ggml_build_forward_expand(graph, y)
        # each tensor's `data` field, to set per call (their own arena bytes go unused)
        return ctx, graph, [ctypes.c_void_p.from_address(t + self.data_field) for t in (*W, X, y)]

    def _compute(self, graph, threads: int, work: int) -> None:
        if work > len(self.scratch):
            self.scratch = ctypes.create_string_buffer(max(work, 2 * len(self.scratch)))
        tmp = self.base.ggml_init(_InitParams(len(self.scratch), ctypes.addressof(self.scratch), False))
        try:
            if self.cpu.ggml_graph_compute_with_ctx(tmp, graph, threads) != 0:
                raise KernelError("ggml_graph_compute failed")
        finally:
            self.base.ggml_free(tmp)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """x [n, H] fp32 → down · swiglu(gate_up · x) [n, H] on the Q4_0 pair (uint8 rows)."""
        H, I2 = x.shape[1], gate_up.shape[0]
        if gate_up.shape[1] * Q4_0_BLOCK != H * Q4_0_BYTES or down.shape[1] * Q4_0_BLOCK * 2 != I2 * Q4_0_BYTES:
            raise KernelError(
                f"not a Q4_0 expert for hidden {H}: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
            )
        return self._run(x, (gate_up, down), ((I2, H), (down.shape[0], I2 // 2)))

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [n, H] fp32 → w · x [n, rows] on a Q4_0 matrix (uint8 [rows, H/32·18])."""
        H = x.shape[1]
        if w.shape[1] * Q4_0_BLOCK != H * Q4_0_BYTES:
            raise KernelError(f"not a Q4_0 matrix of row length {H}: {tuple(w.shape)}")
        return self._run(x, (w,), ((w.shape[0], H),))

    def _run(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], shapes: tuple[tuple[int, int], ...]):
        n, H = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        weights = [w.contiguous() for w in weights]
        out = torch.empty(n, shapes[-1][0], dtype=torch.float32)
        work = 2 * n * (H + shapes[0][0]) + (8 << 10)  # the Q8_0 copies of x and of the activation
        if n == 1:
            plan = self.one_row.get(shapes)
            if plan is None:
                arena = ctypes.create_string_buffer(_arena_bytes(1, H, weights, shapes))
                plan = self.one_row[shapes] = (arena, *self._graph(arena, 1, H, shapes))
            _, ctx, graph, data = plan
        else:
            need = _arena_bytes(n, H, weights, shapes)
            if need > len(self.arena):
                self.arena = ctypes.create_string_buffer(max(need, 2 * len(self.arena)))
            ctx, graph, data = self._graph(self.arena, n, H, shapes)
        try:
            for field, t in zip(data, (*weights, x, out)):
                field.value = t.data_ptr()  # ggml reads and writes the caller's tensors (alive until this returns)
            # a thread pool per call: not for a few rows
            self._compute(graph, 1 if n < 16 else torch.get_num_threads(), work)
        finally:
            if n != 1:
                self.base.ggml_free(ctx)
        return out


def _arena_bytes(n: int, H: int, weights, shapes) -> int:
    """A graph's arena: the tensors' headers and (unused) weight data, the input, the activations
    between the matmuls and the output, the graph."""
    return sum(w.numel() for w in weights) + 4 * n * (H + 2 * sum(r for r, _ in shapes)) + (32 << 10)


_KERNEL: _Ggml | None = None


def _kernel_for(x: torch.Tensor) -> _Ggml:
    global _KERNEL
    if x.requires_grad:
        raise KernelError(
            "the ggml expert kernel has no backward: distil through the runtime with --expert-kernel dequant"
        )
    if not x.is_cpu:
        raise KernelError(f"the ggml expert kernel runs on the CPU, not {x.device}")
    if _KERNEL is None:
        _KERNEL = _Ggml()
    return _KERNEL


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`MoEModel.mlp` for an expert (or any SwiGLU MLP) held as raw Q4_0 (x [n, H] → [n, H], in x's dtype)."""
    return _kernel_for(x).mlp(x, gate_up, down).to(x.dtype)


def q4_0_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, W)` for W held as raw Q4_0 (uint8 [rows, H/32·18]): x [n, H] → [n, rows], in x's dtype."""
    return _kernel_for(x).linear(x, w).to(x.dtype)


def quantize_q4_0(w: torch.Tensor, rows_at_once: int = 4096) -> torch.Tensor:
    """A float matrix [rows, cols] (cols a multiple of 32) → its Q4_0 blocks, uint8 [rows, cols/32·18] —
    gguf's quantiser, bit-identical to llama.cpp's (the bytes `llama_gguf` writes into a Q4_0 head).
    Quantised `rows_at_once` rows at a time: the quantiser's float temporaries stay a few MB even
    for DS-V2-Lite's LM head (102,400 rows)."""
    if w.ndim != 2 or w.shape[1] % Q4_0_BLOCK:
        raise KernelError(
            f"Q4_0 quantises rows of whole {Q4_0_BLOCK}-weight blocks; got a matrix of shape {tuple(w.shape)}"
        )
    out = torch.empty(w.shape[0], w.shape[1] // Q4_0_BLOCK * Q4_0_BYTES, dtype=torch.uint8)
    for i in range(0, w.shape[0], rows_at_once):
        rows = w[i : i + rows_at_once].detach().float().cpu().numpy()
        out[i : i + rows_at_once] = torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_0))
    return out


def check_kernel(kernel: str, expert_type: str | None, device: str) -> None:
    """Refuse a kernel that does not apply: ggml takes Q4_0 experts on a CPU accelerator."""
    if kernel not in KERNELS:
        raise KernelError(f"--expert-kernel: {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "ggml" and (expert_type != "q4_0" or torch.device(device).type != "cpu"):
        raise KernelError(
            f"--expert-kernel ggml computes Q4_0 experts on the CPU (here: "
            f"{expert_type or 'the checkpoint'} experts on {device}); use --expert-kernel dequant"
        )


def available() -> bool:
    try:
        _libs()
    except KernelError:
        return False
    return True


def resolve_kernel(kernel: str, expert_type: str | None, device: str) -> str:
    """`--expert-kernel` → the kernel a torch run uses. "auto": ggml for Q4_0 experts from a file on a
    CPU accelerator (where it applies and llama-cpp-python is installed), else dequant. An explicit
    choice that does not apply is refused. (With --compile the kernel runs inside the op
    `draftexpert::routed_experts`, outside the compiled graph.)"""
    if kernel == "auto":
        use = expert_type == "q4_0" and torch.device(device).type == "cpu" and available()
        return "ggml" if use else "dequant"
    check_kernel(kernel, expert_type, device)
    return kernel
