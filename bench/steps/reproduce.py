"""`make reproduce`: regenerate every result the suite can produce today, into results/.

Each step is a bench command whose JSON lands in results/, followed by the paper_figs renderer
that turns it into a table / figure. Steps whose capability has not landed yet are listed as
pending, never faked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import paper_figs.engines
import paper_figs.fig2
import paper_figs.fig3
import paper_figs.fig45
import paper_figs.regime
import paper_figs.spec_table
import paper_figs.table1
from bench.cells import registry
from bench.cells.artifacts import dense_counterpart_for, expert_file_for, llama_head_for
from bench.cells.cell import Cell
from bench.cells.decoders import available_device, make_decoder
from bench.runs.readcap import ReadCap, ReadCapError
from bench.runs.results import load_results, write_json_atomic
from bench.runs.runner import run_cells
from bench.runs.telemetry import collect, expert_storage, machine_id
from bench.steps import distill as bd
from bench.steps import specbench, speed
from bench.steps import speculation_plan as sp
from bench.steps.compare import REGIME_CAPS, compare, measured_read_bw
from bench.steps.crosscheck import crosscheck as crosscheck_engines
from bench.steps.sweep import verify_sweep
from bench.suites import prompts
from bench.suites.prompts import render_prompt
from draftexpert import metrics
from draftexpert.engines.llamacpp import LlamaCppError, require_llama_cpp
from draftexpert.runtime.checkpoint import load_tokenizer, weights_fingerprint
from draftexpert.runtime.loader import build_model
from draftexpert.runtime.params import breakdown
from paper_figs import captions, fig1a, fig1b

# What the paper has that this checkout cannot regenerate on a machine without a GPU, and what brings it.
PENDING_WITHOUT_GPU = [
    (
        "Table 2 cg rows",
        "a CUDA GPU (`make reproduce` runs them when torch sees one); on a CPU, `bench compare "
        "--platform cg --device cpu` runs them with the CPU as the accelerator",
    ),
]


def _folder(model: str, folders: dict[str, Path] | None) -> Path:
    """Where `model`'s checkpoint is: `folders` (a real model's --model-path), else the registry's search."""
    return (folders or {}).get(model) or registry.resolve(model)


TINY_MODELS = ("ds-tiny", "ml-tiny")  # every per-model step runs on these (`bench reproduce --model` picks some)
FIG1B_MODEL = "ds-tiny"
FIG1B_PER_SUITE = 2
FIG1B_TOKENS = 64
# cg ignores the expert type (host pool in the checkpoint's dtype)
FIG1B_CELLS = [("mn", "q4_0"), ("mn", "bf16"), ("cg", "q4_0")]
FIG1B_THREADS = 1  # timings on one thread: comparable across machines with more cores, and with a busy neighbour


def fig1b_runs(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    model: str = FIG1B_MODEL,
    folders: dict[str, Path] | None = None,
    cells_to_run: list[tuple[str, str]] | None = None,
    device: str | None = None,
    dtype: str = "fp32",
) -> list[str]:
    """AR-offload runs for Fig. 1b (resumable: finished prompts are skipped), then the figure;
    `cells_to_run` (platform, expert type) default FIG1B_CELLS; `device` cg's accelerator."""
    torch.set_num_threads(FIG1B_THREADS)
    folder = _folder(model, folders)
    recs = prompts.load(limit=per_suite)
    runs = results_dir / "runs"
    machine = collect(expert_storage(), keep_probe=True)
    cells = set()
    for platform, qtype in cells_to_run or FIG1B_CELLS:
        cell = Cell(
            model=model,
            method="ar",
            platform=platform,
            expert_type=qtype,
            max_new_tokens=tokens,
            device=(device or available_device(platform)) if platform == "cg" else available_device(platform),
            **({"dtype": dtype} if platform == "cg" else {}),
        )
        decoder, tok, cfg = make_decoder(cell, folder, lambda qt: expert_file_for(model, folder, qt, log=log))
        name = f"fig1b-{model}-{platform}" + (f"-{qtype}" if platform == "mn" else "")
        cells.add(run_cells(cfg, recs, decoder, tok, runs / name, machine=machine, log=log)["config_hash"])
        decoder.close()
    fig1b_dirs = sorted(p.name for p in runs.iterdir() if p.name.startswith(f"fig1b-{model}-"))
    b = fig1b.breakdown(load_results(*[runs / d for d in fig1b_dirs]), config_hashes=cells)
    (results_dir / "fig1b_breakdown.md").write_text(fig1b.table(b))
    figs = fig1b.figure(
        b,
        results_dir / "figures" / "fig1b_breakdown",
        f"results/runs/fig1b-{model}-*, machine {machine['machine_id']}",
    )
    return [
        "results/runs/fig1b-*",
        "results/fig1b_breakdown.md",
        *[str(p.relative_to(results_dir.parent)) for p in figs],
    ]


