"""The decoder factory: a method on a platform and an engine → (decoder, tokenizer, cell config).

Every method is one of two decoders over an engine (`draftexpert.decoding.Engine`): AR offload
(`baselines.ar`) or the speculative round (`draftexpert.speculation.round`); the engine is the
torch runtime (platforms resident / cg / mn) or llama.cpp (platform mn). The cell config's
`method_args` name everything that changes what a cell measures (they are hashed into its key).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from baselines.ar import AROffloadDecoder
from bench.cells import calibration
from bench.cells.artifacts import experts_dir, llama_head_for, load_draft_experts_for
from bench.cells.cell import (
    AUTO_PREFETCHING,
    DTYPES,
    ENGINES,
    METHODS,
    PLATFORMS,
    Cell,
    CellError,
    Resolved,
    SpecOptions,
)
from bench.suites.prompts import check_prompt_lengths, render_prompt
from draftexpert.engines.llamacpp import ExpertPages, LlamaEngine, LlamaModel, require_llama_cpp
from draftexpert.engines.reference import ReferenceDecoder
from draftexpert.engines.torch_engine import TorchEngine
from draftexpert.runtime.checkpoint import load_target, load_tokenizer, weights_fingerprint
from draftexpert.runtime.ggml_kernel import resolve_kernel
from draftexpert.runtime.loader import CheckpointError, build_model, load_config, load_router
from draftexpert.runtime.params import GIB, available_host_bytes, check_fits, plan, working_set_bound
from draftexpert.speculation.drafters import DraftExperts, make_draft_path
from draftexpert.speculation.round import SpeculativeDecoder

__all__ = ["DTYPES", "ENGINES", "METHODS", "PLATFORMS", "Cell", "CellError", "SpecOptions", "make_decoder"]


def available_device(platform: str) -> str | None:
    """For the suite's own sweeps (reproduce, fuzz) that run anywhere: cg on the GPU when there is
    one, else on the CPU as the accelerator; other platforms their default."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if platform == "cg" else None


