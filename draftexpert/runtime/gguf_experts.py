"""Routed experts in a GGUF file, in llama.cpp's own tensor layout, read whole per expert.

Layout (llama.cpp's deepseek2 names, its fused gate/up form): per MoE layer l,
`blk.l.ffn_gate_up_exps.weight` [E, 2I, H] (expert e's gate rows, then its up rows) and
`blk.l.ffn_down_exps.weight` [E, H, I] (numpy order; ggml lists dims reversed). The expert is the
outermost dimension, so expert e of a tensor is one contiguous byte range: offset = data_offset +
e · (n_bytes / E). Loading one expert is two contiguous reads (gate_up, down), not the three of
separate gate and up tensors: this storage serves ~20K small reads a second, so a read saved is
time saved (a layer's six Q4_0 experts staged cold: 0.91 vs 1.18 ms, docs/DESIGN.md). Two ways:
`advise` + `read_expert_cached` — readahead requested for every expert a layer needs (all in
flight in the kernel), then buffered reads that wait for each, the file's pages dropped afterwards
(`drop_all`; the flash store's default, llama.cpp's staging too); or `read_expert` — O_DIRECT,
each read widened to 4 KiB-aligned bounds (the file's data alignment is 4 KiB, so bf16/f16/f32
slices are already aligned and Q4_0 slices cost at most one extra page a read). Keeping
llama.cpp's layout means the same file serves llama.cpp (platform mn's second engine) as split 2 of the model
(`split.no = 1`; `llama_gguf` writes split 1, the head).

Integrity: every file this module's writers produce has a sidecar `<file>.sha256.json` with the
sha256 of each tensor's bytes, written when the file is complete (a file without it is
unfinished). `verify_checksums` reads the tensors back and compares; it records the file's
size, mtime and inode when they match, so the next open checks only those (cheap) and reads
everything again only when the file has changed since — or when asked (`full=True`, what
`bench convert --verify` does).

Types: F32, F16, BF16, Q4_0 (18-byte blocks of 32 weights: an f16 scale d, then 16 bytes whose low
nibbles are weights 0–15 and high nibbles 16–31; w = d · (q − 8)), bit-identical to llama.cpp's.
Q4_0 is dequantised by ggml's own `dequantize_row_q4_0` (the format's reference code, from the
llama-cpp-python package, through ctypes: it releases the GIL, so the reader threads dequantise
in parallel; measured ~4× faster than the same arithmetic as torch ops on this CPU), else by
torch ops — the two are tested equal.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import queue
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from draftexpert.runtime.ggml_kernel import ggml_library

ALIGN = 4096
ARCH = "deepseek2"
TYPES = ("f32", "f16", "bf16", "q4_0")
PARTS = ("gate_up", "down")


class ExpertFileError(RuntimeError):
    """The GGUF file is missing, truncated, corrupt, or not an expert file this runtime can read."""


def _qtype(name: str):
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q4_0": Q.Q4_0}[name]


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
        raise ValueError(f"Q4_0 quantises rows in blocks of 32 weights: hidden {H} and "
                         f"moe_intermediate {inter} must both be multiples of 32 (use f16 or bf16)")
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
    qt = _qtype(qtype)
    shapes = {"gate_up": (E, 2 * inter, H), "down": (E, H, inter)}
    plan = [(layer, part) for layer in range(meta["first_dense"], meta["n_layer"]) for part in PARTS]
    for layer, part in plan:  # numpy order; element shapes, byte counts of the encoded type
        shape = shapes[part]
        n = int(np.prod(shape))
        nbytes = {"f32": 4 * n, "f16": 2 * n, "bf16": 2 * n, "q4_0": n // 32 * 18}[qtype]
        dtype = {"f32": np.float32, "f16": np.float16}.get(qtype, np.float32)
        w.add_tensor_info(f"blk.{layer}.ffn_{part}_exps.weight", shape, dtype, nbytes,
                          raw_dtype=qt if qtype in ("bf16", "q4_0") else None)
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
                data = (arr if qtype == "f32" else arr.astype(np.float16) if qtype == "f16"
                        else gguf.quants.quantize(arr, qt))
                data = np.ascontiguousarray(data)
                digests[f"blk.{layer}.ffn_{part}_exps.weight"] = _digest(data)
                w.write_tensor_data(data)
            del gate_up, down
        if next(todo, None) is not None:
            raise ValueError("the checkpoint yielded fewer MoE layers than its config declares")
        w.close()
        return _publish(tmp, path, digests)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)  # written and renamed, or abandoned: no half file stays


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).reshape(-1)).hexdigest()


def add_tensor(w, digests: dict[str, str], name: str, arr: np.ndarray, raw_dtype=None) -> None:
    """GGUFWriter.add_tensor, remembering the sha256 of the bytes it will write."""
    arr = np.ascontiguousarray(arr)
    digests[name] = _digest(arr)
    w.add_tensor(name, arr, raw_dtype=raw_dtype) if raw_dtype is not None else w.add_tensor(name, arr)


def checksum_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".sha256.json")


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def finish_atomic(w, tmp: Path, path: Path, digests: dict[str, str]) -> Path:
    """Write a GGUFWriter's file to `tmp`, move it to `path` in one step, then its checksums."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _publish(tmp, path, digests)