def _compare_set(
    results_dir: Path,
    log,
    model: str,
    per_suite: int,
    tokens: int,
    method_set: str,
    engine: str = "torch",
    platform: str = "mn",
    device: str | None = None,
    folders: dict[str, Path] | None = None,
    dtype: str = "fp32",
    suites: tuple[str, ...] | None = None,
) -> dict:
    """One `bench compare` set for a tiny model on mn (Q4_0, the library's default round settings; resumable),
    its per-prompt tokens dropped from the result; `platform` cg moves the checkpoint's experts from
    host memory to `device` instead (the same round settings)."""
    torch.set_num_threads(FIG1B_THREADS)
    folder = _folder(model, folders)
    tag = "-llama.cpp" if engine == "llama.cpp" else ""
    res = compare(
        Cell(
            model=model,
            method="draftexpert",
            platform=platform,
            engine=engine,
            expert_type="q4_0",
            max_new_tokens=tokens,
            device=device,
            **({"dtype": dtype} if platform == "cg" else {}),
        ),
        folder,
        [p for suite in suites for p in prompts.load(suite, limit=per_suite)]
        if suites
        else prompts.load(limit=per_suite),
        results_dir / "runs" / f"compare-{model}-{platform}{tag}",
        lambda qt: expert_file_for(model, folder, qt, log=log),
        collect(expert_storage(), keep_probe=True),
        log=log,
        method_set=method_set,
    )
    for row in res["methods"].values():
        row.pop("tokens")
    return res


def spec_compare(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    engine: str = "torch",
    models: tuple[str, ...] = TINY_MODELS,
    platform: str = "mn",
    device: str | None = None,
    folders: dict[str, Path] | None = None,
    dtype: str = "fp32",
) -> list[str]:
    """Table 2 / 3: AR vs top-1/2/3 vs DraftExpert for each tiny model (resumable). mn: Q4_0, on the
    torch engine or llama.cpp (the same prompts, expert file and method settings); cg: the checkpoint's
    experts in host memory, copied to `device` on demand (fp32 compute), beside every expert resident on
    the same device — `make reproduce` runs it on a GPU; `device` cpu (the CPU as the accelerator) is
    what the tests run."""
    written = []
    engine_tag = "_llama.cpp" if engine == "llama.cpp" else ""
    tag = engine_tag + ("_cpu" if platform == "cg" and device == "cpu" else "")
    for model in models:
        res = _compare_set(
            results_dir,
            log,
            model,
            per_suite,
            tokens,
            "table2",
            engine=engine,
            platform=platform,
            device=device,
            folders=folders,
            dtype=dtype,
        )
        name = f"spec_compare_{model}_{platform}{tag}"
        write_json_atomic(results_dir / f"{name}.json", res)
        (results_dir / f"{name}.md").write_text(
            captions.spec_compare_page(res, per_suite, tokens, FIG1B_THREADS, device)
        )
        written += [
            f"results/runs/compare-{model}-{platform}{engine_tag.replace('_', '-')}/*",
            f"results/{name}.md",
            f"results/{name}.json",
        ]
    return written


def _machine_id(results_dir: Path) -> str:
    """The machine the results were measured on (results/machine.json, written first by reproduce)."""
    path = results_dir / "machine.json"
    return json.loads(path.read_text()).get("machine_id", "?") if path.exists() else "?"


