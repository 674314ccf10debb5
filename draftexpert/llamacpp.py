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
    prefetch  posix_fadvise(POSIX_FADV_WILLNEED) on an expert's three byte ranges (async readahead).
    resident  mincore over our own (never touched) shared mapping: which experts are cached.
  Staging is therefore real: experts come from storage through llama.cpp's mmap page faults
  (one page per fault: MADV_RANDOM), evicted at the end of every AR step / speculation round
  (the paper's cold setting). Non-routed
  weights (the head) are never evicted: they stand for accelerator-resident weights.
- Exactness needs a batch-invariant build: a multi-token verify eval must compute bit for bit
  what one-token evals compute. llama.cpp's default build routes matrix products through
  llamafile's sgemm, which tiles by batch size (measured here: verify-block vs one-token logits
  differ by 8e-4 at f32 and 4e-2 at Q4_0, flipping greedy tokens); built with
  `-DGGML_LLAMAFILE=OFF` every product is the same per-element dot product and the difference is
  0.0. The speculative decoder refuses a llamafile build (`build_info`).
- `LlamaARDecoder`, `LlamaSpeculativeDecoder`: the `Decoder` contract; the speculative loop has
  the torch engine's phases and controller (draft → truncate → prefetch → verify → accept →
  commit, `SpecConfig`), greedy only. The drafter is a second llama.cpp context with its own KV
  cache (llama.cpp's drafter cannot read the target's cache): it prefills the prompt once and is
  rolled back to the committed prefix after each round.