def placement(platform: str, method: str, device: str | None = None, dtype: str = "fp32") -> tuple[str, str]:
    """(device, dtype) of a torch-engine cell. cg computes on a CUDA GPU and is refused without one
    unless `device="cpu"` asks for the CPU as the accelerator (recorded in the cell); resident runs on
    the CPU unless `device="cuda"` puts every expert on the GPU (cg's upper bound, where it fits); mn
    runs on the CPU here. Router, softmax and the V3 bias stay fp32 in every dtype (`DTYPES`)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device: {device!r} is not one of cpu, cuda")
    if platform == "mn" or method == "reference":
        if device == "cuda":
            raise ValueError(
                f"--device cuda: {'the reference' if method == 'reference' else 'platform mn'} runs on "
                "the CPU here (cg is the GPU platform; resident takes --device cuda as its upper bound)"
            )
        device = "cpu"
    elif platform == "resident" and device is None:
        device = "cpu"
    elif device is None or device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--platform {platform}{' --device cuda' if platform == 'resident' else ''} needs a CUDA "
                "GPU, and torch sees none (a CPU build or no device); `--device cpu` runs cg with the "
                "CPU as the accelerator (recorded so)"
            )
        device = "cuda"
    if dtype == "bf16" and method in ("top-r", "draftexpert", "auto"):
        print(
            "warning: --dtype bf16: a verify pass and the one-token step round differently in bf16, so a near-tie "
            "can make the tokens differ from AR's; --dtype fp32 (the default) keeps them equal",
            file=sys.stderr,
        )
    return device, dtype


def _tokenizer(folder: Path):
    try:
        return load_tokenizer(folder)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError / ValueError / its own types
        raise CheckpointError(
            f"the tokenizer in {folder} could not be loaded ({type(e).__name__}); a model folder "
            "needs tokenizer.json and tokenizer_config.json beside config.json"
        ) from None


def _draft_experts(model: str, folder: Path, file: Path | None):
    """The draft experts a DraftExpert cell runs; says so when none are distilled and the zero
    draft expert (= shared+top-1) stands in, unless the user asked for it (`--draft-experts zero`)."""
    draft, meta = load_draft_experts_for(model, folder, file)
    if draft is None and file is None:
        print(
            f"warning: {model} has no distilled draft experts ({experts_dir(model, folder) / 'full.safetensors'} is "
            f"absent): DraftExpert runs the zero draft expert = shared+top-1; `bench distill --model {model}` "
            f"trains them (a real model through the offload runtime; `bench plan --model {model} --distill` first), "
            "`--draft-experts zero` silences this",
            file=sys.stderr,
        )
    return draft, meta


def _fits(
    folder: Path,
    platform: str,
    cuda: bool,
    expert_type: str,
    positions: int,
    dtype_bytes: int = 4,
    working_set: int = 0,
    draft_intermediate: int = 0,
) -> int:
    """The memory plan checked against this machine before anything is loaded (WontFit when even
    its least need does not fit); returns the working-set bound to use: the one asked for, or —
    when a round staging every position would not fit — the bytes that leave room (else 0).
    `draft_intermediate`: DraftExpert's draft-expert width (its drafter's fused shared MLP is counted)."""
    p = plan(
        json.loads((folder / "config.json").read_text()),
        platform,
        cuda,
        dtype_bytes=dtype_bytes,
        expert_type=expert_type,
        positions=positions,
        working_set_bytes=working_set,
        draft_intermediate=draft_intermediate,
    )
    free = None
    if cuda:
        free = torch.cuda.mem_get_info()[0]
    host = available_host_bytes()
    warning = check_fits(p, host, free)
    bound = 0 if working_set else working_set_bound(p, host, free)
    if bound:
        print(
            "note: a round that stages new experts at every position could need "
            f"{p['accelerator' if cuda else 'host'] / GIB:.1f} GiB; its working set is bounded to "
            f"{bound / GIB:.1f} GiB so that it fits (past it the round reloads on demand; --working-set to "
            "choose)",
            file=sys.stderr,
        )
    elif warning:
        print(f"warning: {warning}", file=sys.stderr)
    return working_set or bound


LLAMA_CONTEXT = 2048  # the llama.cpp engine's context (n_ctx), at most the model's


def context_length(folder: Path, engine: str) -> int:
    """The positions one sequence may occupy on `engine` (what every decoder checks per prompt)."""
    n = load_config(folder).max_position_embeddings
    return min(LLAMA_CONTEXT, n) if engine == "llama.cpp" else n


def check_user_prompts(folder: Path, records: list[dict], engine: str) -> None:
    """A user's prompt file checked against the model before any run folder exists (PromptFileError)."""
    check_prompt_lengths(records, _tokenizer(folder), context_length(folder, engine))