def fig2(results_dir: Path, log, models: tuple[str, ...] = TINY_MODELS, platform: str = "mn") -> list[str]:
    """Fig. 2 from the torch-engine comparisons `spec_compare` wrote (results/spec_compare_*_<platform>.json)."""
    per_model, runs = {}, []
    for model in models:
        path = results_dir / f"spec_compare_{model}_{platform}.json"
        if not path.exists():  # cg on the CPU as the accelerator
            path = results_dir / f"spec_compare_{model}_{platform}_cpu.json"
        res = json.loads(path.read_text())
        per_model[model] = paper_figs.fig2.points(res)
        runs.append(f"results/runs/compare-{model}-{platform}")
    machine = _machine_id(results_dir)
    (results_dir / "fig2_tradeoff.md").write_text(
        captions.fig2_page({m: paper_figs.fig2.table(p) for m, p in per_model.items()}, runs)
    )
    figs = paper_figs.fig2.figure(
        per_model, results_dir / "figures" / "fig2_tradeoff", f"{', '.join(runs)}; machine {machine}"
    )
    log("Fig. 2 written")
    return ["results/fig2_tradeoff.md", *[str(p.relative_to(results_dir.parent)) for p in figs]]


def table1(results_dir: Path, log) -> list[str]:
    """Table 1 from the machine records of every run under results/runs, the paper's two platforms beside."""
    manifests = [json.loads(p.read_text()) for p in sorted((results_dir / "runs").rglob("manifest.json"))]
    (results_dir / "table1_platforms.md").write_text(
        captions.table1_page(len(manifests), paper_figs.table1.table(paper_figs.table1.columns(manifests)))
    )
    log("Table 1 written")
    return ["results/table1_platforms.md"]


def crosscheck(
    results_dir: Path, log, per_suite: int | None = None, tokens: int = 32, models: tuple[str, ...] = TINY_MODELS
) -> list[str]:
    """llama.cpp (f32) vs the torch engine on every prompt of the suites: tokens and expert sets."""
    torch.set_num_threads(FIG1B_THREADS)
    written = []
    for model in models:
        folder = registry.resolve(model)
        head = llama_head_for(model, folder, "f32", expert_file_for(model, folder, "f32", log=log), log=log)
        res = crosscheck_engines(folder, prompts.load(limit=per_suite), head, tokens, FIG1B_THREADS, log=log)
        res.update(model=model, type="f32", max_new_tokens=tokens)
        write_json_atomic(results_dir / f"crosscheck_{model}.json", res)
        written.append(f"results/crosscheck_{model}.json")
    return written


def table4(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    engine: str = "torch",
    models: tuple[str, ...] = TINY_MODELS,
    folders: dict[str, Path] | None = None,
) -> list[str]:
    """Table 4 on mn: DraftExpert with fixed K, confidence–expansion truncation, and + prefetch."""
    written = []
    tag = "_llama.cpp" if engine == "llama.cpp" else ""
    for model in models:
        res = _compare_set(results_dir, log, model, per_suite, tokens, "table4", engine=engine, folders=folders)
        write_json_atomic(results_dir / f"table4_{model}_mn{tag}.json", res)
        (results_dir / f"table4_{model}_mn{tag}.md").write_text(
            captions.table4_page(res, per_suite, tokens, FIG1B_THREADS)
        )
        written += [f"results/table4_{model}_mn{tag}.md", f"results/table4_{model}_mn{tag}.json"]
    return written


TABLE3_SUITES = ("gsm8k", "chat")  # the paper's Table 3 reads math and chat prompts


def table3(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    models: tuple[str, ...] = TINY_MODELS,
    folders: dict[str, Path] | None = None,
) -> list[str]:
    """Table 3 on mn: every drafter at a fixed K = 4 (no truncation, no prefetch) on gsm8k + chat —
    acceptance and footprint beside the paper's, the stand-ins' drafting bar."""
    written = []
    for model in models:
        res = _compare_set(results_dir, log, model, per_suite, tokens, "table3", folders=folders, suites=TABLE3_SUITES)
        write_json_atomic(results_dir / f"table3_{model}_mn.json", res)
        (results_dir / f"table3_{model}_mn.md").write_text(
            captions.table3_page(res, per_suite, TABLE3_SUITES, tokens, FIG1B_THREADS)
        )
        written += [f"results/table3_{model}_mn.md", f"results/table3_{model}_mn.json"]
    return written


