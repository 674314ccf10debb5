"""`make reproduce`: regenerate every result the suite can produce today, into results/.

Each step is a bench command whose JSON lands in results/, followed by the paper_figs renderer
that turns it into a table / figure. Steps whose capability has not landed yet are listed as
pending, never faked.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.results import write_json_atomic

# What the paper has that this checkout cannot regenerate yet, and which capability brings it.
PENDING = [
    ("Fig. 1b decode-time breakdown of AR offload", "expert-offload runtime + AR baseline"),
    ("Table 2 decode TPS / speed-up", "runtime, speculative decoding, trained draft experts"),
    ("Fig. 2 / Table 3 drafter cost vs acceptance", "speculative decoding"),
    ("Fig. 3 draft-side unique experts vs length", "speculative decoding"),
    ("Fig. 4 / Fig. 5 verify cost and unique experts vs block length", "expert-offload runtime"),
    ("Table 4 truncation and prefetch", "speculative decoding"),
    ("Table 5 distillation ablation", "self-distilled draft experts"),
]


def reproduce(results_dir: Path, log=lambda m: print(m, file=sys.stderr)) -> dict:
    from bench import registry
    from bench.telemetry import collect
    from draftexpert.params import breakdown
    from paper_figs import fig1a

    done = []
    results_dir.mkdir(parents=True, exist_ok=True)
    log("Table 1 (this machine): bench env")
    write_json_atomic(results_dir / "machine.json", collect(results_dir))
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
    done += ["results/params/*.json", "results/fig1a_params.md",
             *[str(p.relative_to(results_dir.parent)) for p in fig1a.figure(df, figs_dir / "fig1a_params")]]
    for item, needs in PENDING:
        log(f"pending: {item} (needs: {needs})")
    summary = {"written": done, "pending": [{"result": i, "needs": n} for i, n in PENDING]}
    (results_dir / "REPRODUCE.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