def make_llama_decoder(cell: Cell, folder: Path, expert_file: Callable[[str], Path], threads: int):
    """(decoder, tokenizer, resolved) on the llama.cpp engine (greedy): platform mn stages the
    experts from storage (`cell.staging`: demand | pagefault), platform resident keeps them all cached."""
    staging = "resident" if cell.platform == "resident" else cell.staging
    budget = 0 if cell.platform == "resident" else cell.staging_budget
    require_llama_cpp()
    tokenizer = _tokenizer(folder)
    experts = expert_file(cell.expert_type)
    n_ctx = context_length(folder, "llama.cpp")  # checked per prompt
    kv = cell.method_args(Resolved())["kv_type"]
    target_head = llama_head_for(cell.model, folder, cell.expert_type, experts)
    meta = None
    if cell.method == "ar":
        engine = LlamaEngine(
            LlamaModel(target_head, n_ctx, threads, kv_type=kv),
            ExpertPages(experts),
            staging=staging,
            staging_budget=budget,
        )
        decoder = AROffloadDecoder(engine)
    elif cell.method == "pld":  # no drafter model: proposals come from the sequence itself
        target = LlamaModel(target_head, n_ctx, threads, kv_type=kv)
        engine = LlamaEngine(target, ExpertPages(experts), name="pld", staging=staging, staging_budget=budget)
        decoder = SpeculativeDecoder(engine, cell.round_config(), lookup=cell.spec.lookup())
    elif cell.method == "auto":  # a context per drafter; rounds choose among them by price
        draft, meta = _draft_experts(cell.model, folder, cell.spec.draft_experts)
        if draft is None:
            draft = _zero_draft(folder)
        de_head = llama_head_for(cell.model, folder, cell.expert_type, experts, draft, meta.get("sha256") or "zero")
        target = LlamaModel(target_head, n_ctx, threads, kv_type=kv)
        names = cell.auto_drafters(Resolved(top_k=load_config(folder).num_experts_per_tok))
        drafters = {
            name: LlamaModel(
                de_head if name == "draftexpert" else target_head,
                n_ctx,
                threads,
                used_experts=None if name == "draftexpert" else int(name.split("-")[1]),
                tap_router_logits=True,
                kv_type=kv,
            )
            for name in names
        }
        engine = LlamaEngine(
            target,
            ExpertPages(experts),
            router=load_router(folder),
            name="auto",
            staging=staging,
            staging_budget=budget,
            drafters=drafters,
        )
        decoder = SpeculativeDecoder(engine, cell.round_config(), drafters=names, prefetching=AUTO_PREFETCHING)
    else:
        if cell.method == "top-r":
            drafter_head, used, name = target_head, cell.spec.r, cell.label
        else:
            draft, meta = _draft_experts(cell.model, folder, cell.spec.draft_experts)
            if draft is None:
                draft = _zero_draft(folder)
            drafter_head, used, name = (
                llama_head_for(cell.model, folder, cell.expert_type, experts, draft, meta.get("sha256") or "zero"),
                None,
                cell.method,
            )
        target = LlamaModel(target_head, n_ctx, threads, kv_type=kv)
        drafter = LlamaModel(drafter_head, n_ctx, threads, used_experts=used, tap_router_logits=True, kv_type=kv)
        engine = LlamaEngine(
            target,
            ExpertPages(experts),
            drafter,
            load_router(folder),
            name=name,
            staging=staging,
            staging_budget=budget,
        )
        decoder = SpeculativeDecoder(engine, cell.round_config())
    return decoder, tokenizer, Resolved(draft_experts=meta, threads=threads)


def _zero_draft(folder: Path) -> DraftExperts:
    """The zero draft expert (no distilled one): DraftExpert drafts with shared + top-1 alone."""
    hf = load_config(folder)
    return DraftExperts.zeros(
        list(range(hf.first_k_dense_replace, hf.num_hidden_layers)), hf.hidden_size, hf.moe_intermediate_size
    )


def make_decoder(cell: Cell, folder: Path, expert_file: Callable[[str], Path] | None = None):
    """(decoder, tokenizer, cell config) for a cell on the checkpoint in `folder`. `expert_file(type)`
    gives the checkpoint's GGUF expert file (written once) where the cell reads one (platform mn, a
    resident cell held from the file, the llama.cpp engine)."""
    if cell.method == "top-r":
        top_k = load_config(folder).num_experts_per_tok
        if not cell.spec.r < top_k:
            raise CellError(
                f"--r: {cell.spec.r} must be below the target's top-k ({top_k}); r = {top_k} is the target itself"
            )
    top_k = load_config(folder).num_experts_per_tok
    if cell.calibration is not None:  # read before anything loads: a bad profile fails fast
        drafters = cell.auto_drafters(Resolved(top_k=top_k)) if cell.method == "auto" else [cell.label]
        prior, calibrated = calibration.priors(cell.calibration, cell.model, drafters, cell.round_config().k_max)
    if cell.engine == "llama.cpp":
        decoder, tokenizer, resolved = make_llama_decoder(cell, folder, expert_file, torch.get_num_threads())
    else:
        decoder, tokenizer, resolved = _make_torch_decoder(cell, folder, expert_file)
    resolved = replace(resolved, weights=weights_fingerprint(folder), top_k=top_k)  # other weights: other cells
    if cell.calibration is not None:
        decoder.warm_start(prior, calibration.PRIOR_ROUNDS)
        resolved = replace(resolved, calibration=calibrated)
    return decoder, tokenizer, cell.config(resolved)