ENGINES_ROUNDS = 3


def engines(
    results_dir: Path,
    log,
    tokens: int = FIG1B_TOKENS,
    models: tuple[str, ...] = TINY_MODELS,
    rounds: int = ENGINES_ROUNDS,
) -> list[str]:
    """`bench speed engines`: both engines' AR beside their resident bounds, interleaved rounds (one
    prompt per suite). Kept when already measured on this machine for these weights."""
    torch.set_num_threads(FIG1B_THREADS)
    machine = results_dir / "machine.json"  # written first by reproduce: the storage's O_DIRECT bandwidth
    read_bw = measured_read_bw(json.loads(machine.read_text()) if machine.exists() else None)
    written = []
    for model in models:
        folder = registry.resolve(model)
        path = results_dir / f"engines_{model}_mn.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        if (old.get("machine_id"), old.get("weights"), old.get("max_new_tokens")) == (
            machine_id(),
            weights_fingerprint(folder),
            tokens,
        ):
            log(f"{path.name}: measured already on this machine, kept")
            res = old
        else:
            res = speed.engines(
                model,
                folder,
                prompts.load(limit=1),
                lambda qt: expert_file_for(model, folder, qt, log=log),
                tokens,
                rounds,
                read_bw=read_bw,
                log=log,
            )
            write_json_atomic(path, res)
        (results_dir / f"engines_{model}_mn.md").write_text(captions.engines_page(res, model, tokens, FIG1B_THREADS))
        written += [f"results/engines_{model}_mn.md", f"results/engines_{model}_mn.json"]
    return written


def fig3(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    models: tuple[str, ...] = TINY_MODELS,
    folders: dict[str, Path] | None = None,
) -> list[str]:
    """Fig. 3 on mn: each drafter's cumulative unique layer-experts vs draft length (K = 8, fixed)."""
    written = []
    for model in models:
        res = _compare_set(results_dir, log, model, per_suite, tokens, "fig3", folders=folders)  # K = 8
        curves = {
            label.removesuffix("-k8"): row["draft_unique_curve"]
            for label, row in res["methods"].items()
            if label != "ar"
        }
        (results_dir / f"fig3_{model}_mn.md").write_text(
            captions.fig3_page(model, curves, per_suite, tokens, all(res["tokens_equal_ar"].values()))
        )
        cfg = json.loads((_folder(model, folders) / "config.json").read_text())
        moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
        figs = paper_figs.fig3.figure(
            curves,
            results_dir / "figures" / f"fig3_{model}",
            f"{model}: draft-side unique experts vs length (measured)",
            paper_at_k4=paper_figs.fig3.paper_points(model, moe),
            source=f"results/runs/compare-{model}-mn, machine {_machine_id(results_dir)}",
        )
        written += [f"results/fig3_{model}_mn.md", *[str(p.relative_to(results_dir.parent)) for p in figs]]
    return written


SWEEP_LENGTHS = list(range(1, 9))
SWEEP_STARTS = [0, 8, 16]


