"""The llama.cpp engine (platform mn): AR, shared+top-r and DraftExpert on llama-cpp-python,
from the GGUF files `llama_gguf` writes (a head per model, the routed experts in one shared split).

Pieces:
- `LlamaModel`: one llama.cpp model and context with per-position logits (`logits_all`), KV
  rollback (`rollback` → `Llama.eval` trims the cache with `llama_memory_seq_rm`), and router taps
  through the eval callback: `ffn_moe_topk-<l>` (the experts llama.cpp runs, [T, k]) and, for a
  drafter, `ffn_moe_logits-<l>` (router logits [T, E], from which the target's top-k is predicted).
- `ExpertPages`: the expert split's page-cache state, per (layer, expert) byte ranges:
    evict     madvise(MADV_DONTNEED) on every mapping of the file in this process (llama.cpp maps
              it; the target and the drafter each once), then posix_fadvise(POSIX_FADV_DONTNEED)
              on the file: the pages leave the page cache, so the next use reads storage.
    prefetch  posix_fadvise(POSIX_FADV_WILLNEED) on an expert's two byte ranges (async readahead).
    stage     the experts a layer's router chose, whole and all in flight together: fadvise
              WILLNEED on every range, then MADV_POPULATE_READ on llama.cpp's mappings to wait for
              each and map it (a read through each where the kernel lacks it).
    cached    whether an expert's pages are all in the page cache, and how many expert pages are:
              the kernel's `cachestat` (Linux ≥ 6.5: counted in the kernel, ~1.5 µs an expert,
              ~16 µs the whole file), else mincore over our own (never touched) shared mapping
              (a page-cache lookup per page: ~0.2 ms per call on ds-tiny's 17 MB file). Per forward
              the engine asks only about the experts the router tap saw, so the accounting costs
              ~0.1 ms per token instead of the ~0.5 ms two whole-file mincore scans did (both
              charged to every method's decode time; the resident bound most, in proportion).
  Staging (`STAGING`) is real — experts come from storage, the split evicted at the start of
  every AR step / speculation round (the paper's cold setting):
    demand     (default; the paper's MN baseline) the load hook `LlamaModel.on_route` runs in the
               eval callback of `ffn_moe_topk-<l>`, i.e. after layer l's router and before its
               expert matmuls, and stages the chosen experts not yet cached (`stage`); the time
               it waits is the forward's stall, per layer.
    pagefault  (an ablation) no hook: llama.cpp's matmuls fault the experts in through its mmap,
               one 4 KiB page per fault (MADV_RANDOM), synchronously, inside llama.cpp — a stall
               that cannot be observed from here, so it is recorded as NaN, not 0.
    resident   (the upper bound) every expert is read into the page cache at the start and
               never evicted.
  Non-routed weights (the head) are never evicted: they stand for accelerator-resident weights.
- Exactness needs a batch-invariant build: a multi-token verify eval must compute bit for bit
  what one-token evals compute. llama.cpp's default build routes matrix products through
  llamafile's sgemm, which tiles by batch size (measured here: verify-block vs one-token logits
  differ by 8e-4 at f32 and 4e-2 at Q4_0, flipping greedy tokens); built with
  `-DGGML_LLAMAFILE=OFF` every product is the same per-element dot product and the difference is
  0.0. The speculative decoder refuses a llamafile build (`build_info`).
- `LlamaEngine`: the `Engine` protocol, so AR offload (`baselines.ar`) and the speculative round
  (`draftexpert.speculation.round`) run here exactly as on the torch engine. The runner decodes
  greedily on this engine (the round's sampler would run, but its distribution is tested on the
  torch engine only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import re
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.ledger import Ledger
from draftexpert.runtime.model import route

PAGE = mmap.PAGESIZE
MADV_RANDOM, MADV_DONTNEED, MADV_POPULATE_READ = 1, 4, 22  # Linux values
POSIX_FADV_RANDOM, POSIX_FADV_WILLNEED, POSIX_FADV_DONTNEED = (
    os.POSIX_FADV_RANDOM,
    os.POSIX_FADV_WILLNEED,
    os.POSIX_FADV_DONTNEED,
)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _cachestat_syscall():
    """cachestat(2) (Linux ≥ 6.5, number 451 on every architecture): (fd, offset, bytes) → pages of
    that range in the page cache; None where the kernel lacks it."""
    if not hasattr(_libc, "syscall") or os.uname().sysname != "Linux":
        return None
    rng, out = _CachestatRange(), _Cachestat()

    def cachestat(fd: int, off: int, n: int) -> int:
        rng.off, rng.len = off, n
        if _libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat failed")
        return out.nr_cache

    try:
        with open("/proc/self/exe", "rb") as probe:
            cachestat(probe.fileno(), 0, PAGE)
    except OSError:
        return None
    return cachestat


_cachestat = _cachestat_syscall()


class LlamaCppError(RuntimeError):
    """llama-cpp-python is missing, or a model file cannot be loaded by llama.cpp."""


def require_llama_cpp():
    try:
        import llama_cpp  # noqa: PLC0415  (llama-cpp-python, the optional extra `llamacpp`)
    except ImportError as e:
        raise LlamaCppError(
            "the llama.cpp engine needs llama-cpp-python: "
            "CMAKE_ARGS='-DGGML_NATIVE=OFF' pip install -e '.[llamacpp]' (builds from source, ~12 min; "
            "see README)"
        ) from e
    return llama_cpp


def build_info() -> dict[str, str]:
    """llama.cpp's compiled features (`llama_print_system_info`), e.g. {"AVX2": "1", "LLAMAFILE": "0"}."""
    llama_cpp = require_llama_cpp()
    return dict(re.findall(r"(\w+) = (\w+)", llama_cpp.llama_print_system_info().decode()))