def _make_torch_decoder(cell: Cell, folder: Path, expert_file: Callable[[str], Path] | None):
    device, dtype = placement(cell.platform, cell.method, cell.device, cell.dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    experts, de_meta = (
        _draft_experts(cell.model, folder, cell.spec.draft_experts)
        if cell.method in ("draftexpert", "auto")
        else (None, None)
    )  # before the plan: the drafter's width is part of it
    draft_intermediate = (
        0
        if cell.method not in ("draftexpert", "auto")
        else experts.intermediate
        if experts is not None
        else json.loads((folder / "config.json").read_text())["moe_intermediate_size"]
    )  # none: the zero draft expert
    working_set = _fits(
        folder,
        cell.store if cell.store == "resident" else cell.platform,
        device == "cuda",
        cell.expert_type,
        cell.positions,
        torch_dtype.itemsize,
        cell.working_set,
        draft_intermediate,
    )  # before anything is loaded

    tokenizer = _tokenizer(folder)
    if cell.method == "reference":
        return ReferenceDecoder(load_target(folder)[0]), tokenizer, Resolved()
    kernel = resolve_kernel(cell.expert_kernel, cell.expert_type if cell.from_file else None, device)
    gguf = expert_file(cell.expert_type) if cell.from_file else None
    target = build_model(
        folder,
        cell.store,
        device=device,
        dtype=torch_dtype,
        gguf_path=gguf,
        cache_experts=cell.cache_experts,
        staging_budget_bytes=cell.staging_budget,
        working_set_bytes=working_set,
        staging=cell.staging,
        kernel=kernel,
        head_type=cell.head_type,
    )
    if cell.compile:
        target.compile_decode()
    if cell.method == "ar":
        decoder = AROffloadDecoder(TorchEngine(target), temperature=cell.temperature, seed=cell.seed)
    elif cell.method == "pld":
        decoder = SpeculativeDecoder(TorchEngine(target), cell.round_config(), lookup=cell.spec.lookup())
    elif cell.method == "auto":  # one engine, every drafter's path over the shared cache; rounds choose by price
        conf = replace(cell.round_config(), draft_cache="shared")
        names = cell.auto_drafters(Resolved(top_k=target.cfg.top_k))
        paths = {
            n: make_draft_path(target, "draftexpert", experts=experts)
            if n == "draftexpert"
            else make_draft_path(target, "top-r", r=int(n.split("-")[1]))
            for n in names
        }
        decoder = SpeculativeDecoder(
            TorchEngine(target, drafters=paths), conf, drafters=names, prefetching=AUTO_PREFETCHING
        )
    else:
        conf = cell.round_config()
        path = make_draft_path(target, cell.method, r=cell.spec.r, experts=experts)
        decoder = SpeculativeDecoder(TorchEngine(target, path, conf.draft_cache), conf)
    if cell.compile:  # compile every shape the method uses now, not inside the first prompt's timing
        decoder.generate(render_prompt(tokenizer, "warm-up"), 12, None)
        if cell.store != "resident":
            target.experts.cache.clear()
    return decoder, tokenizer, Resolved(device=device, kernel=kernel, working_set=working_set, draft_experts=de_meta)