def fig45(
    results_dir: Path,
    log,
    per_suite: int = FIG1B_PER_SUITE,
    quick: bool = False,
    models: tuple[str, ...] = TINY_MODELS,
    folders: dict[str, Path] | None = None,
) -> list[str]:
    """Figs. 4–5 on mn (Q4_0, cold, torch engine): verify cost and unique experts vs block length,
    and Fig. 4's dense half: each model's dense counterpart swept over the same blocks. `quick`
    (a reproduce run below the default prompt count): blocks at the first start only."""
    torch.set_num_threads(FIG1B_THREADS)
    machine = collect(expert_storage(), keep_probe=True)
    per_model = {}
    for model in models:
        folder = _folder(model, folders)
        tok = load_tokenizer(folder)
        ids = [render_prompt(tok, p["prompt"]) for p in prompts.load(limit=per_suite)]
        target = build_model(folder, "flash", gguf_path=expert_file_for(model, folder, "q4_0", log=log))
        starts = SWEEP_STARTS[:1] if quick else SWEEP_STARTS
        rows, continuations = verify_sweep(target, ids, SWEEP_LENGTHS, starts, log=log)
        target.experts.close()
        dense_folder = dense_counterpart_for(model, folder, log=log)
        dense = build_model(
            dense_folder, "flash", gguf_path=expert_file_for(f"{model}-dense", dense_folder, "q4_0", log=log)
        )
        log(f"{model}'s dense counterpart over the same blocks")
        dense_rows, _ = verify_sweep(dense, ids, SWEEP_LENGTHS, starts, log=log, continuations=continuations)
        dense.experts.close()
        c, d = metrics.verify_sweep_curves(rows), metrics.verify_sweep_curves(dense_rows)
        per_model[model] = c | {"dense_cost": d["cost"]}
        write_json_atomic(
            results_dir / f"fig45_{model}_mn.json",
            {
                "model": model,
                "machine": machine["machine_id"],
                "rows": rows,
                "curves": c,
                "dense": {"what": paper_figs.fig45.DENSE_LABEL, "rows": dense_rows, "curves": d},
            },
        )
        (results_dir / f"fig45_{model}_mn.md").write_text(
            captions.fig45_page(model, per_model[model], len(ids), starts, FIG1B_THREADS, machine["machine_id"])
        )
    figs = paper_figs.fig45.figure(
        per_model,
        results_dir / "figures" / "fig45_verify_block",
        f"results/fig45_{{{','.join(models)}}}_mn.json, machine {machine['machine_id']}",
    )
    return [
        *(f"results/fig45_{m}_mn.{ext}" for m in per_model for ext in ("md", "json")),
        *[str(p.relative_to(results_dir.parent)) for p in figs],
    ]


REGIME_MODEL, REGIME_PER_SUITE, REGIME_TOKENS = "ds-tiny", 1, 32  # 7 caps × 5 methods × 2 engines: kept small


def regime(
    results_dir: Path,
    log,
    per_suite: int = REGIME_PER_SUITE,
    tokens: int = REGIME_TOKENS,
    quick: bool = False,
    caps: list[int | None] | None = None,
) -> list[str]:
    """The paper's regime measured: Table 2's methods on ds-tiny under real storage read caps
    (the kernel's block-I/O throttle; root), on both engines, then the speed-up-vs-bandwidth
    figure. Skipped, with the reason, where the cap cannot be applied. `quick` (a reproduce run
    below the default prompt count) sweeps only the extremes, the lowest cap and uncapped, on the
    first prompt."""
    torch.set_num_threads(FIG1B_THREADS)
    folder = registry.resolve(REGIME_MODEL)
    experts = expert_file_for(REGIME_MODEL, folder, "q4_0", log=log)
    try:
        with ReadCap(10**9, experts):
            pass
    except ReadCapError as e:
        log(f"regime sweep skipped: {e}")
        return []
    machine = collect(expert_storage(), keep_probe=True)
    results, written = [], []
    for engine in ("torch", "llama.cpp"):
        tag = "-llama.cpp" if engine == "llama.cpp" else ""
        recs = prompts.load(limit=per_suite)
        res = compare(
            Cell(
                model=REGIME_MODEL,
                method="draftexpert",
                platform="mn",
                engine=engine,
                expert_type="q4_0",
                max_new_tokens=tokens,
            ),
            folder,
            recs[:1] if quick else recs,
            results_dir / "runs" / f"regime-{REGIME_MODEL}-mn{tag}",
            lambda qt: expert_file_for(REGIME_MODEL, folder, qt, log=log),
            machine,
            log=log,
            method_set="regime",
            caps=caps or ([REGIME_CAPS[0], None] if quick else REGIME_CAPS),
        )
        for cell in res["caps"]:
            for row in cell["methods"].values():
                row.pop("tokens")
        results.append(res)
        stem = f"regime_{REGIME_MODEL}_mn{tag.replace('-', '_')}"
        write_json_atomic(results_dir / f"{stem}.json", res)
        (results_dir / f"{stem}.md").write_text(
            captions.regime_page(res, per_suite, tokens, FIG1B_THREADS, machine["machine_id"])
        )
        written += [f"results/runs/regime-{REGIME_MODEL}-mn{tag}/*", f"results/{stem}.md", f"results/{stem}.json"]
    figs = paper_figs.regime.figure(
        results,
        results_dir / "figures" / f"regime_{REGIME_MODEL}",
        f"results/runs/regime-{REGIME_MODEL}-mn{{,-llama.cpp}}, machine {machine['machine_id']}",
    )
    return written + [str(p.relative_to(results_dir.parent)) for p in figs]


