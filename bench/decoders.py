"""The decoder factory: a method on a platform and an engine → (decoder, tokenizer, cell config).

Every method is one of two decoders over an engine (`draftexpert.decoding.Engine`): AR offload
(`baselines.ar`) or the speculative round (`draftexpert.speculation.round`); the engine is the
torch runtime (platforms resident / cg / mn) or llama.cpp (platform mn). The cell config's
`method_args` name everything that changes what a cell measures (they are hashed into its key).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from bench.artifacts import llama_head_for, load_draft_experts_for
from bench.prompts import render_prompt
from bench.runner import CellConfig
from draftexpert.speculation.round import SpecConfig

PLATFORMS = {"mn": "flash", "cg": "host", "resident": "resident"}  # platform → expert store (torch engine)
METHODS = ("ar", "reference", "top-r", "draftexpert")
ENGINES = ("torch", "llama.cpp")
# The torch engine's compute dtype. Experts are held and moved in the checkpoint's dtype (bf16 for the real models)
# and converted on the accelerator after the copy; fp32 compute keeps speculation exact (a K-token verify pass
# and one-token steps round alike), bf16 compute is the paper's and faster on a GPU, but its batch-dependent
# rounding can flip a near-tie between a verify pass and the one-token step.
DTYPES = ("fp32", "bf16")


def available_device(platform: str) -> str | None:
    """For the suite's own sweeps (reproduce, fuzz) that run anywhere: cg on the GPU when there is
    one, else on the CPU as the accelerator; other platforms their default."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if platform == "cg" else None