# -- the model ----------------------------------------------------------------------------
def file_mappings() -> set[int]:
    """Start addresses of this process's file-backed mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return {int(f[0].split("-")[0], 16) for f in (line.split() for line in maps) if len(f) >= 6}


KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type of the KV cache (llama.cpp's default: f16)


class LlamaModel:
    """One llama.cpp model with its own context (KV cache, `kv_type`), logits for every evaluated
    position, and router taps filled by each `eval`: `topk[l]` [T, k] int, `router_logits[l]` [T, E]."""

    def __init__(
        self,
        head: Path,
        n_ctx: int = 2048,
        threads: int = 1,
        used_experts: int | None = None,
        tap_router_logits: bool = False,
        kv_type: str = "f16",
    ):
        llama_cpp = require_llama_cpp()
        self.topk: dict[int, np.ndarray] = {}
        self.router_logits: dict[int, np.ndarray] = {}
        self._parts: dict[tuple[str, int], list[np.ndarray]] = {}  # (tap, layer) → one array per ubatch
        # The load hook: called with (layer, experts [T, k]) as soon as a layer's router has chosen,
        # before llama.cpp's expert matmuls of that layer run (the eval callback returns first).
        self.on_route: Callable[[int, np.ndarray], None] | None = None
        self._hook_error: BaseException | None = None  # what `on_route` raised inside the C callback
        self._taps = ("ffn_moe_topk-",) + (("ffn_moe_logits-",) if tap_router_logits else ())
        self._ggml = _ggml_lib(llama_cpp)
        self._callback = _EVAL_CALLBACK(self._on_tensor)  # kept referenced: llama.cpp holds the pointer
        overrides = {"deepseek2.expert_used_count": used_experts} if used_experts else None
        before = file_mappings()
        with _default_params(llama_cpp, self._callback):  # Llama() has no argument for either
            try:
                self.llm = llama_cpp.Llama(
                    model_path=str(head),
                    n_ctx=n_ctx,
                    n_batch=min(n_ctx, 2048),
                    logits_all=True,
                    n_threads=threads,
                    n_threads_batch=threads,
                    use_mmap=True,
                    kv_overrides=overrides,
                    verbose=False,
                    type_k=KV_TYPES[kv_type],
                    type_v=KV_TYPES[kv_type],
                )
            except ValueError as e:
                raise LlamaCppError(f"{head}: llama.cpp could not load this model ({e})") from e
        # the mappings this model's load made (its expert split's among them): staging for one of its
        # forwards maps pages into these only, not into another model's mapping of the same file
        self.mappings = frozenset(file_mappings() - before)

    def _on_tensor(self, tensor, ask: bool, _user) -> bool:
        name = self._ggml.ggml_get_name(tensor).decode()
        if ask:
            return name.startswith(self._taps)
        kind, layer = name.rsplit("-", 1)
        t = _GgmlTensorHead.from_address(tensor)
        rows, cols = int(t.ne[1]), int(t.ne[0])  # ggml [ne0 = per token, ne1 = tokens]; topk is a strided view
        raw = np.empty(self._ggml.ggml_nbytes(tensor), dtype=np.uint8)
        self._ggml.ggml_backend_tensor_get(tensor, raw.ctypes.data, 0, raw.nbytes)
        dtype = np.int32 if kind == "ffn_moe_topk" else np.float32
        out = np.lib.stride_tricks.as_strided(raw.view(dtype), (rows, cols), (int(t.nb[1]), int(t.nb[0]))).copy()
        self._parts.setdefault((kind, int(layer)), []).append(out)  # one part per ubatch (a long prompt has several)
        if kind == "ffn_moe_topk" and self.on_route is not None and self._hook_error is None:
            try:
                self.on_route(int(layer), out)
            except BaseException as e:  # noqa: BLE001 - a C callback cannot raise: kept, re-raised by `eval`
                self._hook_error = e
                return False  # llama.cpp stops the graph here
        return True

    @property
    def n_tokens(self) -> int:
        return self.llm.n_tokens

    @property
    def n_ctx(self) -> int:
        return self.llm.n_ctx()

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append `tokens` at the current position; logits [len(tokens), V] for them."""
        self._parts = {}
        self._hook_error = None
        n0 = self.llm.n_tokens
        self.llm.eval(tokens)
        if self._hook_error is not None:
            raise self._hook_error
        self.topk = {layer: np.concatenate(p) for (kind, layer), p in self._parts.items() if kind == "ffn_moe_topk"}
        self.router_logits = {
            layer: np.concatenate(p) for (kind, layer), p in self._parts.items() if kind == "ffn_moe_logits"
        }
        return self.llm.scores[n0 : n0 + len(tokens)]

    def rollback(self, n: int) -> None:
        """Forget positions ≥ n (the next `eval` removes their KV with llama_memory_seq_rm)."""
        self.llm.n_tokens = n

    def reset(self) -> None:
        self.llm.reset()

    def close(self) -> None:
        self.llm.close()