def speculation_plan(results_dir: Path, log, tokens: int = REGIME_TOKENS) -> list[str]:
    """`bench plan --speculation` on ds-tiny, both engines: the calibration (held-out prompts, this
    storage), each method's predicted speed-up at the regime's storage-bound caps, and — where the
    regime sweep was measured — the measured speed-up beside it."""
    torch.set_num_threads(FIG1B_THREADS)
    folder = registry.resolve(REGIME_MODEL)
    machine = collect(expert_storage(), keep_probe=True)
    try:
        require_llama_cpp()
        engines_here: tuple[str, ...] = ("torch", "llama.cpp")
    except LlamaCppError:
        engines_here = ("torch",)
    written = []
    for engine in engines_here:
        tag = "-llama.cpp" if engine == "llama.cpp" else ""
        stem = f"regime_{REGIME_MODEL}_mn{tag.replace('-', '_')}"
        base = Cell(model=REGIME_MODEL, method="draftexpert", platform="mn", engine=engine, max_new_tokens=tokens)
        out_dir = results_dir / "runs" / f"plan-{REGIME_MODEL}-mn{tag}"
        profile = sp.calibrate(
            base,
            folder,
            sp.held_out_prompts(None),
            out_dir,
            lambda qt: expert_file_for(REGIME_MODEL, folder, qt, log=log),
            machine,
            log,
        )
        pred = sp.predict(profile, [None, *sp.CHECK_CAPS])
        measured = results_dir / f"{stem}.json"
        rows = sp.against(profile, json.loads(measured.read_text())) if measured.exists() else None
        caps = " ".join(f"--cap {c // 10**6}MB/s" for c in sp.CHECK_CAPS)
        command = (
            f"bench plan --speculation --model {REGIME_MODEL} --platform mn --engine {engine} --threads "
            f"{FIG1B_THREADS} --max-new-tokens {tokens} {caps}" + (f" --measured results/{stem}.json" if rows else "")
        )
        plan_stem = f"plan_{REGIME_MODEL}_mn{tag.replace('-', '_')}"
        (results_dir / f"{plan_stem}.md").write_text(sp.page(profile, pred, rows, command, machine["machine_id"]))
        write_json_atomic(
            results_dir / f"{plan_stem}.json",
            {"profile": profile, "predicted": {str(c): p for c, p in pred.items()}, "against": rows},
        )
        written += [f"results/runs/plan-{REGIME_MODEL}-mn{tag}/*", f"results/{plan_stem}.md"]
        written.append(f"results/{plan_stem}.json")
    return written


def table5(
    results_dir: Path,
    log,
    per_suite: int,
    tokens: int,
    quick: bool = False,
    models: tuple[str, ...] = TINY_MODELS,
    folders: dict[str, Path] | None = None,
    held_out: int | None = None,
    seq_len: int = 256,
    **teacher,
) -> list[str]:
    """Table 5 from the committed draft-expert checkpoints of each tiny model (`bench distill-eval`);
    `bench distill --model <m> --preset <p>` retrains any of them."""
    torch.set_num_threads(FIG1B_THREADS)
    written = []
    recs = [p for s in ("chat", "gsm8k", "mbpp", "summarization", "ifeval") for p in prompts.load(s, per_suite)]
    for model in models:
        folder = _folder(model, folders)
        if bd.find_draft_experts(model, folder, "full") is None:
            log(f"Table 5 skipped for {model}: no distilled draft experts (bench distill --model {model})")
            continue
        try:
            res = bd.distill_eval(
                model,
                folder,
                bd.PRESET_ORDER,
                recs,
                tokens,
                seq_len,
                log,
                held_out=held_out or (4 if quick else bd.EVAL_WINDOWS),  # quick: a smoke run
                **teacher,
            )
        except FileNotFoundError as e:  # the held-out text is the corpus's validation split
            log(f"Table 5 skipped: {e}")
            return written
        write_json_atomic(results_dir / f"table5_{model}.json", res)
        (results_dir / f"table5_{model}.md").write_text(
            captions.table5_page(res, model, per_suite, tokens, bd.report(res))
        )
        written += [f"results/table5_{model}.md", f"results/table5_{model}.json"]
    return written


