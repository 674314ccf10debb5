"""`bench compare`: AR offload vs shared+top-r (r = 1, 2, 3) vs DraftExpert on one model and
platform — every method through the same runner into its own resumable run folder, then one
table computed from the records (Spec-Bench style: metrics afterwards, never inside the loop).

Metrics: `draftexpert.metrics`; the table: `paper_figs.spec_table`.
"""
from __future__ import annotations

from pathlib import Path

from bench.decoders import SpecOptions

# (label, method, spec overrides): the paper's top-r baseline is plain self-speculation (fixed K,
# no prefetch); DraftExpert runs with truncation and prefetch (Table 2's "DE").
METHODS = [
    ("ar", "ar", {}),
    ("top-1", "top-r", {"r": 1, "truncate": False, "prefetch": False}),
    ("top-2", "top-r", {"r": 2, "truncate": False, "prefetch": False}),
    ("top-3", "top-r", {"r": 3, "truncate": False, "prefetch": False}),
    ("draftexpert", "draftexpert", {}),
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
SETS = {"table2": METHODS, "table4": POLICIES, "fig3": FOOTPRINT}


def compare(model: str, folder: Path, platform: str, prompts: list[dict], out_dir: Path, max_new_tokens: int,
            spec: SpecOptions, expert_type: str, expert_file, machine: dict | None, labels: list[str] | None = None,
            log=print, compile: bool = False, method_set: str = "table2", engine: str = "torch") -> dict:
    from bench.decoders import make_decoder
    from bench.results import read_records
    from bench.runner import run_cells
    from draftexpert import metrics

    rows = {}
    for label, method, over in SETS[method_set]:
        if labels and label not in labels:
            continue
        decoder, tokenizer, cfg = make_decoder(model, folder, method, platform, expert_type=expert_type,
                                               max_new_tokens=max_new_tokens, expert_file=expert_file,
                                               spec=spec.with_(**over), compile=compile, engine=engine)
        run_dir = out_dir / label
        log(f"== {label} → {run_dir}")
        summary = run_cells(cfg, prompts, decoder, tokenizer, run_dir, machine=machine, log=log)
        decoder.close()
        recs = [r for r in read_records(run_dir / "records.jsonl") if r["config_hash"] == summary["config_hash"]]
        rows[label] = metrics.aggregate(recs)
        rows[label]["tokens"] = {r["prompt_id"]: r["tokens"] for r in recs}
        rows[label]["method_args"] = cfg.method_args
    for row in rows.values():
        row.update(metrics.relative(row, rows.get("ar")))
    same = {label: all(row["tokens"][p] == rows["ar"]["tokens"][p] for p in row["tokens"])
            for label, row in rows.items() if "ar" in rows and label != "ar"}
    return {"model": model, "platform": platform, "engine": engine, "set": method_set, "expert_type": expert_type if platform == "mn" else None,
            "max_new_tokens": max_new_tokens, "spec": spec.as_dict(), "methods": rows, "tokens_equal_ar": same}
