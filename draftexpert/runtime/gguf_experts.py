"""Reading a GGUF expert file: its index, single experts read whole (readahead + buffered, or
O_DIRECT) into pooled staging buffers, staged copies, and their decode into tensors.

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

A file this suite wrote is checked against its checksums before it is read (`gguf_checksums`); it is
written by `gguf_write` and its bytes decoded by `gguf_decode`.
"""

from __future__ import annotations

import mmap
import os
import queue
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from draftexpert.runtime.gguf_checksums import checksum_path, verify_checksums
from draftexpert.runtime.gguf_decode import decode
from draftexpert.runtime.gguf_layout import ALIGN, PARTS, TYPES, ExpertFileError


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
                raise ExpertFileError(
                    f"{self.path} is damaged: {problem}; delete it (and its .sha256.json) and "
                    "rebuild it with `bench convert`"
                )
        try:
            reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct.error/IndexError on damage
            raise ExpertFileError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        names = {
            gguf.GGMLQuantizationType.F32: "f32",
            gguf.GGMLQuantizationType.F16: "f16",
            gguf.GGMLQuantizationType.BF16: "bf16",
            gguf.GGMLQuantizationType.Q4_0: "q4_0",
        }
        size = self.path.stat().st_size
        self.slices: dict[tuple[int, str], _Slice] = {}
        for t in reader.tensors:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or not parts[2].endswith("_exps"):
                continue
            layer, part = int(parts[1]), parts[2][len("ffn_") : -len("_exps")]
            if t.tensor_type not in names:
                raise ExpertFileError(
                    f"{self.path}: tensor {t.name} has type {t.tensor_type.name}; supported: {', '.join(TYPES)}"
                )
            n_exp, rows, cols = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])  # ggml order reversed
            if t.data_offset + t.n_bytes > size:
                raise ExpertFileError(
                    f"{self.path}: truncated — tensor {t.name} ends at byte "
                    f"{t.data_offset + t.n_bytes:,} but the file has {size:,}"
                )
            self.slices[(layer, part)] = _Slice(
                t.data_offset, t.n_bytes // n_exp, (rows, cols), names[t.tensor_type], n_exp
            )
        if not self.slices:
            raise ExpertFileError(f"{self.path}: holds no routed-expert tensors (blk.N.ffn_*_exps.weight)")
        self.qtype = next(iter(self.slices.values())).qtype  # the experts' type (the writer gives every slice one)
        self.layers = sorted({layer for layer, _ in self.slices})
        for layer in self.layers:
            missing = [p for p in PARTS if (layer, p) not in self.slices]
            if missing:
                older = (
                    " (separate gate and up tensors: an older version of this suite, or another converter, "
                    "wrote it; delete it and rebuild it with `bench convert`)"
                    if (layer, "gate") in self.slices
                    else ""
                )
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
            raise ExpertFileError(
                f"{self.path}: cannot open with O_DIRECT ({e.strerror}); the file system "
                "(tmpfs?) does not support direct I/O — put the file on a real disk"
            ) from e
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
        return max(
            sum(ALIGN + -(-s.nbytes // ALIGN) * ALIGN for s in (self.slices[(layer, p)] for p in PARTS))
            for layer in self.layers
        )

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
                if (
                    os.preadv(self.fd if direct else self.fd_cached, [view[pos : pos + end - start]], start)
                    < off + n - start
                ):
                    raise ExpertFileError(
                        f"{self.path}: short read of {part} expert {e} of layer {layer} "
                        f"at byte {off:,}: file truncated?"
                    )
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
        parts = [bytes(raw.buf[o : o + self.slices[(raw.layer, p)].nbytes]) for o, p in zip(raw.offsets, PARTS)]
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

    def dequantize(
        self, raw: RawExpert, device, dtype, out: torch.Tensor | None = None
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
                decode(
                    raw.buf, ogu, gu.nbytes + d.nbytes, gu.qtype, (1, out.numel()), device, dtype, out=out.view(1, -1)
                )
            else:  # each part decoded in place (O_DIRECT reads land apart)
                for part, off, at in ((gu, ogu, 0), (d, od, n_gu)):
                    rows, c = part.shape
                    decode(
                        raw.buf,
                        off,
                        part.nbytes,
                        part.qtype,
                        (rows, c),
                        device,
                        dtype,
                        out=out[at : at + rows * c].view(rows, c),
                    )
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
                if os.preadv(self.fd_cached, [view[at : at + nbytes]], off) < nbytes:
                    raise ExpertFileError(
                        f"{self.path}: short read of {part} expert {e} of layer {layer} "
                        f"at byte {off:,}: file truncated?"
                    )
                at += nbytes
        finally:
            view.release()
        return out[: gu.nbytes].view(gu_shape), out[gu.nbytes : n].view(dn_shape)

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
                out[at : at + part.nbytes].copy_(
                    torch.frombuffer(raw.buf, dtype=torch.uint8, count=part.nbytes, offset=off)
                )
                at += part.nbytes
        finally:
            self.release(raw)
        return out[: gu.nbytes].view(gu_shape), out[gu.nbytes :].view(dn_shape)

    def close(self):
        for fd in (self.fd, self.fd_cached):
            if fd >= 0:
                os.close(fd)
        self.fd = self.fd_cached = -1