_EVAL_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class _GgmlTensorHead(ctypes.Structure):
    """The first fields of `struct ggml_tensor` (ggml.h): type, buffer, ne[4], nb[4] (bytes)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def _ggml_lib(llama_cpp):
    """libggml-base from the llama_cpp package: tensor names and backend-agnostic reads."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        raise LlamaCppError(f"{lib_dir}: no libggml-base shared library in the llama_cpp package")
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


@contextmanager
def _default_params(llama_cpp, callback):
    """Within: contexts get the eval callback (router taps) and models `use_extra_bufts = False` —
    keep weights in the mmap'd file: the CPU 'extra buffer types' (repacked Q4_0, AMX) copy them
    into anonymous memory at load, so experts would never come from storage again (and AMX
    builds crash on deepseek2, see docs/LLAMACPP.md)."""
    low = llama_cpp.llama_cpp  # the module `Llama` calls
    ctx_default, model_default = low.llama_context_default_params, low.llama_model_default_params

    def ctx_params():
        p = ctx_default()
        p.cb_eval, p.cb_eval_user_data = callback, None
        return p

    def model_params():
        p = model_default()
        p.use_extra_bufts = False
        return p

    low.llama_context_default_params, low.llama_model_default_params = ctx_params, model_params
    try:
        yield
    finally:
        low.llama_context_default_params, low.llama_model_default_params = ctx_default, model_default


