"""The runner: one configuration × a list of prompts → one record per prompt in a run folder.

It renders each prompt with the model's chat template, calls the method's `Decoder.generate`,
and appends the record. Cells already in the folder (same configuration hash and prompt id)
are skipped, so an interrupted sweep resumes where it stopped. Metrics beyond the per-prompt
ones are computed afterwards from the records (`bench.results.load_results`).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.results import RecordWriter, RunManifest, cell_key, config_hash
from draftexpert.decoding import Decoder
from draftexpert.ledger import PREFETCH_COUNTERS


@dataclass
class CellConfig:
    """What identifies a cell besides its prompt (hashed into the record key)."""

    model: str
    method: str
    platform: str = "resident"
    engine: str = "torch"
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    method_args: dict = field(default_factory=dict)  # r, k_max, tau, budget, truncate, prefetch …


PLATFORMS = {"mn": "flash", "cg": "host", "resident": "resident"}  # platform → expert store


def expert_file_for(model: str, folder: Path, qtype: str, out: Path | None = None,
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Path:
    """The GGUF expert file of a checkpoint, written once and reused: its name carries a
    fingerprint of config.json and the shards' names, sizes and mtimes."""
    import hashlib

    from bench.sources import cache_dir
    from draftexpert.loader import convert_experts

    h = hashlib.sha256((folder / "config.json").read_bytes())
    h.update(b"expert split v2")  # v2: the file is split 2 of the llama.cpp model (split.no = 1)
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = out or cache_dir() / "gguf" / f"{model}-{qtype}-{h.hexdigest()[:12]}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the {qtype} expert file {path} (once)")
        convert_experts(folder, path, qtype)
    return path


METHODS = ("ar", "reference", "top-r", "draftexpert")
ENGINES = ("torch", "llama.cpp")


