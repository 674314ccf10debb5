"""Speed benchmarks of the runtime (`bench speed ...`): measured by commands, never by tests.

- overhead: resident AR decoding with the lean runtime (eager, or `--compile`: the one-token step's
  dense parts through torch.compile) vs transformers' `generate` on the same checkpoint, same
  threads, same prompt, same process, interleaved repeats; ms per new token over prefill + decode
  (the first round, which compiles, is not counted). Tokens must match. Where llama.cpp is
  installed, its f32 decoding of the same checkpoint (experts resident, f32 KV cache) joins the
  interleaved rounds: `lean_vs_llama_cpp_median` = llama.cpp ms / lean ms.
- host: one MoE layer's top-k experts through the host store (platform cg) against one copy of as
  many bytes from pinned memory — the accelerator's copy bandwidth; efficiency = the ratio.
- flash: one MoE layer's top-k experts through the flash store (cold: nothing cached), against
  the O_DIRECT read bandwidth `bench env` measures for the same total size on the same disk:
  efficiency = (bytes / load seconds) / O_DIRECT GB/s. Reported for the reads alone and for the
  whole load (reads + dequantisation).
- convert: the streaming expert-file writer on random layers of a model's real expert shapes (its
  config alone: DS-V2-Lite's by default), into a temporary folder that is removed: file bytes,
  seconds and the process's peak RSS — one layer's worth whatever the layer count.
"""

from __future__ import annotations

