"""The README's result tables, formatted from the committed results (`results/*.json`) — nothing
here measures or computes a figure (`draftexpert.metrics` did, when the results were written), so the
README's numbers are the results' numbers; `tests/test_results.py` checks that README.md holds each
table exactly as printed here. `python -m paper_figs.readme [RESULTS_DIR]` prints them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from paper_figs.regime import rows as regime_rows

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODELS = ("ds-tiny", "ml-tiny")
ENGINES = (("torch", ""), ("llama.cpp", "_llama.cpp"))


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _x(v) -> str:
    return f"{v:.2f}×" if v is not None else "–"


def _pair(row: dict) -> str:
    """×AR + cache / ×AR of a row."""
    return f"{_x(row.get('speedup_vs_cache'))} / {_x(row.get('speedup'))}"


def _equal(res: dict) -> str:
    bad = [m for m, ok in res["tokens_equal_ar"].items() if not ok]
    return "yes, every method" if not bad else "no: " + ", ".join(bad)


TABLE2_HEAD = (
    "| model | AR offload | AR + expert cache (×AR) | resident bound (×AR) | best top-r (×AR + cache / ×AR) | "
    "pld (×AR + cache / ×AR) | DraftExpert (×AR + cache / ×AR) | DE, cost controller | auto | limit (AR) | "
    "tokens = AR |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def table2_row(res: dict) -> str:
    m = res["methods"]
    ar, cache, resident = m["ar"], m["ar-cache"], m["ar-resident"]
    best = max((r for r in ("top-1", "top-2", "top-3") if r in m), key=lambda r: m[r]["decode_tps"])
    de = m["draftexpert"]
    cells = [
        res["model"],
        f"{ar['decode_tps']:.1f}",
        f"{cache['decode_tps']:.1f} ({_x(cache['speedup'])}, +{cache['extra_memory']['bytes'] / 2**20:.1f} MiB, "
        f"hit {cache['cache_hit_bytes']:.2f})",
        f"{resident['decode_tps']:.1f} ({_x(resident['speedup'])})",
        f"{m[best]['decode_tps']:.1f} ({_pair(m[best])}, {best})",
        f"{m['pld']['decode_tps']:.1f} ({_pair(m['pld'])})",
        f"{de['decode_tps']:.1f} ({_pair(de)}; α {de['acceptance']:.2f})",
        *(f"{m[k]['decode_tps']:.1f} ({_pair(m[k])})" for k in ("draftexpert-cost", "auto")),
        f"{ar['physical_limit_tps']:.0f}",
        _equal(res),
    ]
    return "| " + " | ".join(cells) + " |"


def table2(results: Path, suffix: str) -> str | None:
    rows = [r for r in (_load(results, f"spec_compare_{model}_mn{suffix}") for model in MODELS) if r]
    return "\n".join([TABLE2_HEAD, *(table2_row(r) for r in rows)]) if rows else None


REGIME_HEAD = (
    "| read cap | engine | AR tok/s (limit) | AR loading share | AR + cache ×AR | best top-r ×AR | DraftExpert ×AR | "
    "DE cost ×AR / ÷ best | auto ×AR / ÷ best | tokens = AR |\n|---|---|---|---|---|---|---|---|---|---|"
)
REGIME_CAPS = (16 * 10**6, 128 * 10**6, 512 * 10**6, None)  # the README's rows; every cap is in results/


def _cap(bw) -> str:
    return f"{bw / 1e6:.0f} MB/s" if bw else "uncapped"


def _setting(label: str) -> str:
    return label.replace("-k8", ", K = 8")


def _over(v, best) -> str:
    return f"{v:.2f} / {v / best:.2f}" if v is not None and best else "–"


def regime(results: Path, model: str = "ds-tiny") -> str | None:
    by_engine = {e: _load(results, f"regime_{model}_mn{suffix}") for e, suffix in ENGINES}
    rows = {e: {r["read_bw"]: r for r in regime_rows(res)} for e, res in by_engine.items() if res}
    if not rows:
        return None
    lines = [REGIME_HEAD]
    for bw in REGIME_CAPS:
        for engine, by_cap in rows.items():
            r = by_cap.get(bw)
            if r is None:
                continue
            limit = f" ({r['ar_limit_tps']:.1f})" if bw else ""
            cells = [
                _cap(bw),
                engine,
                f"{r['ar_tps']:.1f}{limit}",
                f"{r['ar_loading_share']:.2f}",
                f"{r['ar_cache_speedup']:.2f}" if r["ar_cache_speedup"] is not None else "–",
                f"{r['top_r_speedup']:.2f} ({_setting(r['best_top_r'])})",
                f"{r['de_speedup']:.2f}",
                _over(r["de_cost_speedup"], r["best_fixed_speedup"]),
                _over(r["auto_speedup"], r["best_fixed_speedup"]),
                "yes" if r["tokens_equal_ar"] else "no",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PLAN_HEAD = (
    "| engine | read cap | top-3-k8 predicted / measured ×AR | top-3 | DraftExpert | methods within ±15% |\n"
    "|---|---|---|---|---|---|"
)
PLAN_METHODS = ("top-3-k8", "top-3", "draftexpert")
TOLERANCE = 0.15  # the prediction's bar: within ±15% of the measured speed-up


def plan(results: Path, model: str = "ds-tiny") -> str | None:
    lines = [PLAN_HEAD]
    for engine, suffix in ENGINES:
        res = _load(results, f"plan_{model}_mn{suffix}")
        if not res or not res.get("against"):
            continue
        asked = {int(k) for k in res["predicted"] if k != "None"}  # the plan's --cap list (the bar's caps)
        caps = sorted({a["read_bw"] for a in res["against"]} & asked)
        for bw in caps:
            here = {a["method"]: a for a in res["against"] if a["read_bw"] == bw}
            pm = [f"{here[m]['predicted']:.2f} / {here[m]['measured']:.2f}" if m in here else "–" for m in PLAN_METHODS]
            within = sum(abs(a["error"]) <= TOLERANCE for a in here.values())
            lines.append(f"| {engine} | {_cap(bw)} | " + " | ".join(pm) + f" | {within} of {len(here)} |")
    return "\n".join(lines) if len(lines) > 1 else None


SPEC_BENCH_HEAD = (
    "| model | engine | reads | AR loading share | AR tok/s | AR + cache ×AR | top-3 | pld | DraftExpert | "
    "mean accepted (DE) | answers = AR |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def spec_bench(results: Path) -> str | None:
    lines = [SPEC_BENCH_HEAD]
    for engine, _ in ENGINES:
        for model in MODELS:
            res = _load(results, f"spec_bench_{model}_mn_{engine}")
            for cell in (res or {}).get("caps", []):
                o = {m: t["overall"] for m, t in cell["per_task"].items()}
                ar = o["ar"]
                cells = [
                    model,
                    engine,
                    _cap(cell["read_bw"]),
                    f"{ar['loading_share']:.2f}",
                    f"{ar['decode_tps']:.1f}",
                    f"{o['ar-cache']['speedup']:.2f}",
                    *(
                        f"{o[m]['speedup_vs_cache']:.2f} / {o[m]['speedup']:.2f}"
                        for m in ("top-3", "pld", "draftexpert")
                    ),
                    f"{o['draftexpert']['mean_accepted_length']:.2f}",
                    "yes" if all(cell["answers_equal_ar"].values()) else "no",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 1 else None


def tables(results: Path = RESULTS) -> dict[str, str]:
    """Each README table by name, for the results that exist."""
    out = {f"table2 {engine}": table2(results, suffix) for engine, suffix in ENGINES}
    out.update(regime=regime(results), plan=plan(results), spec_bench=spec_bench(results))
    return {name: text for name, text in out.items() if text}


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    for name, text in tables(results).items():
        print(f"<!-- {name} -->\n{text}\n")


if __name__ == "__main__":
    main()