SPEC_BENCH_LIMIT, SPEC_BENCH_TOKENS = 2, 32  # questions per task, tokens per turn: all 480 take hours here


def spec_bench_tables(
    results_dir: Path,
    log,
    limit: int = SPEC_BENCH_LIMIT,
    tokens: int = SPEC_BENCH_TOKENS,
    engines: tuple[str, ...] = ("torch", "llama.cpp"),
    models: tuple[str, ...] = TINY_MODELS,
    quick: bool = False,
) -> list[str]:
    """The Spec-Bench table for each tiny model and engine on mn, uncapped and under the default
    load-bound read cap (`bench specbench`; resumable); `quick`: uncapped only. `bench specbench
    --limit 80` runs all 480."""
    written = []
    torch.set_num_threads(FIG1B_THREADS)
    machine = collect(expert_storage(), keep_probe=True)
    for engine in engines:
        for model in models:
            folder = registry.resolve(model)
            experts = expert_file_for(model, folder, "q4_0", log=log)
            caps = specbench.usable_caps([None] if quick else [None, specbench.DEFAULT_CAP], experts, log)
            base = Cell(model=model, method="draftexpert", platform="mn", engine=engine, max_new_tokens=tokens)
            command = (
                f"bench specbench --model {model} --platform mn --engine {engine} --limit {limit} "
                f"--max-new-tokens {tokens}{' --cap none' if quick else ''} --threads {FIG1B_THREADS}"
            )
            specbench.run_and_write(
                base,
                folder,
                limit,
                caps,
                results_dir,
                lambda qt: expert_file_for(model, folder, qt, log=log),
                machine,
                command,
                log=log,
            )
            stem = f"{model}_mn_{engine}"
            written += [
                f"results/spec_bench_{stem}.md",
                f"results/spec_bench_{stem}.json",
                f"results/spec_bench/{stem}/*",
                f"results/runs/spec_bench-{stem.replace('_', '-')}/*",
            ]
    return written


