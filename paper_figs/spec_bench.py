"""The Spec-Bench table (`bench specbench`): per Spec-Bench task and method, from the rows
`bench.steps.specbench` derived (`draftexpert.metrics`; Spec-Bench's speed-up by its own formula
from the exported answer files). Pure formatting: nothing here runs a model.
"""

from __future__ import annotations

NAMES = {
    "ar": "AR (cold)",
    "ar-cache": "AR + expert cache",
    "top-3": "top-3",
    "pld": "pld (training-free)",
    "draftexpert": "DraftExpert",
}


def _f(v, fmt: str) -> str:
    return fmt.format(v) if v is not None and v == v else "–"


def full_set_estimate_s(cell: dict, tasks: list[str]) -> float:
    """Seconds all 480 questions would take with every method of the cell: each task's measured
    seconds per question (all methods) × 80 (Spec-Bench has 80 a task). An estimate, labelled so."""
    total = 0.0
    for task in tasks:
        if task == "overall":
            continue
        rows = [t[task] for t in cell["per_task"].values() if task in t]
        if rows:
            total += sum(r["seconds"] for r in rows) / rows[0]["questions"] * 80
    return total


def cap_section(cell: dict, tasks: list[str]) -> str:
    bw = cell["read_bw"]
    ar = cell["per_task"]["ar"]["overall"]
    head = (
        f"### storage reads capped at {bw / 1e6:.0f} MB/s (cgroup blkio throttle): AR's loading share "
        f"{_f(ar.get('loading_share'), '{:.2f}')}"
        if bw
        else f"### uncapped: AR's loading share {_f(ar.get('loading_share'), '{:.2f}')}"
    )
    evals = cell.get("spec_bench_eval") or {}
    lines = [
        head,
        "",
        "| task | method | questions (turns) | TPS | ×AR | ×AR-cache | limit TPS | mean accepted | loads/tok | MiB/tok "
        "| equals AR | speed.py ×AR | speed.py mean accepted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        for label, tasks in cell["per_task"].items():
            row = tasks.get(task)
            if row is None:
                continue
            printed = (evals.get(label) or {}).get("tasks", {}).get(task)
            sb = _f(row["spec_bench_speedup"], "{:.2f}")
            if printed:
                sb += f" (printed {printed['speedup']:.2f})"
            lines.append(
                f"| {task} | {NAMES.get(label, label)} | {row['questions']} ({row['turns']}) | "
                f"{_f(row['decode_tps'], '{:.1f}')} | {_f(row['speedup'], '{:.2f}')} | "
                f"{_f(row['speedup_vs_cache'], '{:.2f}')} | {_f(row.get('physical_limit_tps'), '{:.1f}')} | "
                f"{_f(row['mean_accepted_tokens'], '{:.2f}')} | "
                f"{_f(row['loads_per_token'], '{:.1f}')} | {_f(row['mib_per_token'], '{:.2f}')} | "
                f"{row['equal_ar']} | {sb} | "
                f"{_f(row['spec_bench_mean_accepted'], '{:.2f}')} |"
            )
    extra = (cell["methods"].get("ar-cache") or {}).get("extra_memory")
    if extra:
        lines += [
            "",
            f"AR + expert cache holds DraftExpert's memory beyond AR: {extra['bytes'] / 2**20:.2f} MiB (draft experts "
            f"{extra['draft_expert_bytes'] / 2**20:.2f} MiB + prefetch buffer "
            f"{extra['prefetch_buffer_bytes'] / 2**20:.2f}"
            f" MiB); its cache saved {_f(cell['methods']['ar-cache'].get('cache_hit_bytes'), '{:.0%}')} of cold AR's "
            f"expert bytes; DraftExpert's prefetch hit rate "
            f"{_f(cell['methods']['draftexpert'].get('prefetch_hit_rate'), '{:.2f}')}.",
        ]
    for label, ids in (cell.get("not_run") or {}).items():
        lines += [
            "",
            f"{NAMES.get(label, label)}: not run on {', '.join(ids)} (the prompt does not fit the model's "
            "context with the new tokens; see the run's log).",
        ]
    if evals:
        eq = {label: e["equal"] for label, e in evals.items()}
        lines += ["", f"Spec-Bench's equal.py on each method's answers against AR's: {eq}."]
    lines += [
        "",
        f"Answers (Spec-Bench's format): {', '.join(f'`{p}`' for p in cell['answers'].values())}. This cap's run "
        f"took {cell['wall_s']:.0f} s; all 480 questions would take about "
        f"{full_set_estimate_s(cell, tasks) / 3600:.1f} h "
        "here (estimate: each task's measured seconds per question × 80).",
    ]
    return "\n".join(lines)


def page(res: dict, command: str, machine_id: str, date: str) -> str:
    q = res["questions"]
    spec = res["spec"]
    return (
        f"# Spec-Bench on {res['model']}, platform {res['platform']}, engine {res['engine']}\n\n"
        "Spec-Bench's questions (Xia et al., Findings of ACL 2024; github.com/hemingkx/Spec-Bench, Apache-2.0; "
        "from MT-Bench, WMT14 DE-EN, CNN/DailyMail, Natural Questions, GSM8K, DPR): "
        + ", ".join(f"{t} {n}" for t, n in q.items())
        + f" questions, every turn, {res['max_new_tokens']} new tokens a turn, greedy; K_max = {spec['k_max']}, "
        f"τ = {spec['tau']}, B = {spec['budget']}. {date}, machine {machine_id}; `{command}`.\n\n"
        "×AR and ×AR-cache: decode tokens/s from the summed counters over the task's questions, over cold AR's and "
        "over AR with the equal-memory expert cache; mean accepted = tokens emitted per verify round (AR: 1); "
        "loads/tok = experts moved per emitted token; equals AR = every answer token for token. speed.py ×AR: "
        "Spec-Bench's own measure from the answer files (mean of per-question tokens/s, AR's tokens re-counted "
        "from its text), and, where a Spec-Bench checkout was given, what its unmodified evaluation/speed.py "
        "printed from the same files. speed.py counts a method's tokens as its new_tokens but the baseline's as "
        "its re-tokenised text less one token a turn (a BOS): AR's own row shows what that alone makes of 1.00 "
        "with this tokenizer. limit TPS = the read bandwidth (the cap, else the storage's measured O_DIRECT "
        "rate) ÷ the bytes a method moves per emitted token: its speed with free compute. The resident bound "
        "(every expert held) is not run on these questions; Table 2 (`results/spec_compare_*`) gives it for the "
        "same models and engines. loads/tok counts every expert brought to the accelerator (on mn, from a staged "
        "DRAM copy too); MiB/tok the bytes read from storage.\n\n"
        + "\n\n".join(cap_section(c, res["tasks"]) for c in res["caps"])
        + "\n"
    )