import random
import resource
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from baselines.ar import AROffloadDecoder
from bench.cells.cell import Cell
from bench.cells.decoders import make_decoder
from bench.runs.telemetry import machine_id, odirect_read_bandwidth
from bench.suites.prompts import render_prompt
from draftexpert.engines.llamacpp import LlamaModel
from draftexpert.engines.torch_engine import TorchEngine
from draftexpert.runtime.checkpoint import weights_fingerprint
from draftexpert.runtime.experts import FlashStore
from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.gguf_write import write_expert_gguf
from draftexpert.runtime.loader import build_model


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _llama_generate(lm, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding on llama.cpp, experts resident (never evicted): (tokens, seconds)."""
    lm.reset()
    t0 = time.perf_counter()
    tokens = [int(lm.eval(ids)[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(lm.eval(tokens[-1:])[-1].argmax()))
    return tokens, time.perf_counter() - t0


def overhead(
    folder: Path,
    threads: int,
    new_tokens: int = 64,
    repeats: int = 3,
    prompt_len: int = 16,
    log=print,
    compile: bool = False,
    llama_head: Path | None = None,
) -> dict:
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    lean = build_model(folder, "resident")
    if compile:
        lean.compile_decode()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size, (1, prompt_len), generator=g)
    dec = AROffloadDecoder(TorchEngine(lean))
    lm = None
    if llama_head is not None:
        lm = LlamaModel(llama_head, 512, threads, kv_type="f32")
    hf_ms, lean_ms, llama_ms, same, same_llama = [], [], [], True, True
    for rep in range(repeats + 1):  # the first round warms both up and is not counted
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        t_hf = time.perf_counter() - t0
        o = dec.generate(ids[0].tolist(), new_tokens)
        t_lean = o.prefill_s + o.decode_s
        same &= out[0, prompt_len:].tolist() == o.tokens
        if lm is not None:
            l_tokens, t_llama = _llama_generate(lm, ids[0].tolist(), new_tokens)
            same_llama &= l_tokens == o.tokens
        if rep:
            hf_ms.append(1000 * t_hf / new_tokens)
            lean_ms.append(1000 * t_lean / new_tokens)
            if lm is not None:
                llama_ms.append(1000 * t_llama / new_tokens)
            log(
                f"round {rep}: transformers {hf_ms[-1]:.2f} ms/token, lean {lean_ms[-1]:.2f} ms/token"
                + (f", llama.cpp f32 {llama_ms[-1]:.2f} ms/token" if llama_ms else "")
            )
    res = {
        "threads": threads,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "compiled": compile,
        "transformers_ms_per_token": _stats(hf_ms),
        "lean_resident_ms_per_token": _stats(lean_ms),
        "speedup_median": statistics.median(hf_ms) / statistics.median(lean_ms),
        "tokens_identical": same,
        "note": "ms/token over prefill + decode of new_tokens tokens (both sides timed the same way)",
    }
    if lm is not None:
        lm.close()
        res["llama_cpp_f32_ms_per_token"] = _stats(llama_ms)
        res["lean_vs_llama_cpp_median"] = statistics.median(llama_ms) / statistics.median(lean_ms)  # < 1: slower
        res["llama_cpp_tokens_identical"] = same_llama
    else:
        res["llama_cpp"] = "not installed (the llamacpp extra; see README)"
    return res


# `speed engines`: AR on platform mn over one Q4_0 expert file, each engine beside its resident bound
ENGINE_CELLS = [  # (label, the cell's options)
    ("torch", {"platform": "mn"}),
    ("torch, Q4_0 head", {"platform": "mn", "head_type": "q4_0"}),
    ("llama.cpp", {"platform": "mn", "engine": "llama.cpp"}),
    ("torch resident", {"platform": "resident", "resident_from_file": True}),
    ("torch, Q4_0 head, resident", {"platform": "resident", "resident_from_file": True, "head_type": "q4_0"}),
    ("llama.cpp resident", {"platform": "resident", "engine": "llama.cpp"}),
]
RESIDENT_OF = {
    "torch": "torch resident",
    "torch, Q4_0 head": "torch, Q4_0 head, resident",
    "llama.cpp": "llama.cpp resident",
}  # each offloaded cell → its resident bound


def engines(
    model: str,
    folder: Path,
    prompts: list[dict],
    expert_file,
    max_new_tokens: int = 64,
    rounds: int = 3,
    read_bw: float | None = None,
    log=print,
) -> dict:
    """AR decode ms/token of each `ENGINE_CELLS` configuration on the same prompts and Q4_0 expert file,
    in interleaved rounds (a shared machine's speed drifts within minutes: only same-round ratios are fair),
    each configuration loaded afresh per round and timed over its decode only. Reports the medians,
    each offloaded cell's ms/token ÷ llama.cpp's, its AR speed / its resident bound's, its physical limit
    (`read_bw`, the storage's measured bytes/s, ÷ bytes moved per token: tokens/s with free compute), whether
    its tokens equal its resident bound's (staging is exact), and how far torch's tokens follow llama.cpp's."""
    ms: dict[str, list[float]] = {label: [] for label, _ in ENGINE_CELLS}
    stall: dict[str, list[float]] = {label: [] for label, _ in ENGINE_CELLS}
    moved: dict[str, float] = {}  # bytes moved per decoded token (the same every round)
    tokens: dict[str, list[list[int]]] = {}
    for rnd in range(rounds):
        for label, opts in ENGINE_CELLS:
            cell = Cell(model=model, method="ar", expert_type="q4_0", max_new_tokens=max_new_tokens, **opts)
            dec, tok, _ = make_decoder(cell, folder, expert_file)
            try:
                out = [dec.generate(render_prompt(tok, p["prompt"]), max_new_tokens, tok.eos_token_id) for p in prompts]
            finally:
                dec.close()
            n = sum(len(o.tokens) - 1 for o in out)  # decoded tokens (the first comes from the prefill)
            ms[label].append(1000 * sum(o.decode_s for o in out) / n)
            ar = [o.stats["ledger"]["by_phase"].get("ar", {}) for o in out]
            stall[label].append(1000 * sum(a.get("stall_s") or 0.0 for a in ar) / n)
            moved[label] = sum(a.get("bytes") or 0 for a in ar) / n
            tokens.setdefault(label, [o.tokens for o in out])
            log(f"round {rnd + 1}/{rounds} {label}: {ms[label][-1]:.2f} ms/token (stall {stall[label][-1]:.2f})")
    med = {label: statistics.median(v) for label, v in ms.items()}

    def follows(a: str, b: str) -> float:  # mean length of the common prefix of two labels' continuations
        pairs = list(zip(tokens[a], tokens[b]))
        return statistics.mean(
            next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in pairs
        )

    return {
        "model": model,
        "expert_type": "q4_0",
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "machine_id": machine_id(),
        "weights": weights_fingerprint(folder),
        "read_bw": read_bw,
        "resident_of": RESIDENT_OF,
        "ms_per_token": {label: _stats(v) for label, v in ms.items()},
        "stall_ms_per_token": {label: _stats(v) for label, v in stall.items()},
        "bytes_per_token": {e: moved[e] for e in RESIDENT_OF},
        "limit_tps": {e: read_bw / moved[e] if read_bw and moved[e] else None for e in RESIDENT_OF},
        "x_llama_cpp": {e: med[e] / med["llama.cpp"] for e in RESIDENT_OF},
        "ar_vs_resident_speed": {e: med[r] / med[e] for e, r in RESIDENT_OF.items()},
        "ar_tokens_equal_resident": {e: tokens[e] == tokens[r] for e, r in RESIDENT_OF.items()},
        "tokens_following_llama_cpp": {
            "checkpoint head": follows("torch", "llama.cpp"),
            "Q4_0 head": follows("torch, Q4_0 head", "llama.cpp"),
        },
        "note": "decode ms/token, medians over interleaved rounds; each configuration loaded afresh per round",
    }


def host(folder: Path, repeats: int = 20, layer: int | None = None, log=print) -> dict:
    """Platform cg: one MoE layer's top-k experts through the host store (pinned host pool → the
    accelerator on the copy stream; on a CPU-only machine the CPU is the accelerator and the copy a
    memcpy) against one copy of the same number of bytes from a pinned buffer, the accelerator's
    measured copy bandwidth: efficiency = (bytes / load seconds) / copy GB/s."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(folder, "host", device=str(device))
    store, cfg = model.experts, model.cfg
    moe = [i for i in range(cfg.layers) if cfg.is_moe(i)]
    layer = layer if layer is not None else moe[len(moe) // 2]
    total = sum(store.expert_bytes((layer, e)) for e in range(cfg.top_k))
    src = torch.empty(total, dtype=torch.uint8)
    src = src.pin_memory() if cuda else src
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(0)
    copy_s, load_s = [], []
    for _ in range(repeats + 1):  # the first round warms up and is not counted
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        t1 = time.perf_counter()
        store.fetch(layer, rng.sample(range(cfg.n_experts), cfg.top_k))  # waits for its copies
        sync()
        t2 = time.perf_counter()
        copy_s.append(t1 - t0)
        load_s.append(t2 - t1)
    store.close()
    copy_s, load_s = copy_s[1:], load_s[1:]
    med_copy, med_load = statistics.median(copy_s), statistics.median(load_s)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (the CPU as the accelerator)",
        "layer": layer,
        "experts": cfg.top_k,
        "bytes": total,
        "copy_ms": _stats([1000 * s for s in copy_s]),
        "load_ms": _stats([1000 * s for s in load_s]),
        "copy_gb_per_s": total / med_copy / 1e9,
        "load_gb_per_s": total / med_load / 1e9,
        "efficiency": med_copy / med_load,
    }


def flash(
    folder: Path, gguf: Path, repeats: int = 20, layer: int | None = None, staging: str = "demand", log=print
) -> dict:
    """One layer's top-6 experts through the flash store (`staging`, cold: the file's pages dropped
    after every load) against six O_DIRECT reads of the same bytes in flight together."""
    store = FlashStore(gguf, staging=staging)
    f = ExpertFile(Path(gguf), staging_buffers=6)  # the raw reads' reference, O_DIRECT
    layer = layer if layer is not None else f.layers[len(f.layers) // 2]
    top_k = 6
    total = top_k * f.expert_nbytes(layer)
    rng = random.Random(0)
    E = f.n_experts(layer)
    read_s, load_s = [], []
    pool = ThreadPoolExecutor(top_k)  # a layer's reads in flight together
    for _ in range(repeats):
        chosen = rng.sample(range(E), top_k)
        t0 = time.perf_counter()
        for raw in list(pool.map(lambda e: f.read_expert(layer, e), chosen)):
            f.release(raw)
        read_s.append(time.perf_counter() - t0)
        chosen = rng.sample(range(E), top_k)
        t0 = time.perf_counter()
        store.fetch(layer, chosen)
        store.end_forward()  # cold: the next load reads the disk
        load_s.append(time.perf_counter() - t0)
    pool.shutdown()
    qtype = f.qtype
    block = max(4096, f.slices[(layer, "down")].nbytes // 4096 * 4096)
    ref = odirect_read_bandwidth(
        Path(gguf).parent, block_size=block, file_size=max(total, block), passes=max(5, repeats // 2)
    )
    store.close()
    f.close()
    med_read, med_load = statistics.median(read_s), statistics.median(load_s)
    res = {
        "expert_type": qtype,
        "staging": staging,
        "layer": layer,
        "experts": top_k,
        "bytes": total,
        "read_ms": _stats([1000 * s for s in read_s]),
        "load_ms": _stats([1000 * s for s in load_s]),
        "read_gb_per_s": total / med_read / 1e9,
        "load_gb_per_s": total / med_load / 1e9,
        "odirect_reference": ref,
    }
    if "gb_per_s_median" in ref:
        res["read_efficiency"] = res["read_gb_per_s"] / ref["gb_per_s_median"]
        res["load_efficiency"] = res["load_gb_per_s"] / ref["gb_per_s_median"]
    return res


def convert_memory(cfg: dict, n_layers: int, qtype: str, folder: Path, log=print) -> dict:
    """Write `n_layers` random MoE layers of `cfg`'s expert shapes with `write_expert_gguf` into
    `folder`; report the file's size, the seconds and the peak RSS (ru_maxrss) of this process."""
    E, H, inter = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    meta = {"n_layer": n_layers + 1, "first_dense": 1, "n_expert": E, "n_embd": H, "n_ff_exp": inter}

    def layers():
        for layer in range(1, n_layers + 1):
            g = torch.Generator().manual_seed(layer)
            log(f"layer {layer}/{n_layers}")
            yield layer, torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        t0 = time.perf_counter()
        path = write_expert_gguf(Path(tmp) / "experts.gguf", layers(), meta, qtype)
        seconds, size = time.perf_counter() - t0, path.stat().st_size
    return {
        "layers": n_layers,
        "type": qtype,
        "file_bytes": size,
        "seconds": seconds,
        "layer_fp32_bytes": E * 3 * H * inter * 4,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