The ledger sees what llama.cpp does not report: per forward, the unique layer-experts routed
(`requested`), those whose pages were not all in the page cache just before (`loads`), and the
bytes that entered the page cache (`bytes`: the kernel's read-around included). Stall time
inside llama.cpp's page faults is not observable from here: it is recorded as NaN, not 0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from draftexpert.decoding import DecodeOutput
from draftexpert.gguf_experts import PARTS, ExpertFile
from draftexpert.ledger import Ledger
from draftexpert.speculative import Draft, RoundStats, SpecConfig, greedy_accept

PAGE = mmap.PAGESIZE
MADV_RANDOM, MADV_DONTNEED, POSIX_FADV_WILLNEED, POSIX_FADV_DONTNEED = 1, 4, 3, 4  # Linux values
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class LlamaCppError(RuntimeError):
    """llama-cpp-python is missing, or a model file cannot be loaded by llama.cpp."""


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppError("the llama.cpp engine needs llama-cpp-python: "
                            "CMAKE_ARGS='-DGGML_NATIVE=OFF' pip install -e '.[llamacpp]' (builds from source, ~12 min; "
                            "see README)") from e
    return llama_cpp


def build_info() -> dict[str, str]:
    """llama.cpp's compiled features (`llama_print_system_info`), e.g. {"AVX2": "1", "LLAMAFILE": "0"}."""
    llama_cpp = require_llama_cpp()
    import re

    return dict(re.findall(r"(\w+) = (\w+)", llama_cpp.llama_print_system_info().decode()))


# -- the model ----------------------------------------------------------------------------
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type of the KV cache (llama.cpp's default: f16)


class LlamaModel:
    """One llama.cpp model with its own context (KV cache, `kv_type`), logits for every evaluated
    position, and router taps filled by each `eval`: `topk[l]` [T, k] int, `router_logits[l]` [T, E]."""

    def __init__(self, head: Path, n_ctx: int = 2048, threads: int = 1, used_experts: int | None = None,
                 tap_router_logits: bool = False, kv_type: str = "f16"):
        llama_cpp = require_llama_cpp()
        self.topk: dict[int, np.ndarray] = {}
        self.router_logits: dict[int, np.ndarray] = {}
        self._parts: dict[tuple[str, int], list[np.ndarray]] = {}  # (tap, layer) → one array per ubatch
        self._taps = ("ffn_moe_topk-",) + (("ffn_moe_logits-",) if tap_router_logits else ())
        self._ggml = _ggml_lib(llama_cpp)
        self._callback = _EVAL_CALLBACK(self._on_tensor)  # kept referenced: llama.cpp holds the pointer
        overrides = {"deepseek2.expert_used_count": used_experts} if used_experts else None
        with _default_params(llama_cpp, self._callback):  # Llama() has no argument for either
            try:
                self.llm = llama_cpp.Llama(model_path=str(head), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), logits_all=True,
                                           n_threads=threads, n_threads_batch=threads, use_mmap=True,
                                           kv_overrides=overrides, verbose=False, type_k=KV_TYPES[kv_type],
                                           type_v=KV_TYPES[kv_type])
            except ValueError as e:
                raise LlamaCppError(f"{head}: llama.cpp could not load this model ({e})") from e

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
        return True

    @property
    def n_tokens(self) -> int:
        return self.llm.n_tokens

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append `tokens` at the current position; logits [len(tokens), V] for them."""
        self._parts = {}
        n0 = self.llm.n_tokens
        self.llm.eval(tokens)
        self.topk = {l: np.concatenate(p) for (kind, l), p in self._parts.items() if kind == "ffn_moe_topk"}
        self.router_logits = {l: np.concatenate(p) for (kind, l), p in self._parts.items() if kind == "ffn_moe_logits"}
        return self.llm.scores[n0:n0 + len(tokens)]

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
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


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
    builds crash on deepseek2, see README)."""
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
        index = ExpertFile(expert_file, staging_buffers=0)
        self.path = Path(expert_file).resolve()
        self.slices = index.slices
        self.nbytes = {layer: index.expert_nbytes(layer) for layer in index.layers}
        starts = [s.offset for s in self.slices.values()]
        self.lo = min(starts) // PAGE * PAGE
        self.hi = max(s.offset + s.nbytes * s.n_experts for s in self.slices.values())
        self.fd = os.open(self.path, os.O_RDONLY)
        os.fdatasync(self.fd)  # a freshly written file's dirty pages would survive POSIX_FADV_DONTNEED
        self.size = os.fstat(self.fd).st_size
        self.addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0)  # never touched
        if self.addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {self.path} failed")
        self._vec = (ctypes.c_ubyte * (-(-self.size // PAGE)))()

    def ranges(self, layer: int, e: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of expert e's gate, up and down slices."""
        return [(s.offset + e * s.nbytes, s.nbytes) for s in (self.slices[(layer, p)] for p in PARTS)]

    def evict(self) -> None:
        """Drop the file's pages from every mapping of it in this process and from the page cache
        (the whole file: a large folio can straddle the header and the first expert); mark the
        mappings MADV_RANDOM, so a fault reads its own page, not the kernel's read-around window
        (8 MiB on this VM's disk: one fault would stage a third of the experts). The header is
        read once at load; after that only expert pages are ever touched."""
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or fields[5] != str(self.path):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                _libc.madvise(start, end - start, MADV_DONTNEED)
                _libc.madvise(start, end - start, MADV_RANDOM)
        os.posix_fadvise(self.fd, 0, 0, POSIX_FADV_DONTNEED)

    def prefetch(self, keys) -> int:
        """Asynchronous readahead of the experts `keys` {(layer, e)}; returns bytes requested."""
        n = 0
        for layer, e in keys:
            for off, nbytes in self.ranges(layer, e):
                os.posix_fadvise(self.fd, off, nbytes, POSIX_FADV_WILLNEED)
                n += nbytes
        return n

    def snapshot(self) -> np.ndarray:
        """Page-cache residency of every page of the file (mincore), as a bool array."""
        if _libc.mincore(self.addr, self.size, self._vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore on {self.path} failed")
        return np.frombuffer(self._vec, dtype=np.uint8) & 1 == 1

    def resident(self, snap: np.ndarray, layer: int, e: int) -> bool:
        """Every page of expert e's three slices was cached in `snap`."""
        return all(snap[off // PAGE:-(-(off + n) // PAGE)].all() for off, n in self.ranges(layer, e))

    def expert_pages(self, snap: np.ndarray) -> int:
        return int(snap[self.lo // PAGE:-(-self.hi // PAGE)].sum())

    def close(self) -> None:
        _libc.munmap(self.addr, self.size)
        os.close(self.fd)


# -- decoders -----------------------------------------------------------------------------
def routed(model: LlamaModel, rows: slice = slice(None)) -> set[tuple[int, int]]:
    """{(layer, expert)} llama.cpp ran over the given positions of the last eval."""
    return {(layer, int(e)) for layer, idx in model.topk.items() for e in np.unique(idx[rows])}


class _Engine:
    """Shared by the decoders: forwards under the ledger, with page-cache accounting."""

    def __init__(self, pages: ExpertPages, ledger: Ledger | None = None):
        self.pages, self.ledger = pages, ledger or Ledger()
        self.page_cache_bytes = 0  # expert bytes that entered the page cache (read-around included)
        self.prefetched: set[tuple[int, int]] = set()  # this round's prefetches

    def close(self) -> None:
        for m in self.models:
            m.close()
        self.pages.close()

    def _start(self, *models: LlamaModel) -> None:
        self.ledger.reset()
        self.page_cache_bytes = 0
        for m in models:
            m.reset()
        self.pages.evict()

    def _stats(self) -> dict:
        return {"ledger": self.ledger.summary(), "page_cache_bytes": self.page_cache_bytes}

    def forward(self, model: LlamaModel, tokens: list[int], phase: str) -> np.ndarray:
        before = self.pages.snapshot()
        with self.ledger.forward(phase, len(tokens)):
            logits = model.eval(tokens)
            after = self.pages.snapshot()
            for layer, idx in sorted(model.topk.items()):
                es = np.unique(idx)
                loads = sum(not self.pages.resident(before, layer, int(e)) for e in es)
                self.ledger.record(layer, len(es), loads, loads * self.pages.nbytes[layer], float("nan"))
        self.page_cache_bytes += (self.pages.expert_pages(after) - self.pages.expert_pages(before)) * PAGE
        return logits


class LlamaARDecoder(_Engine):
    """AR offload on llama.cpp (greedy): one eval per token, experts evicted after each step."""

    name = "ar"

    def __init__(self, target: LlamaModel, pages: ExpertPages):
        super().__init__(pages)
        self.target, self.models = target, (target,)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        self._start(self.target)
        t0 = time.perf_counter()
        tokens = [int(self.forward(self.target, prompt_ids, "prefill")[-1].argmax())]
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            self.pages.evict()
            tokens.append(int(self.forward(self.target, tokens[-1:], "ar")[-1].argmax()))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1,
                            stats=self._stats())


def _route_topk(logits: np.ndarray, k: int, bias: np.ndarray | None) -> np.ndarray:
    """The target router's top-k from router logits [T, E] (V2: softmax is monotone; V3: sigmoid + bias)."""
    score = logits if bias is None else 1.0 / (1.0 + np.exp(-logits)) + bias
    return np.argsort(-score, axis=-1, kind="stable")[:, :k]


class LlamaSpeculativeDecoder(_Engine):
    """Exact self-speculative decoding on llama.cpp (greedy), phases as in `speculative.py`.

    Ê_i (predicted verifier experts of v_i's position) = the top-k of the draft router's logits
    (`ffn_moe_logits`) when the drafter consumes v_i, chosen as the target router chooses
    (`bias[l]`: V3's correction bias). x_0's experts seed Û_0 and are never charged."""

    def __init__(self, target: LlamaModel, drafter: LlamaModel, pages: ExpertPages, config: SpecConfig,
                 top_k: int, bias: dict[int, np.ndarray] | None = None, name: str = "draftexpert"):
        if config.temperature > 0:
            raise ValueError("the llama.cpp engine decodes greedily (temperature 0)")
        if build_info().get("LLAMAFILE") == "1":
            raise LlamaCppError(
                "this llama.cpp build multiplies with llamafile's sgemm, whose results depend on the batch size: a "
                "verify block would not compute what one-token AR steps compute, and speculation would not be exact. "
                "Rebuild: CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF' pip install --no-cache-dir "
                "--force-reinstall llama-cpp-python==0.3.36 (README)")
        super().__init__(pages)
        self.target, self.drafter, self.cfg, self.top_k = target, drafter, config, top_k
        self.models = (target, drafter)
        self.bias, self.name = bias or {}, name

    def _draft_forward(self, tokens: list[int], out: Draft) -> np.ndarray:
        logits = self.forward(self.drafter, tokens, "draft")[-1]
        out.touched |= routed(self.drafter)
        return logits

    def _predicted(self) -> set[tuple[int, int]]:
        return {(layer, int(e)) for layer, z in self.drafter.router_logits.items()
                for e in _route_topk(z[-1:], self.top_k, self.bias.get(layer))[0]}

    def _keep(self, out: Draft, predicted: set) -> None:
        new = predicted - out.predicted
        out.predicted |= predicted
        if self.cfg.prefetch and new:
            self.ledger.record_prefetch(len(new), self.pages.prefetch(new))
            self.prefetched |= new

    def draft(self, committed: list[int], k_limit: int) -> Draft:
        """draft → truncate → prefetch, as `SpeculativeDecoder.draft` (greedy)."""
        cfg = self.cfg
        look_ahead = cfg.truncate or cfg.prefetch
        out = Draft([], [], set(), set(), False)
        logits = self._draft_forward(committed[self.drafter.n_tokens:], out)  # consumes x_0 (and any pending)
        self._keep(out, self._predicted())
        for i in range(1, k_limit + 1):
            z = logits - logits.max()
            q = np.exp(z) / np.exp(z).sum()
            v = int(q.argmax())
            touched_now = len(out.touched)
            if i < k_limit or look_ahead:
                logits = self._draft_forward([v], out)
                predicted = self._predicted()
                new = predicted - out.predicted
                if cfg.budget_mode == "cache":
                    snap = self.pages.snapshot()
                    new = {(l, e) for l, e in new if not self.pages.resident(snap, l, e)}
                if cfg.truncate and float(q[v]) < cfg.tau and len(new) > cfg.budget:  # Eq. 14
                    out.truncated = True
                    break
                self._keep(out, predicted)
            out.tokens.append(v)
            out.touched_at.append(touched_now)
        return out

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        cfg = self.cfg
        self._start(self.target, self.drafter)
        t0 = time.perf_counter()
        first = int(self.forward(self.target, prompt_ids, "prefill")[-1].argmax())
        self.forward(self.drafter, prompt_ids, "prefill-draft")
        t1 = time.perf_counter()
        committed, tokens = list(prompt_ids) + [first], [first]
        stats = RoundStats(cfg.k_max)
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            self.pages.evict()  # cold: nothing staged survives a round (torch engine: end_block)
            self.prefetched = set()
            k_limit = min(cfg.k_max, max_new_tokens - len(tokens) - 1)
            draft = self.draft(committed, k_limit) if k_limit > 0 else Draft([], [], set(), set(), False)
            snap = self.pages.snapshot()
            resident = {(l, e) for l, e in draft.touched | self.prefetched if self.pages.resident(snap, l, e)}
            logits = self.verify(committed, draft.tokens)
            needed = routed(self.target)
            hits, waste = len(self.prefetched & needed), len(self.prefetched - needed)
            self.ledger.record_prefetch_outcome(hits, waste, len(needed - resident - self.prefetched))
            emitted, accepted = self.accept(draft, logits)
            if eos_token_id in emitted:
                emitted = emitted[:emitted.index(eos_token_id) + 1]
            emitted = emitted[:max_new_tokens - len(tokens)]
            stats.add(draft, min(accepted, len(emitted)), verify_unique=len(needed))
            committed += emitted
            tokens += emitted
            self.target.rollback(len(committed) - 1)  # drop rejected positions (and the last token's)
            self.drafter.rollback(min(self.drafter.n_tokens, len(committed) - 1))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1,
                            stats={**stats.summary(), **self._stats()})

    def verify(self, committed: list[int], draft: list[int]) -> np.ndarray:
        """Target logits [K+1, V] at [x_0, v_1 … v_K] in one eval; position j judges v_{j+1}."""
        self.target.rollback(len(committed) - 1)
        return self.forward(self.target, committed[-1:] + draft, "verify")

    @staticmethod
    def accept(draft: Draft, logits: np.ndarray) -> tuple[list[int], int]:
        return greedy_accept(draft.tokens, logits.argmax(-1).tolist())
