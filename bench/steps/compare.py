"""`bench compare`: AR offload vs shared+top-r (r = 1, 2, 3) vs DraftExpert on one model and
platform — every method through the same runner into its own resumable run folder, then one
table computed from the records (Spec-Bench style: metrics afterwards, never inside the loop).
Beside them: prompt lookup (the training-free drafter a llama.cpp or transformers user turns on
first) and AR with an LRU expert cache holding the memory DraftExpert uses beyond AR (its draft
experts and its prefetch buffer, measured from its run: `extra_memory`), so that AR and
DraftExpert compare at the same total memory.

Metrics: `draftexpert.metrics`; the table: `paper_figs.spec_table`.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from bench.cells.artifacts import experts_dir
from bench.cells.cell import Cell
from bench.cells.decoders import make_decoder
from bench.runs.readcap import ReadCap
from bench.runs.results import read_records
from bench.runs.runner import run_cells
from draftexpert import metrics
from draftexpert.runtime.loader import load_config
from draftexpert.runtime.params import EXPERT_FILE_BYTES, WontFit

DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # bench.cells.cell.DTYPES

EQUAL_MEMORY = "equal_memory"  # an AR row whose cache is sized by the set's DraftExpert row (`extra_memory`)
# (label, method, spec overrides; "platform" overrides the set's): the paper's top-r baseline is
# plain self-speculation (fixed K, no prefetch); DraftExpert runs with truncation and prefetch
# (Table 2's "DE"); AR with every expert resident is the upper bound beside them.
METHODS = [
    ("ar", "ar", {}),
    ("ar-resident", "ar", {"platform": "resident"}),
    ("top-1", "top-r", {"r": 1, "truncate": False, "prefetch": False}),
    ("top-2", "top-r", {"r": 2, "truncate": False, "prefetch": False}),
    ("top-3", "top-r", {"r": 3, "truncate": False, "prefetch": False}),
    ("draftexpert", "draftexpert", {}),
    ("draftexpert-cost", "draftexpert", {"controller": "cost"}),  # the same drafter, rounds priced (not the paper's)
    ("auto", "auto", {}),  # each round's drafter (or AR) chosen by price (not the paper's)
    ("pld", "pld", {}),  # prompt lookup: the training-free drafter (not the paper's)
    ("ar-cache", "ar", {EQUAL_MEMORY: True}),  # AR with an LRU expert cache of DraftExpert's extra memory
]
# Table 4: DraftExpert's verify-side policies against AR.
POLICIES = [
    ("ar", "ar", {}),
    ("fixed-k", "draftexpert", {"truncate": False, "prefetch": False}),
    ("conf-exp", "draftexpert", {"truncate": True, "prefetch": False}),
    ("conf-exp-prefetch", "draftexpert", {"truncate": True, "prefetch": True}),
]
# Fig. 3: the drafters at a fixed K = 8 (no truncation, no prefetch), for the footprint-vs-length curves.
FOOTPRINT = [
    ("ar", "ar", {}),
    ("top-1-k8", "top-r", {"r": 1, "k_max": 8, "truncate": False, "prefetch": False}),
    ("top-2-k8", "top-r", {"r": 2, "k_max": 8, "truncate": False, "prefetch": False}),
    ("top-3-k8", "top-r", {"r": 3, "k_max": 8, "truncate": False, "prefetch": False}),
    ("draftexpert-k8", "draftexpert", {"k_max": 8, "truncate": False, "prefetch": False}),
]
# The paper's regime, measured: Table 2's methods under storage read caps (bytes/s; None = uncapped),
# and beside them the best drafter and DraftExpert with long blocks (K = 8, no truncation): where bytes
# moved decide, a longer verified block spreads x_0's experts and each position's over more tokens.
REGIME_CAPS = [16 * 10**6, 32 * 10**6, 64 * 10**6, 128 * 10**6, 256 * 10**6, 512 * 10**6, None]
LONG_BLOCKS = [
    ("top-3-k8", "top-r", {"r": 3, "k_max": 8, "truncate": False, "prefetch": False}),
    ("draftexpert-k8", "draftexpert", {"k_max": 8, "truncate": False}),
    ("auto-k8", "auto", {"k_max": 8}),  # priced per round over DraftExpert, top-1, top-3 and AR (not the paper's)
]
# Table 3: the drafters' acceptance and footprint as the paper reads them — every drafter at a fixed
# K = 4, no truncation, no prefetch (the setting of the stand-ins' drafting bar).
ACCEPTANCE = [
    ("ar", "ar", {}),
    *((f"top-{r}", "top-r", {"r": r, "k_max": 4, "truncate": False, "prefetch": False}) for r in (1, 2, 3)),
    ("draftexpert", "draftexpert", {"k_max": 4, "truncate": False, "prefetch": False}),
]
# The Spec-Bench table's methods: both ARs, the best top-r at K = 4, prompt lookup, DraftExpert.
SPEC_BENCH = [m for m in METHODS if m[0] in ("ar", "top-3", "draftexpert", "pld", "ar-cache")]
SETS = {
    "table2": METHODS,
    "table3": ACCEPTANCE,
    "table4": POLICIES,
    "fig3": FOOTPRINT,
    "regime": METHODS + LONG_BLOCKS,
    "spec_bench": SPEC_BENCH,
}
REGIME_CELL = "regime-cell"  # one cap of the regime set (its methods; `compare` recurses with it)


def compare(
    base: Cell,
    folder: Path,
    prompts: list[dict],
    out_dir: Path,
    expert_file,
    machine: dict | None,
    labels: list[str] | None = None,
    log=print,
    method_set: str = "table2",
    caps: list[int | None] | None = None,
    calibration: Path | None = None,
) -> dict:
    """One set's methods through the runner, then one row per method from the records. Each method's
    cell is `base` with the set's overrides; `base.read_bw` caps the storage reads of every cell
    (`bench.runs.readcap`); the `regime` set repeats Table 2's methods under each of `caps` (default
    REGIME_CAPS), each cap in its own sub-folder. `calibration`: a profile the cells whose rounds are
    priced (auto, the cost controller) start their acceptance from."""
    platform, read_bw = base.platform, base.read_bw
    if method_set == "regime":
        per_cap = []
        for cap in caps or REGIME_CAPS:
            log(f"=== read cap {cap / 1e6:.0f} MB/s" if cap else "=== uncapped")
            sub = out_dir / (f"cap-{cap // 10**6}MBps" if cap else "uncapped")
            per_cap.append(
                compare(
                    base.with_(read_bw=cap),
                    folder,
                    prompts,
                    sub,
                    expert_file,
                    machine,
                    labels,
                    log,
                    REGIME_CELL,
                    calibration=calibration,
                )  # fmt: skip
            )
        return {"model": base.model, "platform": platform, "engine": base.engine, "set": "regime", "caps": per_cap}
    rows = {}
    for label, method, over in SETS["regime" if method_set == REGIME_CELL else method_set]:
        if labels and label not in labels:
            continue
        over, extra = dict(over), None
        if over.pop(EQUAL_MEMORY, False):
            if "draftexpert" not in rows:
                log(f"== {label}: not measured — it is sized by the draftexpert row, which this set did not run")
                continue
            extra = extra_memory(base, folder, rows["draftexpert"])
            over.update(cache_for(base, folder, extra["bytes"]))
        cell_platform = over.pop("platform", platform)
        if method == "top-r" and over.get("r", 1) >= load_config(folder).num_experts_per_tok:
            log(
                f"== {label}: not measured — r must be below the target's top-k "
                f"({load_config(folder).num_experts_per_tok})"
            )
            continue
        if cell_platform != platform and (read_bw or platform not in ("mn", "cg")):
            continue  # the resident bound is measured once, beside the uncapped offload rows
        if cell_platform == platform:
            cell = base.with_(method=method, **over)
        else:  # mn's bound holds the expert file's experts on the CPU; cg's the checkpoint's, on cg's accelerator
            cell = base.with_(
                method=method,
                platform=cell_platform,
                resident_from_file=platform == "mn",
                device=(base.device or "cuda") if platform == "cg" else None,
                working_set=0,
                cache_experts=0,
                staging_budget=0,
                **over,
            )
        if calibration is not None and cell.priced:
            cell = cell.with_(calibration=calibration)
        try:
            decoder, tokenizer, cfg = make_decoder(cell, folder, expert_file)
        except WontFit as e:
            if cell_platform == platform:
                raise
            log(f"== {label}: not measured — {e}")  # e.g. DS-V2-Lite's 31 GB resident on a 24 GB card
            continue
        run_dir = out_dir / label
        log(f"== {label} → {run_dir}")
        if read_bw:
            with ReadCap(read_bw, expert_file(base.expert_type)):
                summary = run_cells(cfg, prompts, decoder, tokenizer, run_dir, machine=machine, log=log)
        else:
            summary = run_cells(cfg, prompts, decoder, tokenizer, run_dir, machine=machine, log=log)
        decoder.close()
        recs = [r for r in read_records(run_dir / "records.jsonl") if r["config_hash"] == summary["config_hash"]]
        rows[label] = metrics.aggregate(recs)
        rows[label]["tokens"] = {r["prompt_id"]: r["tokens"] for r in recs}
        rows[label]["method_args"] = cfg.method_args
        rows[label]["platform"] = cfg.platform
        rows[label]["config_hash"] = summary["config_hash"]
        if label == "draftexpert":
            rows[label]["prefetch_peak_bytes"] = max((r.get("prefetch_peak_bytes") or 0 for r in recs), default=0)
        if extra is not None:
            rows[label]["extra_memory"] = extra
            cold = rows.get("ar")
            # the cache's hit rate in bytes: what it saved of cold AR's reads over the same tokens
            rows[label]["cache_hit_bytes"] = (
                1 - rows[label]["moved_bytes"] / cold["moved_bytes"] if cold and cold.get("moved_bytes") else None
            )
    cg_device = next((r["method_args"].get("device") for r in rows.values() if r["platform"] == "cg"), None)
    bw = read_bw or (_measured_copy_in(machine, cg_device) if platform == "cg" else measured_read_bw(machine))
    cached = rows.get("ar-cache")
    if cached and "draftexpert" in rows:
        rows["draftexpert"]["extra_memory"] = cached["extra_memory"]
    for row in rows.values():
        row.update(metrics.relative(row, rows.get("ar")))
        # against the stronger AR too: the one holding DraftExpert's extra memory as an expert cache
        row["speedup_vs_cache"] = metrics.relative(row, cached)["speedup"] if cached else None
        row["physical_limit_tps"] = metrics.physical_limit_tps(row, bw) if row["platform"] != "resident" else None
    same = {
        label: all(row["tokens"][p] == rows["ar"]["tokens"][p] for p in row["tokens"])
        for label, row in rows.items()
        if "ar" in rows and label != "ar"
    }
    return {
        "model": base.model,
        "platform": platform,
        "engine": base.engine,
        "set": method_set,
        "expert_type": base.expert_type if platform == "mn" else None,
        "max_new_tokens": base.max_new_tokens,
        "read_bw": read_bw,
        "limit_read_bw": bw,
        "spec": base.spec.as_dict(),
        "methods": rows,
        "tokens_equal_ar": same,
    }


def extra_memory(base: Cell, folder: Path, de_row: dict) -> dict:
    """DraftExpert's memory beyond AR's, from its run: the draft experts as its drafter holds them
    (their weights × the bytes a weight takes there: the compute dtype on torch, the expert file's
    type on llama.cpp; the zero draft expert has the routed experts' shape) and its prefetch buffer
    (the most bytes one round prefetched, measured)."""
    cfg = load_config(folder)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    file = (de_row.get("method_args") or {}).get("draft_experts") or {}
    path = experts_dir(base.model, folder) / file["file"] if file.get("file") else None
    if path is not None and path.exists():
        with safe_open(path, "pt") as f:
            weights = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("gamma"))
    else:
        weights = moe_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    per_weight = EXPERT_FILE_BYTES[base.expert_type] if base.engine == "llama.cpp" else DTYPE_BYTES[base.dtype]
    draft = int(weights * per_weight)
    prefetch = int(de_row.get("prefetch_peak_bytes") or 0)
    return {"draft_expert_bytes": draft, "prefetch_buffer_bytes": prefetch, "bytes": draft + prefetch}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def cache_for(base: Cell, folder: Path, nbytes: int) -> dict:
    """The cell options that give AR an LRU expert cache of `nbytes`: on cg, accelerator slots of
    whole experts in the compute dtype (`cache_experts`); on mn, raw expert bytes kept staged
    between steps (`staging_budget`, either engine)."""
    if base.platform == "cg":
        cfg = load_config(folder)
        one = 3 * cfg.hidden_size * cfg.moe_intermediate_size * DTYPE_BYTES[base.dtype]
        return {"cache_experts": max(1, nbytes // one)}
    return {"staging_budget": max(1, nbytes)}


def _measured_copy_in(machine: dict | None, device: str | None) -> float | None:
    """Bytes/s of one copy into cg's accelerator (`telemetry.copy_in_bandwidth`) when it was measured:
    cg's experts cross that link, not the disk."""
    copy_in = (machine or {}).get("copy_in") or {}
    key = "cuda_pinned_gb_per_s" if device == "cuda" else "cpu_gb_per_s"
    return copy_in[key] * 1e9 if key in copy_in else None


def measured_read_bw(machine: dict | None) -> float | None:
    """Bytes/s the machine's storage read (O_DIRECT, median) when `bench env` measured it."""
    io = ((machine or {}).get("storage") or {}).get("odirect_read") or {}
    return io["gb_per_s_median"] * 1e9 if "gb_per_s_median" in io else None