def _publish(tmp: Path, path: Path, digests: dict[str, str]) -> Path:
    """Move a finished file into place, then write its checksums."""
    checksum_path(path).unlink(missing_ok=True)  # until the new sidecar exists the file counts as unfinished
    os.replace(tmp, path)
    _write_sidecar(path, {"algorithm": "sha256", "tensors": digests, "verified": _stamp(path)})
    return path


def _write_sidecar(path: Path, data: dict) -> None:
    side = checksum_path(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, side)
    finally:
        tmp.unlink(missing_ok=True)


def verify_checksums(path: Path, full: bool = False) -> str | None:
    """None when `path` matches its checksums, else what is wrong. Without `full`, a file
    unchanged (size, mtime, inode) since it was last verified is not read again."""
    path = Path(path)
    side = checksum_path(path)
    try:
        data = json.loads(side.read_text())
        digests = data["tensors"]
    except (OSError, ValueError, KeyError):
        return f"it has no readable checksum file {side.name} (an unfinished or older file)"
    if not full and data.get("verified") == _stamp(path):
        return None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged header raises ValueError/struct.error/IndexError
        return f"its header is not readable GGUF ({type(e).__name__})"
    found = {t.name: t for t in reader.tensors}
    del reader
    if set(found) != set(digests):
        return f"it holds other tensors than were written ({len(found)} vs {len(digests)})"
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        for name, t in found.items():
            if t.data_offset + t.n_bytes > size:
                return f"it is truncated (tensor {name} ends past the end)"
            h, left = hashlib.sha256(), int(t.n_bytes)
            f.seek(t.data_offset)
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    return f"it is truncated (tensor {name})"
                h.update(chunk)
                left -= len(chunk)
            if h.hexdigest() != digests[name]:
                return f"tensor {name} does not match its checksum (damaged bytes)"
    data["verified"] = _stamp(path)
    try:
        _write_sidecar(path, data)
    except OSError:
        pass  # a read-only cache only costs the full check next time
    return None


@dataclass
class RawExpert:
    """One expert's file bytes in a staging buffer: gate_up and down at `offsets` (their sizes are
    the layer's slice sizes). `pooled` buffers go back to the file's staging pool after decoding."""

    layer: int
    buf: object  # mmap (pooled, page-aligned) or bytearray (a staged copy)
    offsets: tuple[int, int]
    pooled: bool = True


@dataclass
class _Slice:
    offset: int  # file offset of expert 0
    nbytes: int  # bytes of one expert's slice
    shape: tuple[int, int]  # one expert's [rows, cols]
    qtype: str
    n_experts: int


