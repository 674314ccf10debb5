"""Expert stores: where routed experts live and how they reach the accelerator.

All stores share one interface (`fetch` for the model; `prefetch`, `begin_block` / `end_block`
for speculation) and one accelerator-side cache with an in-flight set; they differ only in how one expert is loaded:

- `ResidentStore`  every expert already on the accelerator (the paper's resident reference).
- `HostStore`      platform cg: experts in host memory (a `HostPool`: one exact-size buffer in the
                   checkpoint's dtype, page-locked in place under CUDA), copied to the accelerator
                   on a dedicated CUDA stream with an event per expert and converted to the compute
                   dtype there, after the copy; without CUDA the accelerator is the CPU and the
                   copy runs on a worker thread (a real memcpy into accelerator-side tensors,
                   overlapping compute the same way).
- `FlashStore`     platform mn: experts in a GGUF file (`draftexpert.runtime.gguf_experts`), staged
                   whole on demand: readahead of every expert a forward needs issued at once (all
                   in flight in the kernel), then a buffered read of each as the forward takes it
                   (the file's pages dropped after every step and round: cold), dequantised on the
                   accelerator side; or, as an
                   ablation, O_DIRECT reads by a pool of reader threads. A DRAM staging budget
                   bounds the raw bytes kept between steps.

An expert reaches the model as (gate_up [2I, H], down [H, I]) in the compute dtype.
Cache: `cache_experts` expert slots kept on the accelerator between forwards (LRU); 0 — the
paper's cold setting — keeps nothing, so every forward loads all it needs (each unique expert once).
Every fetch reports requested / loaded / bytes / stall to the `Ledger`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from draftexpert.runtime.ggml_kernel import check_kernel
from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.ledger import Ledger

Key = tuple[int, int]  # (layer, expert)


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `t`'s memory, the temporary one this call
    makes included (PyTorch's storage use count)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class ExpertBuffers:
    """The host-side buffers loaded experts are decoded into, reused once nothing holds them.

    Without it every load allocates fresh 10-30 MiB tensors from reader threads, and glibc keeps
    what is freed (below its dynamic mmap threshold, in per-thread arenas, fragmented): measured on
    DS-V2-Lite, 2.5 GiB kept after a prefill with no expert alive, 6.2 GiB after a round — memory
    outside the plan, which counts only live experts. Here a freed expert's buffer is the next
    load's, so the store's memory is its peak of live experts, what the plan bounds. A buffer is
    free when only the pool references its memory: every caller gets a view (its own tensor), so
    any tensor or view a caller still holds keeps the buffer out of reuse."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free_at: dict[tuple, int] = {}
        self._bufs: dict[tuple, list[torch.Tensor]] = {}
        self.nbytes = 0  # everything the pool holds, in use or free

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of `shape` no one else holds (its contents are stale)."""
        key = (tuple(shape), dtype)
        with self._lock:
            bufs = self._bufs.setdefault(key, [])
            n, start = len(bufs), self._free_at.get(key, 0)
            for j in range(n):
                i = (start + j) % n
                if _storage_uses(bufs[i]) == 2:  # the pool's tensor and the call's storage object
                    self._free_at[key] = i + 1
                    return bufs[i].view(shape)
            t = torch.empty(shape, dtype=dtype)
            bufs.append(t)
            self.nbytes += t.nbytes
            return t.view(shape)

    def in_use_bytes(self) -> int:
        with self._lock:
            return sum(t.nbytes for bufs in self._bufs.values() for t in bufs if _storage_uses(t) > 2)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
            self._free_at.clear()
            self.nbytes = 0


class ExpertStore:
    name = "base"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        cache_experts: int = 0,
        ledger: Ledger | None = None,
        dtype: torch.dtype = torch.float32,
        working_set_bytes: int = 0,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.capacity = cache_experts
        self.cache: OrderedDict[Key, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.inflight: dict[Key, object] = {}
        self.block: OrderedDict[Key, tuple[torch.Tensor, torch.Tensor]] | None = None  # open draft → verify round
        self.ledger = ledger or Ledger()
        if self.device.type == "cuda":
            self.ledger.use_cuda(self.device)
        # a round's working set on the accelerator, in bytes (0: unbounded): past it, the round's least
        # recently used experts are dropped (reloaded on demand if needed again) and prefetch holds back
        self.working_set_bytes = working_set_bytes
        self.block_bytes = self.peak_block_bytes = 0
        self._one_expert = 0  # accelerator bytes of one loaded expert (learned from the first load)

    # -- what a store implements --------------------------------------------------------
    def expert_bytes(self, key: Key) -> int:
        """Bytes moved to load one expert from this store."""
        raise NotImplementedError

    def _start(self, key: Key, demand: bool = True):
        """Begin loading one expert without blocking; return a handle. `demand`: a forward waits for
        it now (else a prefetch: a store may queue it behind demand loads)."""
        raise NotImplementedError

    def _finish(self, handle) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until a load is done; return (gate_up, down) on the accelerator."""
        raise NotImplementedError

    def end_forward(self) -> None:
        """A forward of the model ended (the model calls it after each)."""

    # -- shared machinery ---------------------------------------------------------------
    def begin_block(self) -> None:
        """Open a draft → verify round: experts moved to the accelerator during the round stay
        there until `end_block` (the round's working set — Algorithm 1's C ∪ P), so a verifier
        reuses what the drafter or a prefetch already moved. Nothing outlives the round unless
        the LRU cache keeps it — and, with `working_set_bytes`, no more than that many bytes."""
        self.block = OrderedDict()
        self.block_bytes = 0

    def end_block(self) -> None:
        """Close the round. Unfinished prefetches are dropped unwaited (their bytes were issued:
        waste if verification did not use them)."""
        self.block = None
        self.block_bytes = 0
        self.inflight.clear()

    def _hold(self, key: Key, w) -> None:
        """Keep a loaded expert in the round's block, within the working-set budget (LRU out)."""
        b = sum(t.numel() * t.element_size() for t in w)
        self._one_expert = b
        if self.working_set_bytes:
            while self.block and self.block_bytes + b > self.working_set_bytes:
                _, old = self.block.popitem(last=False)
                self.block_bytes -= sum(t.numel() * t.element_size() for t in old)
        self.block[key] = w
        self.block_bytes += b
        self.peak_block_bytes = max(self.peak_block_bytes, self.block_bytes)

    def _make_room(self, loads: int, keep: set[Key]) -> None:
        """Before `loads` demand loads start: drop the round's least recently used experts (not
        those in `keep`, the forward's own) until the block, the loads in flight and these fit the
        working-set budget — loads in flight hold their experts' memory too, so the budget is what
        the store holds, not only what it has finished."""
        if not self.working_set_bytes or not self._one_expert:
            return
        need = (len(self.inflight) + loads) * self._one_expert
        for key in [k for k in self.block if k not in keep]:
            if self.block_bytes + need <= self.working_set_bytes:
                break
            old = self.block.pop(key)
            self.block_bytes -= sum(t.numel() * t.element_size() for t in old)

    def _room_for_prefetch(self) -> bool:
        """Whether one more prefetch fits beside the round's block and the loads in flight."""
        if not self.working_set_bytes or not self._one_expert:
            return True
        return self.block_bytes + (len(self.inflight) + 1) * self._one_expert <= self.working_set_bytes

    def resident_keys(self) -> set[Key]:
        """Keys on the accelerator now without a pending load (cache ∪ the round's finished loads)."""
        return set(self.cache) | set(self.block or ())

    def _available(self, key: Key) -> bool:
        return key in self.cache or key in self.inflight or (self.block is not None and key in self.block)

    def prefetch(self, layer: int, experts: list[int]) -> list[int]:
        """Start non-blocking loads of the experts that are neither on the accelerator nor in
        flight; return them. Counted by the ledger as prefetch issued / bytes."""
        started = []
        for e in experts:
            key = (layer, e)
            if not self._available(key):
                if not self._room_for_prefetch():
                    break  # the working set is full: the rest load on demand if verification needs them
                self.inflight[key] = self._start(key, demand=False)
                self.ledger.record_prefetch(1, self.expert_bytes(key))
                started.append(e)
        if started:
            self._note_held(set())
        return started

    def _note_held(self, using: set[Key]) -> None:
        """Tell the ledger how many experts are on the accelerator or on their way now: the cache,
        the round's working set, loads in flight, and the layer's experts being computed with (one
        tensor each, however many of these hold it) — the oracle's capacity is the peak."""
        self.ledger.note_resident(len(set(self.cache).union(self.block or (), self.inflight, using)))

    def fetch(self, layer: int, experts: list[int], phase: str = "ar") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(gate_up, down) for each expert of `layer`, loading what is missing; blocks until ready."""
        return list(self.fetch_iter(layer, experts, phase))

    def fetch_iter(self, layer: int, experts: list[int], phase: str = "ar"):
        """`fetch`, yielding each expert as soon as it is on the accelerator (in `experts`' order),
        so the caller computes with the first while the others still load. Ledger (once every
        expert was yielded): requested = len(experts); loads / bytes = the on-demand loads this
        call started; stall = the wall time spent waiting (on them and on unfinished prefetches)."""
        missing = [e for e in experts if not self._available((layer, e))]
        nbytes = sum(self.expert_bytes((layer, e)) for e in missing)
        if missing and self.block is not None:
            self._make_room(len(missing), {(layer, e) for e in experts})
        for e in missing:  # start every missing load before waiting on any: reads overlap
            self.inflight[(layer, e)] = self._start((layer, e))
        ready = {}
        for e in experts:  # take what is on the accelerator before a finished load can evict it (LRU)
            key = (layer, e)
            if key in self.cache:
                self.cache.move_to_end(key)
                ready[e] = self.cache[key]
            elif self.block is not None and key in self.block:
                self.block.move_to_end(key)
                ready[e] = self.block[key]
        stall = 0.0
        for e in experts:
            if e not in ready:
                key = (layer, e)
                t0 = time.perf_counter()
                ready[e] = w = self._finish(self.inflight.pop(key))
                stall += time.perf_counter() - t0
                self._remember(key, w)
                if self.block is not None:
                    self._hold(key, w)
            yield ready[e]
        self.ledger.record(layer, len(experts), len(missing), nbytes, stall, experts)
        if missing:  # only a load changes what is held
            self._note_held({(layer, e) for e in experts})

    def _remember(self, key: Key, w) -> None:
        if self.capacity <= 0:
            return
        self.cache[key] = w
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def close(self) -> None:
        pass


class ResidentStore(ExpertStore):
    """Every routed expert on the accelerator: fetch never loads."""

    name = "resident"

    def __init__(self, gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor], **kw):
        super().__init__(**kw)
        # layer → [E, 2I, H] and [E, H, I]; uint8 [E, 2I, H/32·18], [E, H, I/32·18]: Q4_0 bytes for the ggml kernel
        cast = lambda v: v.to(self.device) if v.dtype == torch.uint8 else v.to(self.device, self.dtype)  # noqa: E731
        self.gate_up = {k: cast(v) for k, v in gate_up.items()}
        self.down = {k: cast(v) for k, v in down.items()}
        for layer in self.gate_up:
            for e in range(self.gate_up[layer].shape[0]):
                self.cache[(layer, e)] = (self.gate_up[layer][e], self.down[layer][e])
        self.capacity = len(self.cache)

    def expert_bytes(self, key):
        return 0


class HostPool:
    """The routed experts of every MoE layer in one flat host buffer of exactly their size.

    Views give per-layer gate_up [E, 2I, H] and down [E, H, I], contiguous so that one expert is
    one copy each. The loader fills it expert by expert from the checkpoint's shards (no stacked
    per-layer copy, no pageable duplicate kept while pinning); `pin()` then page-locks the buffer
    in place with `cudaHostRegister` — exact size, where PyTorch's pinned allocator would round
    each allocation up to a power of two (a 704 MiB tensor takes 1 GiB)."""

    def __init__(self, layers: list[int], experts: int, hidden: int, inter: int, dtype: torch.dtype):
        per_gu, per_dn = experts * 2 * inter * hidden, experts * hidden * inter
        self.flat = torch.empty(len(layers) * (per_gu + per_dn), dtype=dtype)
        self.gate_up, self.down = {}, {}
        for j, layer in enumerate(layers):
            base = j * (per_gu + per_dn)
            self.gate_up[layer] = self.flat[base : base + per_gu].view(experts, 2 * inter, hidden)
            self.down[layer] = self.flat[base + per_gu : base + per_gu + per_dn].view(experts, hidden, inter)
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def pin(self) -> None:
        """Page-lock the buffer where it is (CUDA), so copies from it run asynchronously."""
        if self.pinned:
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.flat.nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(
                f"cudaHostRegister of the {self.flat.nbytes / 2**30:.1f} GiB expert pool failed "
                f"(error {int(rc)}): not enough lockable memory? (ulimit -l, or a smaller model)"
            )
        self.pinned = True

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned = False


class HostStore(ExpertStore):
    """Platform cg: experts in host memory, copied to the accelerator per load."""

    name = "host"

    def __init__(
        self, gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor], pool: HostPool | None = None, **kw
    ):
        super().__init__(**kw)
        cuda = self.device.type == "cuda"
        self.pool = pool
        if cuda and pool is not None:
            pool.pin()  # in place, exact size
            self.gate_up, self.down = dict(gate_up), dict(down)
        else:  # host pool: per-layer [E, 2I, H] / [E, H, I], contiguous so one expert is one copy each
            self.gate_up = {k: (v.contiguous().pin_memory() if cuda else v.contiguous()) for k, v in gate_up.items()}
            self.down = {k: (v.contiguous().pin_memory() if cuda else v.contiguous()) for k, v in down.items()}
        # two copy streams: a forward's demand loads (high priority) never queue behind a round's prefetches
        self.stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.prefetch_stream = torch.cuda.Stream(self.device) if cuda else None
        self.worker = None if cuda else ThreadPoolExecutor(1, thread_name_prefix="h2d")  # the "copy stream"

    def expert_bytes(self, key):
        layer, e = key
        return self.gate_up[layer][e].nbytes + self.down[layer][e].nbytes

    def _copy(self, key):
        """One expert to the accelerator in the pool's dtype, then converted there (never on the host)."""
        layer, e = key
        out = []
        for t in (self.gate_up[layer][e], self.down[layer][e]):
            dev = torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=True)
            out.append(dev if dev.dtype == self.dtype else dev.to(self.dtype))
        return tuple(out)

    def _start(self, key, demand=True):
        if self.stream is None:
            return self.worker.submit(self._copy, key)
        stream = self.stream if demand else self.prefetch_stream
        with torch.cuda.stream(stream):
            w = self._copy(key)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
        return key, w, ev

    def _finish(self, handle):
        if isinstance(handle, Future):
            return handle.result()
        key, w, ev = handle
        compute = torch.cuda.current_stream(self.device)
        needed = torch.cuda.Event(enable_timing=True)
        needed.record(compute)
        compute.wait_event(ev)  # the GPU waits, not the host: the ledger times the wait with the two events
        self.ledger.record_gpu_wait(key[0], needed, ev)
        for t in w:  # tensors made on a copy stream are used on the compute stream
            t.record_stream(compute)
        return w

    def close(self):
        if self.worker:
            self.worker.shutdown(wait=True)
        if self.stream is not None:
            self.stream.synchronize()  # no copy may still read the pool when it is unpinned
            self.prefetch_stream.synchronize()
        if self.pool is not None:
            self.pool.unpin()


