"""`bench sweep GRID.toml`: a grid of cells through the results store, in-process or as Ray tasks.

A grid file (TOML; `bench/data/grids/example.toml` is a commented one):

    out = "runs/sweep-example"          # optional; --out wins
    [prompts]                           # the suites (or `file = "mine.jsonl"`), limit, shards
    suite = ["gsm8k", "mbpp"]
    limit = 4
    shards = 2
    [decode]
    max_new_tokens = 64
    [grid]                              # every combination is a cell
    model = ["ds-tiny"]                 # model_path = "DIR" (one model) is allowed too
    platform = ["mn", "resident"]
    engine = ["torch", "llama.cpp"]
    method = ["ar", "top-r", "draftexpert"]
    expert_type = ["q4_0"]
    device = "cuda"                     # cg cells (cpu: the CPU as the accelerator); dtype = "bf16" likewise
    head_type = "q4_0"                  # the torch engine's cells on a CPU (`--head-type`; default checkpoint)
    [settings]                          # swept where they apply: r for top-r; the rest for top-r and draftexpert
    r = [1, 2]
    k_max = [4]
    [ray]                               # --ray only: what a cell asks of the cluster
    gpus_per_cg_cell = 1
    resources = { mn = { phone = 1 } }  # custom resources pinning a platform's cells to its nodes

A task is one cell (configuration) on one prompt shard (prompts i, i + shards, …), written to its
own run folder `<out>/<model>/<platform>-<engine>/<method label>/shard-<i>of<n>`. A task that
dies (a killed worker, a lost node) is retried by Ray and resumes in that folder: records
already written are skipped, a torn last line is repaired, and the folder's writer lock keeps
an attempt that is still alive from writing beside its retry — every cell key lands exactly once.
Without `--ray` the same tasks run one after another in this process, with the same records.
"""

from __future__ import annotations

import itertools
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.cells import registry
from bench.cells.artifacts import expert_file_for
from bench.cells.cell import ENGINES, METHODS, PLATFORMS, SPEC_METHODS, Cell, CellError, SpecOptions
from bench.cells.decoders import make_decoder
from bench.runs.progress import Progress
from bench.runs.results import read_records
from bench.runs.runner import run_cells
from bench.suites import prompts
from draftexpert import metrics
from draftexpert.runtime.gguf_layout import TYPES
from draftexpert.runtime.loader import HEAD_TYPES

GRID_KEYS = {"model", "model_path", "platform", "engine", "method", "expert_type", "device", "dtype", "head_type"}
SETTINGS = {"r": int, "k_max": int, "tau": float, "budget": int, "truncate": bool, "prefetch": bool}
SECTIONS = {"out", "prompts", "decode", "grid", "settings", "ray"}


class GridError(ValueError):
    """A grid file that cannot be run; the message names the file and the key."""


@dataclass(frozen=True)
class Task:
    """One cell on one prompt shard."""

    model: str
    platform: str
    engine: str
    method: str
    expert_type: str
    settings: dict
    shard: int
    shards: int
    suites: tuple[str, ...] = ()
    prompts_file: str | None = None
    limit: int | None = None
    max_new_tokens: int = 64
    model_path: str | None = None
    device: str | None = None  # cg: cuda (default) | cpu
    dtype: str = "fp32"
    head_type: str = "checkpoint"
    resources: dict = field(default_factory=dict)
    gpus: float = 0

    def cell(self) -> Cell:
        """The task's cell (checked: a grid that names a bad combination fails before any task runs)."""
        return Cell(
            model=self.model,
            method=self.method,
            platform=self.platform,
            engine=self.engine,
            expert_type=self.expert_type,
            max_new_tokens=self.max_new_tokens,
            device=self.device,
            dtype=self.dtype,
            head_type=self.head_type,
            spec=SpecOptions().with_(**self.settings),
        )

    @property
    def label(self) -> str:
        s = self.settings
        base = f"top-{s['r']}" if self.method == "top-r" else self.method
        rest = "-".join(f"{k}{v}" for k, v in sorted(s.items()) if k != "r")
        return f"{base}-{rest}" if rest else base

    @property
    def folder(self) -> Path:
        typed = self.platform == "mn" or self.engine == "llama.cpp"  # where the expert file's type is the model
        return (
            Path(self.model)
            / (f"{self.platform}-{self.engine}" + (f"-{self.expert_type}" if typed else ""))
            / self.label
            / f"shard-{self.shard}of{self.shards}"
        )