class ExpertFile:
    """Index of a GGUF expert file and reads of single experts (readahead + buffered, or O_DIRECT)."""

    def __init__(self, path: Path, staging_buffers: int = 16, direct: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise ExpertFileError(f"{self.path}: no such expert file (write it with `bench convert`)")
        if checksum_path(self.path).exists():  # written by this suite: never read damaged bytes
            problem = verify_checksums(self.path)
            if problem:
                raise ExpertFileError(f"{self.path} is damaged: {problem}; delete it (and its .sha256.json) and "
                                      "rebuild it with `bench convert`")
        try:
            reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct.error/IndexError on damage
            raise ExpertFileError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        names = {
            gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.F16: "f16",
            gguf.GGMLQuantizationType.BF16: "bf16", gguf.GGMLQuantizationType.Q4_0: "q4_0",
        }
        size = self.path.stat().st_size
        self.slices: dict[tuple[int, str], _Slice] = {}
        for t in reader.tensors:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or not parts[2].endswith("_exps"):
                continue
            layer, part = int(parts[1]), parts[2][len("ffn_"):-len("_exps")]
            if t.tensor_type not in names:
                raise ExpertFileError(f"{self.path}: tensor {t.name} has type {t.tensor_type.name}; "
                                      f"supported: {', '.join(TYPES)}")
            n_exp, rows, cols = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])  # ggml order reversed
            if t.data_offset + t.n_bytes > size:
                raise ExpertFileError(f"{self.path}: truncated — tensor {t.name} ends at byte "
                                      f"{t.data_offset + t.n_bytes:,} but the file has {size:,}")
            self.slices[(layer, part)] = _Slice(t.data_offset, t.n_bytes // n_exp, (rows, cols), names[t.tensor_type],
                                                n_exp)
        if not self.slices:
            raise ExpertFileError(f"{self.path}: holds no routed-expert tensors (blk.N.ffn_*_exps.weight)")
        self.qtype = next(iter(self.slices.values())).qtype  # the experts' type (the writer gives every slice one)
        self.layers = sorted({layer for layer, _ in self.slices})
        for layer in self.layers:
            missing = [p for p in PARTS if (layer, p) not in self.slices]
            if missing:
                older = (" (separate gate and up tensors: an older version of this suite, or another converter, "
                         "wrote it; delete it and rebuild it with `bench convert`)" if (layer, "gate") in self.slices
                         else "")
                raise ExpertFileError(f"{self.path}: layer {layer} lacks ffn_{'/'.join(missing)}_exps{older}")
        # 0 buffers: an index only (no reads); `direct`: `read_expert` too (O_DIRECT)
        self.fd = self._open() if staging_buffers and direct else -1
        self.fd_cached = -1  # buffered reads through the page cache (`advise` / `read_expert_cached`)
        if staging_buffers:
            self.fd_cached = os.open(self.path, os.O_RDONLY)
            os.posix_fadvise(self.fd_cached, 0, 0, os.POSIX_FADV_RANDOM)  # reads read what they ask for: no read-ahead
        self.staging: queue.SimpleQueue = queue.SimpleQueue()  # page-aligned buffers, one per read in flight
        size = self._staging_size()
        for _ in range(staging_buffers):
            self.staging.put(mmap.mmap(-1, size))

    def _open(self) -> int:
        if not hasattr(os, "O_DIRECT"):
            raise ExpertFileError("O_DIRECT is not available on this OS; the flash store needs it")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            raise ExpertFileError(f"{self.path}: cannot open with O_DIRECT ({e.strerror}); the file system "
                                  "(tmpfs?) does not support direct I/O — put the file on a real disk") from e
        return fd

    def n_experts(self, layer: int) -> int:
        return self.slices[(layer, PARTS[0])].n_experts

    def expert_nbytes(self, layer: int) -> int:
        return sum(self.slices[(layer, p)].nbytes for p in PARTS)

    @staticmethod
    def _envelope(offset: int, nbytes: int) -> tuple[int, int]:
        """The 4 KiB-aligned [start, end) around a byte range, as O_DIRECT requires."""
        return offset // ALIGN * ALIGN, -(-(offset + nbytes) // ALIGN) * ALIGN

    def _staging_size(self) -> int:
        return max(sum(ALIGN + -(-s.nbytes // ALIGN) * ALIGN for s in (self.slices[(layer, p)] for p in PARTS))
                   for layer in self.layers)

    def read_expert(self, layer: int, e: int) -> RawExpert:
        """Two O_DIRECT reads (gate_up and down slices of expert e) into one pooled, page-aligned
        staging buffer, each widened to its 4 KiB envelope; bf16/f16/f32 slices land adjacent."""
        return self._read(layer, e, direct=True)

    def read_expert_cached(self, layer: int, e: int) -> RawExpert:
        """Buffered reads of expert e's gate_up and down (waiting for what `advise` started, or
        reading it now) into one pooled staging buffer, adjacent (one decode). The pages stay in the
        page cache until `drop_all` (the store calls it after every step / round: cold)."""
        return self._read(layer, e, direct=False)

    def _read(self, layer: int, e: int, direct: bool) -> RawExpert:
        buf = self.staging.get()
        view, pos, offsets = memoryview(buf), 0, []
        try:
            for part, (off, n) in zip(PARTS, self.ranges(layer, e)):
                start, end = self._envelope(off, n) if direct else (off, off + n)
                if os.preadv(self.fd if direct else self.fd_cached, [view[pos:pos + end - start]], start) \
                        < off + n - start:
                    raise ExpertFileError(f"{self.path}: short read of {part} expert {e} of layer {layer} "
                                          f"at byte {off:,}: file truncated?")
                offsets.append(pos + off - start)
                pos += end - start
        except BaseException:
            view.release()
            self.staging.put(buf)
            raise
        view.release()
        return RawExpert(layer, buf, tuple(offsets))

    def ranges(self, layer: int, e: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of expert e's gate_up and down slices."""
        return [(s.offset + e * s.nbytes, s.nbytes) for s in (self.slices[(layer, p)] for p in PARTS)]

    def advise(self, layer: int, e: int) -> None:
        """Put expert e's two ranges on their way into the page cache, without waiting
        (posix_fadvise WILLNEED: the kernel's asynchronous readahead — many in flight at once)."""
        for off, n in self.ranges(layer, e):
            os.posix_fadvise(self.fd_cached, off, n, os.POSIX_FADV_WILLNEED)

    def drop_all(self) -> None:
        """Evict the file's pages from the page cache (one call: `read_expert_cached`'s pages, and
        readahead no read waited for), so the next load reads the disk again."""
        os.posix_fadvise(self.fd_cached, 0, 0, os.POSIX_FADV_DONTNEED)

    def release(self, raw: RawExpert) -> None:
        """Give a pooled staging buffer back without decoding it (a reader that only measures)."""
        if raw.pooled:
            self.staging.put(raw.buf)

    def stage_copy(self, raw: RawExpert) -> RawExpert:
        """A copy of the expert's bytes that outlives the staging buffer (the DRAM staging budget)."""
        parts = [bytes(raw.buf[o:o + self.slices[(raw.layer, p)].nbytes]) for o, p in zip(raw.offsets, PARTS)]
        joined = bytearray(b"".join(parts))
        return RawExpert(raw.layer, joined, (0, len(parts[0])), pooled=False)

    def staged_nbytes(self, raw: RawExpert) -> int:
        return self.expert_nbytes(raw.layer)

    def expert_shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes `dequantize` returns for an expert of `layer`: gate_up [2I, H], down [H, I]."""
        return self.slices[(layer, "gate_up")].shape, self.slices[(layer, "down")].shape

    def expert_numel(self, layer: int) -> int:
        """Weights of one expert of `layer` (the size of `dequantize`'s flat `out`)."""
        (a, b), (c, d) = self.expert_shapes(layer)
        return a * b + c * d

    def dequantize(self, raw: RawExpert, device, dtype, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) in `dtype` on `device`: views of one flat tensor, new or
        `out` (contiguous, `expert_numel` elements); returns a pooled buffer to the pool. Gate_up
        and down adjacent in the buffer (`read_expert_cached`) decode in one call."""
        gu, d = (self.slices[(raw.layer, p)] for p in PARTS)
        ogu, od = raw.offsets
        (gu_rows, cols), down_shape = self.expert_shapes(raw.layer)
        n_gu = gu_rows * cols
        if out is None:
            out = torch.empty(n_gu + down_shape[0] * down_shape[1], device=device, dtype=dtype)
        try:
            if od == ogu + gu.nbytes:  # the whole expert in one run of bytes: one decode
                decode(raw.buf, ogu, gu.nbytes + d.nbytes, gu.qtype, (1, out.numel()), device, dtype,
                       out=out.view(1, -1))
            else:  # each part decoded in place (O_DIRECT reads land apart)
                for part, off, at in ((gu, ogu, 0), (d, od, n_gu)):
                    rows, c = part.shape
                    decode(raw.buf, off, part.nbytes, part.qtype, (rows, c), device, dtype,
                           out=out[at:at + rows * c].view(rows, c))
        finally:
            self.release(raw)
        return out[:n_gu].view(gu_rows, cols), out[n_gu:].view(down_shape)

    def read_quantized(self, layer: int, e: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantized(read_expert_cached(layer, e))` without the staging buffer: buffered reads of
        the two ranges straight into `out` (uint8, `expert_nbytes`; new if None) — one copy of the
        bytes (page cache → tensor) instead of two."""
        gu, d = (self.slices[(layer, p)] for p in PARTS)
        if gu.qtype != "q4_0":
            raise ExpertFileError(f"{self.path}: the ggml expert kernel takes Q4_0 experts, this file holds {gu.qtype}")
        (gu_shape, dn_shape), n = self.raw_shapes(layer), gu.nbytes + d.nbytes
        if out is None:
            out = torch.empty(n, dtype=torch.uint8)
        view = memoryview(out.numpy())
        try:
            at = 0
            for part, (off, nbytes) in zip(PARTS, self.ranges(layer, e)):
                if os.preadv(self.fd_cached, [view[at:at + nbytes]], off) < nbytes:
                    raise ExpertFileError(f"{self.path}: short read of {part} expert {e} of layer {layer} "
                                          f"at byte {off:,}: file truncated?")
                at += nbytes
        finally:
            view.release()
        return out[:gu.nbytes].view(gu_shape), out[gu.nbytes:n].view(dn_shape)

    def raw_shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of `quantized`'s pair: one row of file bytes per matrix row."""
        gu, d = (self.slices[(layer, p)] for p in PARTS)
        return (gu.shape[0], gu.nbytes // gu.shape[0]), (d.shape[0], d.nbytes // d.shape[0])

    def quantized(self, raw: RawExpert, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as the file's Q4_0 bytes, uint8 [2I, H/32·18] and [H, I/32·18] (views of
        one flat tensor, new or `out` of `expert_nbytes` bytes) — what the ggml expert kernel
        computes on; returns a pooled buffer to the pool."""
        gu, d = (self.slices[(raw.layer, p)] for p in PARTS)
        if gu.qtype != "q4_0":
            raise ExpertFileError(f"{self.path}: the ggml expert kernel takes Q4_0 experts, this file holds {gu.qtype}")
        (gu_shape, dn_shape), n = self.raw_shapes(raw.layer), gu.nbytes + d.nbytes
        if out is None:
            out = torch.empty(n, dtype=torch.uint8)
        try:
            at = 0
            for part, off in zip((gu, d), raw.offsets):
                out[at:at + part.nbytes].copy_(torch.frombuffer(raw.buf, dtype=torch.uint8, count=part.nbytes,
                                                                offset=off))
                at += part.nbytes
        finally:
            self.release(raw)
        return out[:gu.nbytes].view(gu_shape), out[gu.nbytes:].view(dn_shape)

    def close(self):
        for fd in (self.fd, self.fd_cached):
            if fd >= 0:
                os.close(fd)
        self.fd = self.fd_cached = -1


def _ggml_q4_0():
    """ggml's `dequantize_row_q4_0(src, dst, n)` from the llama-cpp-python package, or None."""
    path = ggml_library("ggml-base")
    if path is None:
        return None
    fn = ctypes.CDLL(str(path)).dequantize_row_q4_0
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


_Q4_0 = _ggml_q4_0()


def decode(buf, offset: int, nbytes: int, qtype: str, shape: tuple[int, int], device, dtype,
           use_ggml: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """`nbytes` file bytes at `offset` of `buf` holding a [rows, cols] matrix → a tensor in `dtype`
    on `device`, new or `out` (dequantised on the host by ggml for Q4_0 on a CPU accelerator, else
    moved raw and dequantised there; never a view of the staging buffer)."""
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    if qtype == "q4_0" and use_ggml and _Q4_0 is not None and torch.device(device).type == "cpu" \
            and (out is None or out.dtype == torch.float32):
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