STAGING = {  # how the flash store reads an expert (recorded in every record's method_args)
    "demand": "whole experts on demand: readahead (fadvise WILLNEED) of every expert a forward needs, all in "
    "flight in the kernel, then a buffered read of each, decoded on the forward's thread as it arrives; "
    "the file's pages dropped after every AR step and round",
    "odirect": "whole experts on demand with O_DIRECT, read and decoded by a pool of reader threads (several "
    "reads in flight)",
}


class FlashStore(ExpertStore):
    """Platform mn: experts read from a GGUF file, whole, dequantised on the accelerator.

    `staging` "demand" (default): a load is readahead issued for the expert's two ranges when it
    starts (a forward starts all it needs before waiting for any; a prefetch starts when the drafter
    predicts it), and a buffered read that waits for it when the model takes it — the same mechanism
    as llama.cpp's demand staging, no threads: on 2 cores six Python reader threads cost
    more in handoffs than the reads themselves (`bench speed flash`). "odirect": the reader-thread
    pool with O_DIRECT reads, decoding on the readers (the ablation)."""

    name = "flash"

    def __init__(
        self,
        path: Path,
        io_threads: int = 6,
        staging_budget_bytes: int = 0,
        staging: str = "demand",
        kernel: str = "dequant",
        **kw,
    ):
        if staging not in STAGING:
            raise ValueError(f"--staging: {staging!r} is not one of {', '.join(STAGING)}")
        super().__init__(**kw)
        self.kernel = kernel  # "ggml": experts handed over as their Q4_0 bytes (`ggml_kernel`), not dequantised
        odirect = staging == "odirect"
        # a staging buffer per read in flight: the readers' (odirect), or the forward's one read at a time
        self.file = ExpertFile(Path(path), staging_buffers=io_threads if odirect else 1, direct=odirect)
        if kernel != "dequant":
            check_kernel(kernel, self.file.qtype, self.device)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="odirect") if odirect else None
        self.budget = staging_budget_bytes
        self.staged: OrderedDict[Key, bytes] = OrderedDict()  # raw file bytes kept in DRAM
        self.staged_bytes = 0
        # CPU accelerator: experts decoded into reused buffers (`ExpertBuffers`); CUDA's caching
        # allocator already reuses device memory
        self.buffers = (
            ExpertBuffers() if self.device.type == "cpu" and hasattr(torch._C, "_storage_Use_Count") else None
        )

    def expert_bytes(self, key):
        return 0 if key in self.staged else self.file.expert_nbytes(key[0])

    def _load(self, key, staged):
        """Read (the staged DRAM copy, else from the file) and decode one expert; on a reader
        thread ("odirect") or the forward's ("demand"). Decoding returns the staging buffer at
        once: a reader holds at most one."""
        if self.kernel == "ggml" and self.pool is None and staged is None and self.budget == 0:
            out = None if self.buffers is None else self.buffers.take((self.file.expert_nbytes(key[0]),), torch.uint8)
            return self.file.read_quantized(*key, out=out), None  # page cache → the tensor, no staging copy
        if staged is not None:
            raw = staged
        else:
            raw = self.file.read_expert(*key) if self.pool is not None else self.file.read_expert_cached(*key)
        keep = self.file.stage_copy(raw) if self.budget > 0 and staged is None else None
        if self.kernel == "ggml":
            out = None if self.buffers is None else self.buffers.take((self.file.expert_nbytes(key[0]),), torch.uint8)
            return self.file.quantized(raw, out=out), keep
        out = None if self.buffers is None else self.buffers.take((self.file.expert_numel(key[0]),), self.dtype)
        return self.file.dequantize(raw, self.device, self.dtype, out=out), keep

    def _start(self, key, demand=True):
        staged = self.staged.get(key)
        if staged is not None:
            self.staged.move_to_end(key)
        if self.pool is not None:
            return key, self.pool.submit(self._load, key, staged)
        if staged is None:
            self.file.advise(*key)  # in flight from now; `_finish` waits for it
        return key, staged

    def _finish(self, handle):
        key, job = handle
        weights, keep = job.result() if isinstance(job, Future) else self._load(key, job)
        if keep is not None and key not in self.staged:
            self.staged[key] = keep
            self.staged_bytes += self.file.staged_nbytes(keep)
            while self.staged_bytes > self.budget and self.staged:
                _, old = self.staged.popitem(last=False)
                self.staged_bytes -= self.file.staged_nbytes(old)
        return weights

    def end_forward(self):
        if self.block is None and self.pool is None:  # AR: nothing this step read stays in the page cache
            self.file.drop_all()

    def end_block(self):
        """Readahead no forward waited for is let land first (pages still under I/O cannot be
        evicted, and would reach the next round as free, unmetered loads — the llama.cpp engine's
        `end_round` waits the same way; the bytes were issued, their bandwidth is spent either way),
        then every page the round read leaves the cache."""
        if self.pool is None:
            for key, staged in self.inflight.values():
                if staged is None:
                    self.file.release(self.file.read_expert_cached(*key))
        super().end_block()
        if self.pool is None:
            self.file.drop_all()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.file.close()
        if self.buffers is not None:
            self.buffers.clear()