# -- the expert split's page-cache state ---------------------------------------------------
class ExpertPages:
    """Per (layer, expert) byte ranges of the expert split, and evict / prefetch / resident on them."""

    def __init__(self, expert_file: Path):
        self.index = index = ExpertFile(expert_file, staging_buffers=0)
        self.path = Path(expert_file).resolve()
        self.slices = index.slices
        self.nbytes = {layer: index.expert_nbytes(layer) for layer in index.layers}
        starts = [s.offset for s in self.slices.values()]
        self.lo = min(starts) // PAGE * PAGE
        self.hi = max(s.offset + s.nbytes * s.n_experts for s in self.slices.values())
        self.region_pages = -(-(self.hi - self.lo) // PAGE)  # the expert region, page-aligned
        self.fd = os.open(self.path, os.O_RDONLY)
        os.fdatasync(self.fd)  # a freshly written file's dirty pages would survive POSIX_FADV_DONTNEED
        os.posix_fadvise(self.fd, 0, 0, POSIX_FADV_RANDOM)  # our reads read what they ask for: no read-ahead
        self.size = os.fstat(self.fd).st_size
        self.addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0)  # never touched
        if self.addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {self.path} failed")
        self._vec = (ctypes.c_ubyte * (-(-self.size // PAGE)))()
        self._populate = True  # MADV_POPULATE_READ works (until the kernel says EINVAL)
        self.keys = [(layer, e) for layer in sorted(self.nbytes) for e in range(index.n_experts(layer))]
        self._buf = bytearray(max(s.nbytes for s in self.slices.values()))  # `stage` reads through it
        # (start, end, file offset) of each mapping of the file
        self._mappings: list[tuple[int, int, int]] | None = None
        self._spans: dict[tuple[int, int], list[tuple[int, int]]] | None = None  # `_index_pages`
        self._shared: dict[int, frozenset] = {}
        self.populate_into: list[tuple[int, int, int]] | None = None  # the mappings `stage` maps into (None: all)

    def ranges(self, layer: int, e: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of expert e's gate_up and down slices (`ExpertFile.ranges`)."""
        return self.index.ranges(layer, e)

    def evict(self) -> None:
        """Drop the file's pages from every mapping of it in this process and from the page cache
        (the whole file: a large folio can straddle the header and the first expert); mark the
        mappings MADV_RANDOM, so a fault reads its own page, not the kernel's read-around window
        (8 MiB on a virtual disk measured here: one fault would stage a third of the experts). The header is
        read once at load; after that only expert pages are ever touched. The mappings are found
        once (`find_mappings`, at every sequence's start): reading /proc/self/maps at every step
        cost ~1.8 ms here, charged to AR once per token and to speculation once per round."""
        if self._mappings is None:
            self.find_mappings()
        for start, end, _ in self._mappings:
            _libc.madvise(start, end - start, MADV_DONTNEED)
            _libc.madvise(start, end - start, MADV_RANDOM)
        os.posix_fadvise(self.fd, 0, 0, POSIX_FADV_DONTNEED)

    def evict_experts(self, keys, keep=()) -> None:
        """Drop the pages of experts `keys` (the staging budget keeps `keep`): every page of their
        ranges but those a kept expert shares, from llama.cpp's mappings and from the page cache."""
        if self._mappings is None:
            self.find_mappings()
        if self._spans is None:
            self._index_pages()
        for key in keys:
            for lo, hi in self._spans[key]:
                if any(o in keep for o in self._shared.get(lo, ())):
                    lo += 1
                if hi > lo and any(o in keep for o in self._shared.get(hi - 1, ())):
                    hi -= 1
                if hi <= lo:
                    continue
                off, n = lo * PAGE, (hi - lo) * PAGE
                for start, end, at in self._mappings:
                    a, b = max(off, at), min(off + n, at + end - start)
                    if a < b:
                        _libc.madvise(start + a - at, b - a, MADV_DONTNEED)
                os.posix_fadvise(self.fd, off, n, POSIX_FADV_DONTNEED)

    def _index_pages(self) -> None:
        """Each expert's page spans [first, last) and, for a page two experts share, its owners."""
        self._spans, owners = {}, defaultdict(set)
        for key in self.keys:
            self._spans[key] = [(off // PAGE, -(-(off + n) // PAGE)) for off, n in self.ranges(*key)]
            for lo, hi in self._spans[key]:
                owners[lo].add(key)
                owners[hi - 1].add(key)
        self._shared = {p: frozenset(o) for p, o in owners.items() if len(o) > 1}

    def find_mappings(self) -> None:
        """llama.cpp's mappings of the file (one per model loaded; not our own, never touched)."""
        self._mappings = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == str(self.path):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    if start != self.addr:
                        self._mappings.append((start, end, int(fields[2], 16)))

    def prefetch(self, keys) -> int:
        """Asynchronous readahead of the experts `keys` {(layer, e)}; returns bytes requested."""
        n = 0
        for layer, e in keys:
            for off, nbytes in self.ranges(layer, e):
                os.posix_fadvise(self.fd, off, nbytes, POSIX_FADV_WILLNEED)
                n += nbytes
        return n

    def stage(self, keys) -> None:
        """Bring the experts `keys` {(layer, e)} into the page cache whole, now: every range's
        readahead is issued first (all of them in flight together), then each is waited for by
        mapping it into the running model's mapping (`populate_into`; MADV_POPULATE_READ: the
        page-table entries its matmuls would otherwise fault in page by page after the wait;
        0.2–0.4 ms/token on ds-tiny; into the drafter's too, a verify pass paid for both),
        or, where the kernel lacks it (< 5.14) or no model maps the file, read through."""
        ranges = [r for layer, e in sorted(keys) for r in self.ranges(layer, e)]
        for off, n in ranges:
            os.posix_fadvise(self.fd, off, n, POSIX_FADV_WILLNEED)
        unwaited = ranges
        into = self._mappings if self.populate_into is None else self.populate_into
        if self._populate and into:
            unwaited = []
            for off, n in ranges:
                first, mapped = off // PAGE * PAGE, False
                for start, end, at in into:
                    if at <= first and off + n <= at + end - start:
                        if _libc.madvise(start + first - at, off + n - first, MADV_POPULATE_READ) != 0:
                            if ctypes.get_errno() != errno.EINVAL:
                                raise OSError(ctypes.get_errno(), f"MADV_POPULATE_READ on {self.path} failed")
                            self._populate = False  # an older kernel: read through from now on
                            break
                        mapped = True
                if not mapped:  # no mapping holds it (or the kernel refused): wait by reading it
                    unwaited.append((off, n))
        view = memoryview(self._buf)
        for off, n in unwaited:
            os.preadv(self.fd, [view[:n]], off)
        view.release()

    def stage_all(self) -> None:
        """Every expert into the page cache (the resident reference)."""
        self.stage(self.keys)

    def cached(self, key: tuple[int, int]) -> bool:
        """Whether every page of expert `key`'s two ranges is in the page cache (pages still under
        I/O count: they are in it, locked)."""
        return all(self._cached_pages(off, n) == -(-(off + n) // PAGE) - off // PAGE for off, n in self.ranges(*key))

    def cached_pages(self) -> int:
        """Pages of the expert region (header excluded) in the page cache."""
        return self._cached_pages(self.lo, self.hi - self.lo)

    def _cached_pages(self, off: int, n: int) -> int:
        first, last = off // PAGE, -(-(off + n) // PAGE)
        if _cachestat is not None:
            return _cachestat(self.fd, first * PAGE, (last - first) * PAGE)
        vec = self._vec
        if _libc.mincore(self.addr + first * PAGE, (last - first) * PAGE, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore on {self.path} failed")
        return int((np.frombuffer(vec, dtype=np.uint8, count=last - first) & 1).sum())

    def close(self) -> None:
        _libc.munmap(self.addr, self.size)
        os.close(self.fd)


# -- the engine ---------------------------------------------------------------------------
STAGING = {  # how the routed experts reach llama.cpp (recorded in every record's method_args)
    "demand": "whole experts staged on demand from the router tap (fadvise WILLNEED, all of a layer's in flight, "
    "then MADV_POPULATE_READ into llama.cpp's mapping) before the expert matmuls; split evicted at every "
    "step/round (madvise + fadvise DONTNEED)",
    "pagefault": "mmap page faults; expert pages evicted after every step/round (madvise + fadvise DONTNEED)",
    "resident": "every expert read into the page cache at the start, never evicted",
}


def routed(model: LlamaModel, rows: slice = slice(None)) -> set[tuple[int, int]]:
    """{(layer, expert)} llama.cpp ran over the given positions of the last eval."""
    return {(layer, int(e)) for layer, idx in model.topk.items() for e in np.unique(idx[rows])}


class LlamaEngine:
    """The `Engine` protocol (`draftexpert.decoding`) on llama.cpp: the target's context and, for
    speculation, the drafter's (its own KV cache: llama.cpp's drafter cannot read the target's;
    it prefills the prompt and is rolled back to the committed prefix after each round).

    Ê_i (predicted verifier experts of v_i's position) = the top-k of the draft router's logits
    (`ffn_moe_logits`) when the drafter consumes v_i, chosen by the runtime's own rule
    (`draftexpert.runtime.model.route` with the target's `ModelConfig` and V3 correction biases:
    `router`). A round starts cold: the expert split is evicted at `begin_round`.

    The ledger sees what llama.cpp does not report: per forward, the unique layer-experts routed
    (`requested`), those whose pages were not all in the page cache when the router tap chose them,
    before llama.cpp's matmuls of that layer (`loads`), the
    bytes that entered the page cache (`page_cache_bytes`: the kernel's read-around included),
    and the stall: the load hook's wait (staging "demand"); NaN under "pagefault" (inside
    llama.cpp's faults, not observable); 0 when resident."""

    def __init__(
        self,
        target: LlamaModel,
        pages: ExpertPages,
        drafter: LlamaModel | None = None,
        router: tuple | None = None,
        name: str = "ar",
        staging: str = "demand",
        staging_budget: int = 0,
        drafters: dict[str, LlamaModel] | None = None,
    ):
        """`drafters`: several drafters a round chooses among (`select_drafter`; `--method auto`), each
        a context of its own: a drafter not chosen for some rounds catches up on the committed tokens
        in its next draft forward."""
        if drafters:
            drafter = drafter or next(iter(drafters.values()))
        self.drafters = dict(drafters or {})
        if staging not in STAGING:
            raise ValueError(f"--staging: {staging!r} is not one of {', '.join(STAGING)}")
        if staging_budget and staging != "demand":
            raise ValueError("--staging-budget keeps staged experts between steps: it needs --staging demand")
        if drafter is not None and build_info().get("LLAMAFILE") == "1":
            raise LlamaCppError(
                "this llama.cpp build multiplies with llamafile's sgemm, whose results depend on the batch size: a "
                "verify block would not compute what one-token AR steps compute, and speculation would not be exact. "
                "Rebuild: CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF' pip install --no-cache-dir "
                "--force-reinstall llama-cpp-python==0.3.36 (README)"
            )
        if drafter is not None and router is None:
            raise ValueError("a drafter needs the target's router (ModelConfig, biases) to predict verifier experts")
        self.target, self.drafter, self.pages, self.router, self.name = target, drafter, pages, router, name
        self.context_length = min(m.n_ctx for m in self._models if m is not None)
        self.staging = staging
        # bytes of whole experts kept in the page cache between steps / rounds, least recently routed
        # out first (0: the paper's cold setting, everything evicted)
        self.staging_budget = staging_budget
        self._recent: OrderedDict[tuple[int, int], None] = OrderedDict()  # routed or prefetched, oldest first
        self._kept_pages = 0  # expert pages the last eviction left in the page cache
        self.ledger = Ledger()
        self.page_cache_bytes = 0  # expert bytes that entered the page cache (read-around included)
        self._stall: dict[int, float] = defaultdict(float)  # this forward's seconds waiting in `_stage`, per layer
        self._seen: dict[int, dict[int, bool]] = defaultdict(dict)  # this forward's experts per layer → cached before?
        self._since_evict: set[tuple[int, int]] = set()  # every expert staged, faulted or prefetched since the eviction
        self._prefetched: set[tuple[int, int]] = set()  # this round's WILLNEEDs, possibly still in flight
        self._populate: dict[int, list | None] = {}  # id(model) → the mappings staging populates (`start`)
        for m in self._models:
            if m is not None:
                m.on_route = self._on_route

    @property
    def _models(self) -> list[LlamaModel | None]:
        return [self.target, self.drafter, *(m for m in self.drafters.values() if m is not self.drafter)]

    def select_drafter(self, name: str) -> None:
        """The drafter the next draft forwards run (one of `drafters`)."""
        self.drafter = self.drafters[name]

    def _on_route(self, layer: int, experts: np.ndarray) -> None:
        """The load hook (every staging): before layer's expert matmuls, note which of the chosen
        experts the page cache holds (the ledger's loads are the others); staging "demand" then
        stages them, whole — the cached too, so a prefetch still in flight is waited for here, as stall."""
        chosen = [(layer, int(e)) for e in np.unique(experts)]
        seen = self._seen[layer]
        for key in chosen:  # the eviction emptied the cache: only what came in since can be in it
            if key[1] not in seen:  # first sight in this forward (a long prompt's later ubatches see them again)
                seen[key[1]] = key in self._since_evict and (self.staging == "resident" or self.pages.cached(key))
        self._since_evict.update(chosen)
        if self.staging_budget:
            for key in chosen:
                self._recent[key] = None
                self._recent.move_to_end(key)
        if self.staging == "demand":
            t0 = time.perf_counter()
            self.pages.stage(chosen)
            self._stall[layer] += time.perf_counter() - t0

    def _forward(self, model: LlamaModel, tokens: list[int], phase: str) -> torch.Tensor:
        self._stall.clear()
        self._seen.clear()
        # stage into the running model's mapping only (the other model's is populated when it runs)
        self.pages.populate_into = self._populate.get(id(model))
        with self.ledger.forward(phase, len(tokens)):
            logits = model.eval(tokens).copy()  # llama.cpp's buffer is rewritten by later evals
            for layer, seen in sorted(self._seen.items()):
                loads = sum(not cached for cached in seen.values())
                stall = float("nan") if self.staging == "pagefault" else self._stall[layer]
                self.ledger.record(layer, len(seen), loads, loads * self.pages.nbytes[layer], stall, seen)
            self.ledger.note_resident(len(self._since_evict))  # the page cache holds all since the eviction
        return torch.from_numpy(logits)

    def _evict(self) -> None:
        """Every expert page that came in since the last eviction is counted, then dropped — with a
        staging budget, all but the most recently routed experts that fit it."""
        self.page_cache_bytes += (self.pages.cached_pages() - self._kept_pages) * PAGE  # what came in since
        if not self.staging_budget:
            self.pages.evict()
            self._since_evict = set()
            return
        keep, held = set(), 0
        for key in reversed(self._recent):
            b = self.pages.nbytes[key[0]]
            if held + b > self.staging_budget:
                break
            keep.add(key)
            held += b
        for key in [k for k in self._recent if k not in keep]:
            del self._recent[key]
        self.pages.evict_experts(self._since_evict - keep, keep)
        self._since_evict = set(keep)
        self._kept_pages = self.pages.cached_pages()

    def start(self, capacity: int) -> None:
        self.ledger.reset()
        for m in self._models:
            if m is not None:
                m.reset()
        self.pages.find_mappings()  # the models are loaded: their mappings are known from here on
        # each model's own mapping(s) of the split; one not told apart from the others': all of them (None)
        mapped = self.pages._mappings
        self._populate = {id(m): [x for x in mapped if x[0] in m.mappings] or None for m in self._models if m}
        if self.staging == "resident":
            self.pages.stage_all()
            self._since_evict = set(self.pages.keys)
        else:
            self._recent.clear()
            self.pages.evict()  # a sequence starts cold, whatever the budget
            self._since_evict, self._kept_pages = set(), 0
        self.page_cache_bytes = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self._forward(self.target, ids, "prefill")[-1]

    def prefill_draft(self, ids: list[int]) -> None:
        for m in self._models[1:]:
            self._forward(m, ids, "prefill-draft")

    def decode_one_token(self, token: int) -> torch.Tensor:
        return self._forward(self.target, [token], "ar")[-1]

    @property
    def draft_length(self) -> int:
        return self.drafter.n_tokens

    def draft_lengths(self) -> dict[str, int]:
        return {name: m.n_tokens for name, m in self.drafters.items()}  # a context each: one left out lags

    def draft_forward(self, ids: list[int]) -> torch.Tensor:
        return self._forward(self.drafter, ids, "draft")[-1]

    def draft_ran(self) -> set[tuple[int, int]]:
        return routed(self.drafter)

    def predicted(self) -> set[tuple[int, int]]:
        cfg, bias = self.router
        return {
            (layer, e)
            for layer, z in self.drafter.router_logits.items()
            for e in route(torch.from_numpy(z[-1:]), cfg, cfg.top_k, bias.get(layer))[1][0].tolist()
        }

    def resident(self) -> set[tuple[int, int]]:
        """The experts in the page cache: of those staged, faulted or prefetched since the last
        eviction (which emptied it), the ones whose pages are all there (staging "resident": all,
        as `stats` checks)."""
        if self.staging == "resident":
            return set(self._since_evict)
        return {key for key in self._since_evict if self.pages.cached(key)}

    def prefetch(self, keys: set[tuple[int, int]]) -> set[tuple[int, int]]:
        """WILLNEED on the experts not already cached (the drafter's own, or earlier prefetches)."""
        issued = {key for key in keys if not self.pages.cached(key)}
        self._since_evict |= issued
        if self.staging_budget:
            for key in issued:
                self._recent[key] = None
        if issued:
            self.ledger.record_prefetch(len(issued), self.pages.prefetch(issued))
            self._prefetched |= issued
        return issued

    def verify(self, start: int, ids: list[int]) -> torch.Tensor:
        self.target.rollback(start)
        return self._forward(self.target, ids, "verify")

    def routed(self) -> set[tuple[int, int]]:
        return routed(self.target)

    def commit(self, length: int) -> None:
        self.target.rollback(length)  # drop rejected positions (and the last token's)
        for m in self._models[1:]:
            if m is not None:
                m.rollback(min(m.n_tokens, length))

    def begin_round(self) -> None:
        if self.staging != "resident":
            self._evict()  # cold: nothing staged survives a round (torch engine: end_block)

    def end_round(self) -> None:
        """Let the round's unfinished prefetches land before the next round evicts: pages still under
        I/O cannot be evicted, and would reach the next round as free (and unmetered) loads. The
        wait is decode time: the reads were issued, their bandwidth is spent either way."""
        if self._prefetched:
            self.pages.stage(self._prefetched)
            self._prefetched = set()

    def stats(self) -> dict:
        """The ledger, and the expert bytes that entered the page cache (read-around included)."""
        cached = self.pages.cached_pages()
        if self.staging == "resident":
            if cached < self.pages.region_pages:
                raise RuntimeError(
                    f"{self.pages.path}: the page cache dropped expert pages during a resident run "
                    "(memory pressure?), so it was not the resident bound; free memory and rerun"
                )
            return {"ledger": self.ledger.summary(), "page_cache_bytes": 0}
        return {
            "ledger": self.ledger.summary(),
            "page_cache_bytes": self.page_cache_bytes + (cached - self._kept_pages) * PAGE,
        }

    def close(self) -> None:
        for m in self._models:
            if m is not None:
                m.close()
        self.pages.close()