def _list(v) -> list:
    return v if isinstance(v, list) else [v]


def read_grid(path: Path) -> tuple[list[Task], dict]:
    """(tasks, the file's other options) from a grid file; GridError names what is wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GridError(f"{path}: no such grid file") from None
    except tomllib.TOMLDecodeError as e:
        raise GridError(f"{path}: not TOML ({e})") from None
    for key in set(doc) - SECTIONS:
        raise GridError(f"{path}: unknown section or key {key!r} (known: {', '.join(sorted(SECTIONS))})")
    grid, settings = doc.get("grid", {}), doc.get("settings", {})
    pr, dec, ray = doc.get("prompts", {}), doc.get("decode", {}), doc.get("ray", {})
    for name, section, known in (
        ("grid", grid, GRID_KEYS),
        ("settings", settings, set(SETTINGS)),
        ("prompts", pr, {"suite", "file", "limit", "shards"}),
        ("decode", dec, {"max_new_tokens"}),
        ("ray", ray, {"gpus_per_cg_cell", "resources"}),
    ):
        for key in set(section) - known:
            raise GridError(f"{path}: [{name}] {key}: unknown key (known: {', '.join(sorted(known))})")
    axes = {
        k: _list(grid.get(k, d))
        for k, d in (
            ("model", "ds-tiny"),
            ("platform", "mn"),
            ("engine", "torch"),
            ("method", "ar"),
            ("expert_type", "q4_0"),
        )
    }
    for key, allowed in (("platform", PLATFORMS), ("engine", ENGINES), ("method", METHODS), ("expert_type", TYPES)):
        bad = [v for v in axes[key] if v not in allowed]
        if bad:
            raise GridError(f"{path}: [grid] {key}: {', '.join(map(str, bad))} not one of {', '.join(allowed)}")
    if grid.get("head_type", "checkpoint") not in HEAD_TYPES:
        raise GridError(f"{path}: [grid] head_type: {grid['head_type']!r} not one of {', '.join(HEAD_TYPES)}")
    if "model_path" in grid and len(axes["model"]) != 1:
        raise GridError(f"{path}: [grid] model_path names one model's folder; the grid lists {len(axes['model'])}")
    for key, kind in SETTINGS.items():
        for v in _list(settings.get(key, [])):
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise GridError(f"{path}: [settings] {key}: {v!r} is not {kind.__name__}")
    suites = tuple(_list(pr.get("suite", list(prompts.SUITES)))) if "file" not in pr else ()
    bad = [s for s in suites if s not in prompts.SUITE_NAMES]
    if bad:
        raise GridError(f"{path}: [prompts] suite: unknown {', '.join(bad)}; known: {', '.join(prompts.SUITE_NAMES)}")
    if "file" in pr and "suite" in pr:
        raise GridError(f"{path}: [prompts] file and suite: give one")
    shards = int(pr.get("shards", 1))
    if shards < 1:
        raise GridError(f"{path}: [prompts] shards: {shards} (at least 1)")
    file = str((path.parent / pr["file"]).resolve()) if "file" in pr else None
    tasks = []
    for model, platform, engine, method, qtype in itertools.product(*axes.values()):
        if engine == "llama.cpp" and (platform == "cg" or method == "reference"):
            raise GridError(
                f"{path}: [grid] engine llama.cpp runs platforms mn and resident and methods ar, top-r, "
                f"draftexpert: remove {platform if platform == 'cg' else method} or the engine"
            )
        keys = [k for k in SETTINGS if k in settings and method in SPEC_METHODS and (k != "r" or method == "top-r")]
        if method == "top-r" and "r" not in keys:
            keys.append("r")
        values = [_list(settings.get(k, 1)) for k in keys]  # r defaults to 1; others are always given here
        for combo in itertools.product(*values):
            for shard in range(shards):
                tasks.append(
                    Task(
                        model=model,
                        platform=platform,
                        engine=engine,
                        method=method,
                        expert_type=qtype,
                        settings=dict(zip(keys, combo)),
                        shard=shard,
                        shards=shards,
                        suites=suites,
                        prompts_file=file,
                        limit=pr.get("limit"),
                        max_new_tokens=int(dec.get("max_new_tokens", 64)),
                        model_path=grid.get("model_path"),
                        device=grid.get("device") if platform == "cg" else None,
                        dtype=grid.get("dtype", "fp32") if engine == "torch" else "fp32",
                        head_type=grid.get("head_type", "checkpoint") if engine == "torch" else "checkpoint",
                        resources=ray.get("resources", {}).get(platform, {}),
                        gpus=float(ray.get("gpus_per_cg_cell", 1)) if platform == "cg" else 0,
                    )
                )
    for task in tasks:
        try:
            task.cell()
        except CellError as e:
            raise GridError(f"{path}: [grid] {task.model} {task.platform} {task.engine} {task.method}: {e}") from None
    return tasks, {"out": doc.get("out")}


def task_prompts(task: Task) -> list[dict]:
    """The task's shard of the grid's prompts (every shards-th, from its index)."""
    recs = (
        prompts.read_prompt_file(Path(task.prompts_file), task.limit)
        if task.prompts_file
        else [p for s in task.suites for p in prompts.load(s, task.limit)]
    )
    return recs[task.shard :: task.shards]


def run_task(task: Task, out_dir: Path, log: Callable[[str], None] | None = None) -> dict:
    """One task, here: decoder built, its shard decoded into its folder (resuming), decoder closed."""
    log = log or (lambda m: print(f"[{task.folder}] {m}", file=sys.stderr, flush=True))
    folder = registry.resolve(task.model, task.model_path)
    decoder, tokenizer, cfg = make_decoder(
        task.cell(), folder, lambda qt: expert_file_for(task.model, folder, qt, log=log)
    )
    try:
        summary = run_cells(
            cfg, task_prompts(task), decoder, tokenizer, out_dir / task.folder, log=log, run_name=str(task.folder)
        )
    finally:
        decoder.close()
    return {"task": str(task.folder), **{k: summary[k] for k in ("config_hash", "written", "skipped")}}


def run_sweep(
    tasks: list[Task],
    out_dir: Path,
    ray_address: str | None = None,
    use_ray: bool = False,
    max_retries: int = 3,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> list[dict]:
    """Every task, in-process (in order) or as Ray tasks (`ray_address`: None starts or joins a local
    runtime as `ray.init` does); returns one summary per task, in the tasks' order."""
    out_dir = Path(out_dir)
    if not use_ray:
        progress = Progress(len(tasks), "sweep", log)
        done = []
        try:
            for t in tasks:
                done.append(run_task(t, out_dir))
                progress.done(f"{t.folder}: {done[-1]['written']} written, {done[-1]['skipped']} already done", 0, 0.0)
        finally:
            progress.close()
        return done
    import ray  # noqa: PLC0415  (the optional extra `ray`: only --ray needs it)

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=True)
    remote = ray.remote(run_task)  # a worker death is retried (max_retries); an exception in the task is not
    refs = [
        remote.options(
            num_cpus=1, num_gpus=t.gpus, resources=t.resources or None, max_retries=max_retries, name=str(t.folder)
        ).remote(t, out_dir)
        for t in tasks
    ]
    progress = Progress(len(refs), "sweep (ray)", log)
    by_ref, results = {r: i for i, r in enumerate(refs)}, [None] * len(refs)
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = by_ref[ready[0]]
            results[i] = ray.get(ready[0])
            progress.done(
                f"{tasks[i].folder}: {results[i]['written']} written, {results[i]['skipped']} already done", 0, 0.0
            )
    finally:
        progress.close()
    return results


def collect(out_dir: Path) -> list[dict]:
    """Every record under a sweep's folder (all tasks)."""
    return [r for f in sorted(Path(out_dir).rglob("records.jsonl")) for r in read_records(f)]


def cells_table(records: list[dict]) -> list[dict]:
    """One row per cell (configuration), its shards' records summed: prompts, decode TPS, α."""
    by_cell: dict[str, list[dict]] = {}
    for r in records:
        by_cell.setdefault(r["config_hash"], []).append(r)
    rows = []
    for h, recs in by_cell.items():
        agg, first = metrics.aggregate(recs), recs[0]
        rows.append(
            {
                "cell": first["run"].rsplit("/shard-", 1)[0],
                "config_hash": h,
                "prompts": len(recs),
                "decode_tps": agg.get("decode_tps"),
                "acceptance": agg.get("acceptance"),
            }
        )
    return sorted(rows, key=lambda r: r["cell"])
