"""Speed benchmarks of the runtime (`bench speed ...`): measured by commands, never by tests.

- overhead: resident AR decoding with the lean runtime (eager, or `--compile`: the one-token step's
  dense parts through torch.compile) vs transformers' `generate` on the same checkpoint, same
  threads, same prompt, same process, interleaved repeats; ms per new token over prefill + decode
  (the first round, which compiles, is not counted). Tokens must match.
- flash: one MoE layer's top-k experts through the flash store (cold: nothing cached), against
  the O_DIRECT read bandwidth `bench env` measures for the same total size on the same disk:
  efficiency = (bytes / load seconds) / O_DIRECT GB/s. Reported for the reads alone and for the
  whole load (reads + dequantisation).
"""
from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def overhead(folder: Path, threads: int, new_tokens: int = 64, repeats: int = 3, prompt_len: int = 16, log=print,
             compile: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    from baselines.ar import AROffloadDecoder
    from draftexpert.loader import build_model

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    lean = build_model(folder, "resident")
    if compile:
        lean.compile_decode()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size, (1, prompt_len), generator=g)
    dec = AROffloadDecoder(lean)
    hf_ms, lean_ms, same = [], [], True
    for rep in range(repeats + 1):  # the first round warms both up and is not counted
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        t_hf = time.perf_counter() - t0
        o = dec.generate(ids[0].tolist(), new_tokens)
        t_lean = o.prefill_s + o.decode_s
        same &= out[0, prompt_len:].tolist() == o.tokens
        if rep:
            hf_ms.append(1000 * t_hf / new_tokens)
            lean_ms.append(1000 * t_lean / new_tokens)
            log(f"round {rep}: transformers {hf_ms[-1]:.2f} ms/token, lean {lean_ms[-1]:.2f} ms/token")
    res = {"threads": threads, "new_tokens": new_tokens, "prompt_len": prompt_len, "compiled": compile,
           "transformers_ms_per_token": _stats(hf_ms), "lean_resident_ms_per_token": _stats(lean_ms),
           "speedup_median": statistics.median(hf_ms) / statistics.median(lean_ms), "tokens_identical": same,
           "note": "ms/token over prefill + decode of new_tokens tokens (both sides timed the same way)"}
    try:
        import llama_cpp  # noqa: F401
        res["llama_cpp"] = "installed: compare with `bench crosscheck` once the llama.cpp engine lands"
    except ImportError:
        res["llama_cpp"] = "not installed (pip install -e '.[llamacpp]')"
    return res


def flash(folder: Path, gguf: Path, repeats: int = 20, layer: int | None = None, log=print) -> dict:
    from bench.telemetry import odirect_read_bandwidth
    from draftexpert.experts import FlashStore

    store = FlashStore(gguf)
    f = store.file
    layer = layer if layer is not None else f.layers[len(f.layers) // 2]
    top_k = 6
    total = top_k * f.expert_nbytes(layer)
    rng = random.Random(0)
    E = f.slices[(layer, "gate")].n_experts
    read_s, load_s = [], []
    pool = ThreadPoolExecutor(store.pool._max_workers)  # the same number of reads in flight as the store
    for _ in range(repeats):
        chosen = rng.sample(range(E), top_k)
        t0 = time.perf_counter()
        for raw in list(pool.map(lambda e: f.read_expert(layer, e), chosen)):
            f.release(raw)
        read_s.append(time.perf_counter() - t0)
        chosen = rng.sample(range(E), top_k)
        t0 = time.perf_counter()
        store.fetch(layer, chosen)
        load_s.append(time.perf_counter() - t0)
    pool.shutdown()
    qtype = f.slices[(layer, "gate")].qtype
    block = max(4096, f.slices[(layer, "gate")].nbytes // 4096 * 4096)
    ref = odirect_read_bandwidth(Path(gguf).parent, block_size=block, file_size=max(total, block), passes=max(5, repeats // 2))
    store.close()
    med_read, med_load = statistics.median(read_s), statistics.median(load_s)
    res = {"expert_type": qtype, "layer": layer, "experts": top_k, "bytes": total,
           "read_ms": _stats([1000 * s for s in read_s]), "load_ms": _stats([1000 * s for s in load_s]),
           "read_gb_per_s": total / med_read / 1e9, "load_gb_per_s": total / med_load / 1e9,
           "odirect_reference": ref}
    if "gb_per_s_median" in ref:
        res["read_efficiency"] = res["read_gb_per_s"] / ref["gb_per_s_median"]
        res["load_efficiency"] = res["load_gb_per_s"] / ref["gb_per_s_median"]
    return res