def llama_head_for(model: str, folder: Path, qtype: str, expert_file: Path, draft=None, draft_id: str | None = None,
                   log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Path:
    """Split 1 of the llama.cpp model (the target's, or a DraftExpert drafter's), written once next
    to the expert file, whose symlink is split 2 (`draftexpert.llama_gguf`)."""
    from draftexpert.llama_gguf import link_experts, split_name, write_head

    prefix = expert_file.with_suffix("") / ("target" if draft is None else f"draftexpert-{draft_id}")
    head = split_name(prefix, 1)
    if not head.exists():
        head.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the llama.cpp {qtype} head {head} (once)")
        write_head(folder, head, qtype, draft)
    link_experts(prefix, expert_file)
    return head


def make_llama_decoder(model: str, folder: Path, method: str, expert_type: str, expert_file: Callable[[str], Path],
                       spec: dict | None, threads: int, max_new_tokens: int, temperature: float = 0.0):
    """(decoder, tokenizer, cell config) on the llama.cpp engine (platform mn, greedy)."""
    import numpy as np
    from transformers import AutoTokenizer

    from draftexpert.llamacpp import (ExpertPages, LlamaARDecoder, LlamaModel, LlamaSpeculativeDecoder,
                                      require_llama_cpp)
    from draftexpert.loader import Checkpoint, load_config

    if method not in ("ar", "top-r", "draftexpert"):
        raise ValueError(f"--method {method} does not run on the llama.cpp engine (ar, top-r, draftexpert do)")
    if temperature > 0:
        raise ValueError("--temperature: the llama.cpp engine decodes greedily; use the torch engine to sample")
    require_llama_cpp()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf = load_config(folder)
    experts = expert_file(expert_type)
    pages = ExpertPages(experts)
    n_ctx = 2048
    kv = "f32" if expert_type == "f32" else "f16"  # an f32 model keeps an f32 cache; else llama.cpp's f16
    target = LlamaModel(llama_head_for(model, folder, expert_type, experts), n_ctx, threads, kv_type=kv)
    args = {"expert_type": expert_type, "threads": threads, "kv_type": kv,
            "staging": "mmap page faults; expert pages evicted after every step/round (madvise + fadvise DONTNEED)"}
    if method == "ar":
        decoder = LlamaARDecoder(target, pages)
    else:
        from draftexpert.speculative import SpecConfig

        spec = dict(spec or {})
        r = spec.pop("r", 1)
        de_file = spec.pop("draft_experts", None)
        spec.pop("draft_cache", None)  # llama.cpp: the drafter always has its own context
        conf = SpecConfig(**spec)
        if method == "top-r":
            drafter = LlamaModel(llama_head_for(model, folder, expert_type, experts), n_ctx, threads,
                                 used_experts=r, tap_router_logits=True, kv_type=kv)
            args["r"] = r
        else:
            draft, meta = load_experts(model, folder, de_file)
            if draft is None:
                from draftexpert.drafters import DraftExperts

                draft = DraftExperts.zeros(list(range(hf.first_k_dense_replace, hf.num_hidden_layers)),
                                           hf.hidden_size, hf.moe_intermediate_size)
            head = llama_head_for(model, folder, expert_type, experts, draft, meta.get("sha256") or "zero")
            drafter = LlamaModel(head, n_ctx, threads, tap_router_logits=True, kv_type=kv)
            args["draft_experts"] = meta
        ckpt = Checkpoint(folder)
        bias = {i: ckpt.get(f"model.layers.{i}.mlp.gate.e_score_correction_bias").float().numpy().astype(np.float32)
                for i in range(hf.first_k_dense_replace, hf.num_hidden_layers)
                if f"model.layers.{i}.mlp.gate.e_score_correction_bias" in ckpt.keys()}
        decoder = LlamaSpeculativeDecoder(target, drafter, pages, conf, hf.num_experts_per_tok, bias,
                                          name=f"top-{r}" if method == "top-r" else method)
        args.update({k: v for k, v in asdict(conf).items() if k not in ("temperature", "seed", "draft_cache")})
    cfg = CellConfig(model=model, method=method, platform="mn", engine="llama.cpp", max_new_tokens=max_new_tokens,
                     method_args=args)
    return decoder, tokenizer, cfg


def make_decoder(model: str, folder: Path, method: str, platform: str, expert_type: str = "q4_0",
                 cache_experts: int = 0, staging_budget: int = 0, temperature: float = 0.0, seed: int = 0,
                 max_new_tokens: int = 64, expert_file: Callable[[str], Path] | None = None,
                 spec: dict | None = None, compile: bool = False, engine: str = "torch"):
    """(decoder, tokenizer, cell config) for a method on a platform. `expert_file(type)` gives
    the GGUF expert file of the checkpoint (written once) for platform mn. `spec` holds the
    speculative methods' arguments: r, and `SpecConfig` fields (k_max, tau, budget,
    budget_mode, truncate, prefetch, draft_cache). `engine`: torch, or llama.cpp (platform mn)."""
    import torch
    from transformers import AutoTokenizer

    if engine not in ENGINES:
        raise ValueError(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "llama.cpp":
        if platform != "mn":
            raise ValueError(f"--platform: the llama.cpp engine runs platform mn (experts from storage), not {platform}")
        if compile:
            raise ValueError("--compile applies to the torch engine only")
        return make_llama_decoder(model, folder, method, expert_type, expert_file, spec, torch.get_num_threads(),
                                  max_new_tokens, temperature)

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if method == "reference":
        from draftexpert.checkpoint import load_target
        from draftexpert.reference import ReferenceDecoder

        cfg = CellConfig(model=model, method=method, platform="resident", max_new_tokens=max_new_tokens)
        return ReferenceDecoder(load_target(folder)[0]), tokenizer, cfg
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    from draftexpert.loader import build_model

    store = PLATFORMS[platform]
    device = "cuda" if platform == "cg" and torch.cuda.is_available() else "cpu"
    gguf = expert_file(expert_type) if store == "flash" else None
    target = build_model(folder, store, device=device, gguf_path=gguf, cache_experts=cache_experts,
                         staging_budget_bytes=staging_budget)
    args = {"store": store, "device": device, "cache_experts": cache_experts}
    if compile:  # recorded only when on, so earlier eager cells keep their keys
        target.compile_decode()
        args["compiled"] = True
    if store == "flash":
        args.update(expert_type=expert_type, staging_budget=staging_budget)
    if method == "ar":
        from baselines.ar import AROffloadDecoder

        decoder = AROffloadDecoder(target, temperature=temperature, seed=seed)
    else:
        from draftexpert.drafters import make_draft_path
        from draftexpert.speculative import SpecConfig, SpeculativeDecoder

        spec = dict(spec or {})
        r = spec.pop("r", 1)
        de_file = spec.pop("draft_experts", None)
        conf = SpecConfig(**spec, temperature=temperature, seed=seed)
        experts, de_meta = (load_experts(model, folder, de_file) if method == "draftexpert" else (None, None))
        path = make_draft_path(target, method, r=r, experts=experts)
        decoder = SpeculativeDecoder(target, path, conf)
        args.update({k: v for k, v in asdict(conf).items() if k not in ("temperature", "seed")})
        if method == "top-r":
            args["r"] = r
        else:
            args["draft_experts"] = de_meta
    if compile:  # compile every shape the method uses now, not inside the first prompt's timing
        decoder.generate(render_prompt(tokenizer, "warm-up"), 12, None)
        if store != "resident":
            target.experts.cache.clear()
    cfg = CellConfig(model=model, method=method, platform=platform, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed, method_args=args)
    return decoder, tokenizer, cfg


def load_experts(model: str, folder: Path, file: Path | str | None):
    """(DraftExperts or None, description): `file` if given, else the model's distilled `full`
    preset when one exists, else None — the zero draft expert (shared + top-1)."""
    import hashlib

    from bench.distill import find_draft_experts
    from draftexpert.distill import load_draft_experts

    path = Path(file) if file else find_draft_experts(model, folder, "full")
    if path is None:
        return None, {"preset": "zero", "file": None}
    experts, meta = load_draft_experts(path, folder)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return experts, {"preset": meta.get("preset"), "file": path.name, "sha256": digest, "steps": meta.get("steps")}


def render_prompt(tokenizer, text: str) -> list[int]:
    """User message → token ids through the tokenizer's chat template, generation prompt added."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def ledger_fields(ledger: dict | None) -> dict:
    """Decode-phase movement, flattened for tables (Fig. 1b); phases other than prefill(-draft) are decode.
      decode_loads / decode_bytes   experts loaded on demand and bytes read after prefill
      decode_stall_s                seconds decode waited for loads
      decode_compute_s              decode forward seconds minus stall
      loading_share                 = decode_stall_s / (decode_stall_s + decode_compute_s)
      prefetch_*                    issued / bytes / hits / waste / misses (speculation; see the Ledger)
      moved_loads / moved_bytes     = decode_loads + prefetch_issued / decode_bytes + prefetch_bytes"""
    if not ledger:
        return {}
    phases = [v for k, v in ledger["by_phase"].items() if not k.startswith("prefill")]
    stall = sum(p["stall_s"] for p in phases)
    compute = sum(p["compute_s"] for p in phases)
    pf = ledger.get("prefetch") or dict.fromkeys(PREFETCH_COUNTERS, 0)
    loads, nbytes = sum(p["loads"] for p in phases), sum(p["bytes"] for p in phases)
    return {"decode_loads": loads, "decode_bytes": nbytes,
            "decode_stall_s": stall, "decode_compute_s": compute,
            "loading_share": stall / (stall + compute) if stall + compute > 0 else 0.0,
            **{f"prefetch_{k}": v for k, v in pf.items() if k in PREFETCH_COUNTERS},
            "moved_loads": loads + pf["issued"], "moved_bytes": nbytes + pf["bytes"],
            **{f"{k}_s": v["wall_s"] for k, v in ledger["by_phase"].items() if k in ("draft", "verify", "ar")},
            **{f"{k}_stall_s": v["stall_s"] for k, v in ledger["by_phase"].items() if k in ("draft", "verify", "ar")}}


def run_cells(cfg: CellConfig, prompts: list[dict], decoder: Decoder, tokenizer, run_dir: Path,
              machine: dict | None = None, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
              run_name: str | None = None) -> dict:
    """Decode every prompt not yet in `run_dir`; return a summary of this session."""
    from bench.telemetry import machine_id

    conf = asdict(cfg)
    mid = (machine or {}).get("machine_id") or machine_id()
    ident = {**conf, "machine_id": mid}  # the same cell on another machine is a new cell
    h = config_hash(ident)
    manifest = RunManifest(run_dir, conf, machine)
    written = skipped = 0
    status = "interrupted"
    try:
        with RecordWriter(run_dir) as store:
            if store.repaired_bytes:
                log(f"repaired a torn last record ({store.repaired_bytes} bytes) in {store.path}; it will be redone")
            for p in prompts:
                key = cell_key(ident, p["id"])
                if key in store.done:
                    skipped += 1
                    continue
                ids = render_prompt(tokenizer, p["prompt"])
                out = decoder.generate(ids, cfg.max_new_tokens, tokenizer.eos_token_id)
                record = {
                    "key": key, "run": run_name or Path(run_dir).name, "config_hash": h, "machine_id": mid, **conf,
                    "prompt_id": p["id"], "category": p["category"], "prompt_tokens": len(ids),
                    "tokens": out.tokens, "new_tokens": len(out.tokens),
                    "prefill_s": out.prefill_s, "decode_s": out.decode_s, "decode_tps": out.decode_tps,
                    "finished_at": time.time(), **out.stats, **ledger_fields(out.stats.get("ledger")),
                }
                store.write(record)
                written += 1
                log(f"{p['id']}: {len(out.tokens)} tokens, {out.decode_tps:.1f} tok/s")
        status = "complete"
    finally:
        manifest.finish(status, written=written, skipped=skipped)
    return {"run_dir": str(run_dir), "config_hash": h, "written": written, "skipped": skipped,
            "records": written + skipped}