def reproduce(
    results_dir: Path,
    log=lambda m: print(m, file=sys.stderr),
    per_suite: int = FIG1B_PER_SUITE,
    tokens: int = FIG1B_TOKENS,
    models: tuple[str, ...] = TINY_MODELS,
) -> dict:
    """Every step; `per_suite` prompts per suite and `tokens` new tokens for the decoding runs;
    the per-model steps on `models` (the regime sweep and Fig. 1b always on ds-tiny)."""
    done = []
    results_dir.mkdir(parents=True, exist_ok=True)
    log("Table 1 (this machine): bench env")
    write_json_atomic(results_dir / "machine.json", collect(expert_storage(), keep_probe=True))
    done.append("results/machine.json")

    log("Fig. 1a: bench params for ds, ml, ds-tiny, ml-tiny")
    params_dir = results_dir / "params"
    params_dir.mkdir(exist_ok=True)
    for name in registry.MODELS:
        s = breakdown(registry.config_facts(name)).summary()
        s["model"] = name
        write_json_atomic(params_dir / f"{name}.json", s)
    df = fig1a.load(params_dir, order=list(registry.MODELS))
    figs_dir = results_dir / "figures"
    figs_dir.mkdir(exist_ok=True)
    (results_dir / "fig1a_params.md").write_text(fig1a.table(df))
    done += [
        "results/params/*.json",
        "results/fig1a_params.md",
        *[str(p.relative_to(results_dir.parent)) for p in fig1a.figure(df, figs_dir / "fig1a_params")],
    ]
    if registry.is_present(FIG1B_MODEL):
        log(f"Fig. 1b: AR offload of {FIG1B_MODEL} on mn (q4_0, bf16) and cg, {per_suite} prompts per suite")
        done += fig1b_runs(results_dir, log, per_suite, tokens)
        log("Tables 2/3 (mn rows): AR vs shared+top-r vs DraftExpert, " + ", ".join(models))
        done += spec_compare(results_dir, log, per_suite, tokens, models=models)
        done += fig2(results_dir, log, models=models)
        try:
            require_llama_cpp()
        except LlamaCppError as e:
            log(f"llama.cpp rows and cross-check skipped: {e}")
        else:
            log("Tables 2/3 (mn rows) on llama.cpp, " + ", ".join(models))
            done += spec_compare(results_dir, log, per_suite, tokens, engine="llama.cpp", models=models)
            log("Both engines' AR beside their resident bounds (bench speed engines), " + ", ".join(models))
            done += engines(
                results_dir, log, tokens, models=models, rounds=1 if per_suite < FIG1B_PER_SUITE else ENGINES_ROUNDS
            )
            log("Table 4 on llama.cpp: fixed K vs truncation vs + prefetch (DraftExpert), " + ", ".join(models))
            done += table4(results_dir, log, per_suite, tokens, engine="llama.cpp", models=models)
            log("Cross-check llama.cpp f32 vs the torch engine on every prompt, " + ", ".join(models))
            done += crosscheck(
                results_dir, log, None if per_suite >= FIG1B_PER_SUITE else per_suite, min(tokens, 32), models=models
            )
        log("Table 3: every drafter at a fixed K = 4 on gsm8k + chat, " + ", ".join(models) + " on mn")
        done += table3(results_dir, log, per_suite, tokens, models=models)
        log("Fig. 3: draft-side unique experts vs draft length, " + ", ".join(models) + " on mn")
        done += fig3(results_dir, log, per_suite, tokens, models=models)
        log("Figs. 4-5: verify cost and unique experts vs block length, " + ", ".join(models) + " on mn")
        done += fig45(results_dir, log, per_suite, quick=per_suite < FIG1B_PER_SUITE, models=models)
        log("Table 4: fixed K vs truncation vs + prefetch (DraftExpert), " + ", ".join(models) + " on mn")
        done += table4(results_dir, log, per_suite, tokens, models=models)
        log("The regime: Table 2's methods under real storage read caps, ds-tiny, both engines")
        done += regime(
            results_dir,
            log,
            min(per_suite, REGIME_PER_SUITE),
            min(tokens, REGIME_TOKENS),
            quick=per_suite < FIG1B_PER_SUITE,
        )
        log("Will speculation pay? bench plan --speculation on ds-tiny, predicted beside the regime's measurement")
        done += speculation_plan(results_dir, log, min(tokens, REGIME_TOKENS))
        log("Spec-Bench: its questions through AR, AR + cache, top-3, pld and DraftExpert, per task")
        try:
            require_llama_cpp()
            engines_here: tuple[str, ...] = ("torch", "llama.cpp")
        except LlamaCppError:
            engines_here = ("torch",)
        done += spec_bench_tables(
            results_dir,
            log,
            1 if per_suite < FIG1B_PER_SUITE else SPEC_BENCH_LIMIT,
            min(tokens, SPEC_BENCH_TOKENS),
            engines_here[:1] if per_suite < FIG1B_PER_SUITE else engines_here,  # quick: the torch engine
            models,
            quick=per_suite < FIG1B_PER_SUITE,
        )
        log("Table 5: draft-expert ablation (bench distill-eval) for the tiny models")
        done += table5(results_dir, log, per_suite, tokens, quick=per_suite < FIG1B_PER_SUITE, models=models)
        done += table1(results_dir, log)
    else:
        log(f"Fig. 1b skipped: {FIG1B_MODEL} is not present")
    pending = PENDING_WITHOUT_GPU
    if torch.cuda.is_available() and registry.is_present(FIG1B_MODEL):
        log("Table 2 (cg rows) on the GPU: AR vs shared+top-r vs DraftExpert, " + ", ".join(models))
        done += spec_compare(results_dir, log, per_suite, tokens, models=models, platform="cg", device="cuda")
        pending = []
    for item, needs in pending:
        log(f"pending: {item} (needs: {needs})")
    summary = {"written": done, "pending": [{"result": i, "needs": n} for i, n in pending]}
    (results_dir / "REPRODUCE.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