def placement(platform: str, method: str, device: str | None = None, dtype: str = "fp32") -> tuple[str, str]:
    """(device, dtype) of a torch-engine cell. cg computes on a CUDA GPU and is refused without one
    unless `device="cpu"` asks for the CPU as the accelerator (recorded in the cell); resident runs on
    the CPU unless `device="cuda"` puts every expert on the GPU (cg's upper bound, where it fits); mn
    runs on the CPU here. Router, softmax and the V3 bias stay fp32 in every dtype (`DTYPES`)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device: {device!r} is not one of cpu, cuda")
    if platform == "mn" or method == "reference":
        if device == "cuda":
            raise ValueError(f"--device cuda: {'the reference' if method == 'reference' else 'platform mn'} runs on "
                             "the CPU here (cg is the GPU platform; resident takes --device cuda as its upper bound)")
        device = "cpu"
    elif platform == "resident" and device is None:
        device = "cpu"
    elif device is None or device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--platform {platform}{' --device cuda' if platform == 'resident' else ''} needs a CUDA "
                             "GPU, and torch sees none (a CPU build or no device); `--device cpu` runs cg with the "
                             "CPU as the accelerator (recorded so)")
        device = "cuda"
    if dtype == "bf16" and method in ("top-r", "draftexpert"):
        print("warning: --dtype bf16: a verify pass and the one-token step round differently in bf16, so a near-tie "
              "can make the tokens differ from AR's; --dtype fp32 (the default) keeps them equal", file=sys.stderr)
    return device, dtype


@dataclass(frozen=True)
class SpecOptions:
    """A speculative method's options, built once (CLI, compare sets, reproduce): the drafter's
    (`r` routed experts for top-r; the `draft_experts` checkpoint for DraftExpert — default the
    model's distilled `full` preset, else zero) and the round's (`SpecConfig`)."""

    r: int = 1
    draft_experts: Path | None = None
    round: SpecConfig = field(default_factory=SpecConfig)

    def with_(self, **overrides) -> SpecOptions:
        """The same options with some changed; a key is the drafter's or a `SpecConfig` field."""
        own = {k: overrides.pop(k) for k in ("r", "draft_experts") if k in overrides}
        unknown = set(overrides) - {f.name for f in fields(SpecConfig)}
        if unknown:
            raise ValueError(f"unknown speculation option(s): {', '.join(sorted(unknown))}")
        return replace(self, **own, round=replace(self.round, **overrides))

    def as_dict(self) -> dict:
        return {"r": self.r, "draft_experts": str(self.draft_experts) if self.draft_experts else None,
                **asdict(self.round)}


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    from draftexpert.runtime.loader import CheckpointError

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError / ValueError / its own types
        raise CheckpointError(f"the tokenizer in {folder} could not be loaded ({type(e).__name__}); a model folder "
                              "needs tokenizer.json and tokenizer_config.json beside config.json") from None


def _draft_experts(model: str, folder: Path, file: Path | None):
    """The draft experts a DraftExpert cell runs; says so when none are distilled and the zero
    draft expert (= shared+top-1) stands in, unless the user asked for it (`--draft-experts zero`)."""
    draft, meta = load_draft_experts_for(model, folder, file)
    if draft is None and file is None:
        from bench.artifacts import experts_dir

        print(f"warning: {model} has no distilled draft experts ({experts_dir(model, folder) / 'full.safetensors'} is "
              f"absent): DraftExpert runs the zero draft expert = shared+top-1; `bench distill --model {model}` "
              "trains them (a real model through the offload runtime; `bench plan --model {model} --distill` first), "
              "`--draft-experts zero` silences this", file=sys.stderr)
    return draft, meta


def _fits(folder: Path, platform: str, cuda: bool, expert_type: str, positions: int, dtype_bytes: int = 4,
          working_set: int = 0, draft_intermediate: int = 0) -> int:
    """The memory plan checked against this machine before anything is loaded (WontFit when even
    its least need does not fit); returns the working-set bound to use: the one asked for, or —
    when a round staging every position would not fit — the bytes that leave room (else 0).
    `draft_intermediate`: DraftExpert's draft-expert width (its drafter's fused shared MLP is counted)."""
    import json

    from draftexpert.runtime.params import GIB, available_host_bytes, check_fits, plan, working_set_bound

    p = plan(json.loads((folder / "config.json").read_text()), platform, cuda, dtype_bytes=dtype_bytes,
             expert_type=expert_type, positions=positions, working_set_bytes=working_set,
             draft_intermediate=draft_intermediate)
    free = None
    if cuda:
        import torch

        free = torch.cuda.mem_get_info()[0]
    host = available_host_bytes()
    warning = check_fits(p, host, free)
    bound = 0 if working_set else working_set_bound(p, host, free)
    if bound:
        print(f"note: a round that stages new experts at every position could need {p['accelerator' if cuda else 'host'] / GIB:.1f} "
              f"GiB; its working set is bounded to {bound / GIB:.1f} GiB so that it fits (past it the round reloads on "
              "demand; --working-set to choose)", file=sys.stderr)
    elif warning:
        print(f"warning: {warning}", file=sys.stderr)
    return working_set or bound


LLAMA_CONTEXT = 2048  # the llama.cpp engine's context (n_ctx), at most the model's


def context_length(folder: Path, engine: str) -> int:
    """The positions one sequence may occupy on `engine` (what every decoder checks per prompt)."""
    from draftexpert.runtime.loader import load_config

    n = load_config(folder).max_position_embeddings
    return min(LLAMA_CONTEXT, n) if engine == "llama.cpp" else n


def check_user_prompts(folder: Path, records: list[dict], engine: str) -> None:
    """A user's prompt file checked against the model before any run folder exists (PromptFileError)."""
    from bench.prompts import check_prompt_lengths

    check_prompt_lengths(records, _tokenizer(folder), context_length(folder, engine))


def _round_args(conf: SpecConfig, *drop: str) -> dict:
    return {k: v for k, v in asdict(conf).items() if k not in ("temperature", "seed", *drop)}


def make_llama_decoder(model: str, folder: Path, method: str, platform: str, expert_type: str,
                       expert_file: Callable[[str], Path], spec: SpecOptions, threads: int, max_new_tokens: int,
                       temperature: float = 0.0, staging: str = "demand"):
    """(decoder, tokenizer, cell config) on the llama.cpp engine (greedy): platform mn stages the
    experts from storage (`staging`: demand | pagefault), platform resident keeps them all cached."""
    from baselines.ar import AROffloadDecoder
    from draftexpert.engines.llamacpp import STAGING, ExpertPages, LlamaEngine, LlamaModel, require_llama_cpp
    from draftexpert.runtime.loader import load_config, load_router
    from draftexpert.speculation.drafters import DraftExperts
    from draftexpert.speculation.round import SpeculativeDecoder

    if method not in ("ar", "top-r", "draftexpert"):
        raise ValueError(f"--method {method} does not run on the llama.cpp engine (ar, top-r, draftexpert do)")
    if temperature > 0:
        raise ValueError("--temperature: the llama.cpp engine decodes greedily; use the torch engine to sample")
    if platform not in ("mn", "resident"):
        raise ValueError(f"--platform: the llama.cpp engine runs mn (experts from storage) or resident, not {platform}")
    if staging not in ("demand", "pagefault"):
        raise ValueError(f"--staging: {staging!r} is not one of demand, pagefault on the llama.cpp engine")
    staging = "resident" if platform == "resident" else staging
    require_llama_cpp()
    tokenizer = _tokenizer(folder)
    experts = expert_file(expert_type)
    n_ctx = context_length(folder, "llama.cpp")  # checked per prompt
    kv = "f32" if expert_type == "f32" else "f16"  # an f32 model keeps an f32 cache; else llama.cpp's f16
    target_head = llama_head_for(model, folder, expert_type, experts)
    args = {"expert_type": expert_type, "threads": threads, "kv_type": kv, "staging": STAGING[staging]}
    if method == "ar":
        engine = LlamaEngine(LlamaModel(target_head, n_ctx, threads, kv_type=kv), ExpertPages(experts), staging=staging)
        decoder = AROffloadDecoder(engine)
    else:
        conf = replace(spec.round, draft_cache="shared")  # llama.cpp: the drafter always has its own context
        if method == "top-r":
            drafter_head, used, name = target_head, spec.r, f"top-{spec.r}"
            args["r"] = spec.r
        else:
            draft, meta = _draft_experts(model, folder, spec.draft_experts)
            if draft is None:
                hf = load_config(folder)
                draft = DraftExperts.zeros(list(range(hf.first_k_dense_replace, hf.num_hidden_layers)),
                                           hf.hidden_size, hf.moe_intermediate_size)
            drafter_head, used, name = llama_head_for(model, folder, expert_type, experts, draft,
                                                      meta.get("sha256") or "zero"), None, method
            args["draft_experts"] = meta
        target = LlamaModel(target_head, n_ctx, threads, kv_type=kv)
        drafter = LlamaModel(drafter_head, n_ctx, threads, used_experts=used, tap_router_logits=True, kv_type=kv)
        engine = LlamaEngine(target, ExpertPages(experts), drafter, load_router(folder), name=name, staging=staging)
        decoder = SpeculativeDecoder(engine, conf)
        args.update(_round_args(conf, "draft_cache"))
    cfg = CellConfig(model=model, method=method, platform=platform, engine="llama.cpp", max_new_tokens=max_new_tokens,
                     method_args=args)
    return decoder, tokenizer, cfg


def make_decoder(model: str, folder: Path, method: str, platform: str, expert_type: str = "q4_0",
                 cache_experts: int = 0, staging_budget: int = 0, temperature: float = 0.0, seed: int = 0,
                 max_new_tokens: int = 64, expert_file: Callable[[str], Path] | None = None,
                 spec: SpecOptions = SpecOptions(), compile: bool = False, engine: str = "torch",
                 staging: str = "demand", resident_from_file: bool = False, device: str | None = None,
                 dtype: str = "fp32", working_set: int = 0, expert_kernel: str = "auto",
                 head_type: str = "checkpoint"):
    """(decoder, tokenizer, cell config) for a method on a platform. `expert_file(type)` gives
    the GGUF expert file of the checkpoint (written once) for platform mn; `spec` the speculative
    methods' options. `engine`: torch, or llama.cpp (platforms mn and resident; `staging` how it
    brings experts from storage on mn). `resident_from_file`: platform resident holds the expert
    file's (`expert_type`) experts — the same model as an mn run of that file, nothing moved
    (llama.cpp's resident platform always does). `device`, `dtype`: the torch engine's (`placement`);
    `working_set`: bytes a round may keep on the accelerator (torch engine, cg / mn; 0: unbounded);
    `expert_kernel`: how the torch engine computes Q4_0 experts (`ggml_kernel.resolve_kernel`);
    `head_type`: its non-routed weights (`loader.HEAD_TYPES`)."""
    import torch

    from draftexpert.runtime.checkpoint import weights_fingerprint

    if engine not in ENGINES:
        raise ValueError(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "llama.cpp":
        if compile:
            raise ValueError("--compile applies to the torch engine only")
        if device is not None or dtype != "fp32" or working_set or expert_kernel != "auto" or head_type != "checkpoint":
            raise ValueError("--device / --dtype / --working-set / --expert-kernel / --head-type apply to the torch engine "
                             "(llama.cpp runs the model file's types and stages through the page cache)")
        decoder, tokenizer, cfg = make_llama_decoder(model, folder, method, platform, expert_type, expert_file, spec,
                                                     torch.get_num_threads(), max_new_tokens, temperature, staging)
    else:
        decoder, tokenizer, cfg = _make_torch_decoder(model, folder, method, platform, expert_type, cache_experts,
                                                      staging_budget, temperature, seed, max_new_tokens, expert_file,
                                                      spec, compile, staging, resident_from_file, device, dtype,
                                                      working_set, expert_kernel, head_type)
    cfg.weights = weights_fingerprint(folder)  # results of other weights are other cells
    return decoder, tokenizer, cfg


def _make_torch_decoder(model, folder, method, platform, expert_type, cache_experts, staging_budget, temperature,
                        seed, max_new_tokens, expert_file, spec, compile, staging, resident_from_file, device, dtype,
                        working_set, expert_kernel="auto", head_type="checkpoint"):
    import json

    import torch

    from draftexpert.runtime.experts import STAGING

    if staging not in STAGING:
        raise ValueError(f"--staging: {staging!r} is not one of {', '.join(STAGING)} on the torch engine")
    store = "resident" if method == "reference" else PLATFORMS[platform]
    device, dtype = placement(platform, method, device, dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if working_set and store == "resident":
        raise ValueError("--working-set bounds what a round moves to the accelerator: platforms cg and mn")
    experts, de_meta = (_draft_experts(model, folder, spec.draft_experts) if method == "draftexpert"
                        else (None, None))  # before the plan: the drafter's width is part of it
    draft_intermediate = 0 if method != "draftexpert" else experts.intermediate if experts is not None else \
        json.loads((folder / "config.json").read_text())["moe_intermediate_size"]  # none: the zero draft expert
    working_set = _fits(folder, "resident" if method == "reference" else platform, device == "cuda", expert_type,
                        1 if method in ("ar", "reference") else spec.round.k_max + 1,
                        torch_dtype.itemsize, working_set, draft_intermediate)  # before anything is loaded

    tokenizer = _tokenizer(folder)
    if method == "reference":
        from draftexpert.engines.reference import ReferenceDecoder
        from draftexpert.runtime.checkpoint import load_target

        cfg = CellConfig(model=model, method=method, platform="resident", max_new_tokens=max_new_tokens)
        return ReferenceDecoder(load_target(folder)[0]), tokenizer, cfg
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    from draftexpert.engines.torch_engine import TorchEngine
    from draftexpert.runtime.loader import build_model

    from draftexpert.runtime.ggml_kernel import resolve_kernel

    from_file = store == "flash" or (store == "resident" and resident_from_file)
    kernel = resolve_kernel(expert_kernel, expert_type if from_file else None, device)
    gguf = expert_file(expert_type) if from_file else None
    target = build_model(folder, store, device=device, dtype=torch_dtype, gguf_path=gguf, cache_experts=cache_experts,
                         staging_budget_bytes=staging_budget, working_set_bytes=working_set, staging=staging,
                         kernel=kernel, head_type=head_type)
    args = {"store": store, "device": device, "cache_experts": cache_experts}
    if dtype != "fp32":  # recorded only then, so fp32 cells keep their keys
        args["dtype"] = dtype
    if working_set:
        args["working_set"] = working_set
    if store == "resident" and from_file:  # recorded only then, so checkpoint-resident cells keep their keys
        args["expert_type"] = expert_type
    if kernel != "dequant":  # recorded only then, so dequantising cells keep their keys
        args["expert_kernel"] = kernel
    if head_type != "checkpoint":  # likewise
        args["head_type"] = head_type
    if compile:  # recorded only when on, so earlier eager cells keep their keys
        target.compile_decode()
        args["compiled"] = True
    if store == "flash":
        args.update(expert_type=expert_type, staging_budget=staging_budget, staging=STAGING[staging])
    if method == "ar":
        from baselines.ar import AROffloadDecoder

        decoder = AROffloadDecoder(TorchEngine(target), temperature=temperature, seed=seed)
    else:
        from draftexpert.speculation.drafters import make_draft_path
        from draftexpert.speculation.round import SpeculativeDecoder

        conf = replace(spec.round, temperature=temperature, seed=seed)
        path = make_draft_path(target, method, r=spec.r, experts=experts)
        decoder = SpeculativeDecoder(TorchEngine(target, path, conf.draft_cache), conf)
        args.update(_round_args(conf))
        if method == "top-r":
            args["r"] = spec.r
        else:
            args["draft_experts"] = de_meta
    if compile:  # compile every shape the method uses now, not inside the first prompt's timing
        decoder.generate(render_prompt(tokenizer, "warm-up"), 12, None)
        if store != "resident":
            target.experts.cache.clear()
    cfg = CellConfig(model=model, method=method, platform=platform, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed, method_args=args)
    return decoder, tokenizer, cfg
