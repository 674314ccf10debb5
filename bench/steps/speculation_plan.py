"""`bench plan --speculation`: will speculation pay on this model, engine and storage?

A calibration decodes a few held-out prompts (the last prompt of each suite: no `--limit` measurement
shares them) with AR and each fixed speculative setting of the regime sweep, through the same runner
and decoders as `bench compare`; each method's row (decode TPS, bytes moved per emitted token, α and
its per-position counts) goes into a profile. The prediction at a slower storage is the calibrated
roofline `draftexpert.metrics.predicted_tps` — a token takes the longer of moving its bytes and
decoding as calibrated — and the speed-up is its ratio to AR's. `bench run` prints the profile's
prediction for its method in one line before it decodes (`note`).

The profile is written to `runs/plan-<model>-<platform>[-llama.cpp]/profile.json`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from bench.cells.cell import Cell
from bench.steps import compare as cmp
from bench.suites import prompts as suite_prompts
from draftexpert import metrics

PROFILE = "profile.json"
PER_SUITE = 1  # held-out prompts per suite the calibration decodes
# The sweep's fixed settings (the adaptive ones — the cost controller, auto — choose among these per round).
CALIBRATED = ["ar", "top-1", "top-2", "top-3", "draftexpert", "top-3-k8", "draftexpert-k8", "pld"]
KEEP = ("decode_tps", "decode_tokens", "moved_bytes", "mib_per_token", "acceptance", "loading_share",
        "drafted_at", "accepted_at", "config_hash", "method_args", "speedup")  # fmt: skip


def held_out_prompts(suites: list[str] | None, per_suite: int = PER_SUITE) -> list[dict]:
    """The last `per_suite` prompts of each suite (a measurement takes the first N)."""
    return [p for s in (suites or list(suite_prompts.SUITES)) for p in suite_prompts.load(s, None)[-per_suite:]]


def profile_dir(root: Path, base: Cell) -> Path:
    return Path(root) / "runs" / f"plan-{base.model}-{base.platform}{base.engine_tag}"


def calibrate(base: Cell, folder: Path, prompts: list[dict], out_dir: Path, expert_file, machine: dict,
              log=print) -> dict:  # fmt: skip
    """Each calibrated method through `bench compare`'s regime cell on `prompts`, at `base.read_bw`
    (None: this storage as it is); the profile, written to `out_dir`/profile.json."""
    res = cmp.compare(base, folder, prompts, out_dir / "cells", expert_file, machine, CALIBRATED, log, cmp.REGIME_CELL)
    rows = res["methods"]
    profile = {
        "model": base.model,
        "platform": base.platform,
        "engine": base.engine,
        "expert_type": base.expert_type,
        "spec": base.spec.as_dict(),
        "read_bw": base.read_bw,
        "storage_read_bw": res["limit_read_bw"],  # bytes/s of the storage itself when measured
        "date": datetime.date.today().isoformat(),
        "machine": (machine or {}).get("machine_id") or (machine or {}).get("hostname"),
        "prompts": [p["id"] for p in prompts],
        "max_new_tokens": base.max_new_tokens,
        "tokens_equal_ar": res["tokens_equal_ar"],
        "methods": {label: {k: row.get(k) for k in KEEP} for label, row in rows.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PROFILE).write_text(json.dumps(profile, indent=1, sort_keys=True))
    return profile


def predict(profile: dict, caps: list[int | None]) -> dict:
    """{cap: {label: {"tps", "speedup"}}} at each read cap (None: the calibration's storage)."""
    out = {}
    for cap in caps:
        ar = metrics.predicted_tps(profile["methods"]["ar"], cap)
        out[cap] = {}
        for label, row in profile["methods"].items():
            tps = metrics.predicted_tps(row, cap)
            out[cap][label] = {"tps": tps, "speedup": tps / ar if tps and ar else None}
    return out


def best(pred_at: dict, among=None) -> tuple[str, float]:
    """The speculative method predicted fastest at one cap, and its speed-up over AR."""
    cands = {
        k: v["speedup"] for k, v in pred_at.items() if k != "ar" and v["speedup"] and (among is None or k in among)
    }
    label = max(cands, key=cands.get)
    return label, cands[label]


def verdict(pred_at: dict, where: str) -> str:
    """One line: which method is predicted to win at one cap, AR named plainly when it does."""
    label, x = best(pred_at)
    if x < 1.0:
        return f"{where}: AR is predicted to win — every speculative setting is slower (best: {label} {x:.2f}× AR)."
    return f"{where}: {label} is predicted fastest, {x:.2f}× AR."


def _cap_name(cap: int | None) -> str:
    return f"{cap / 1e6:.0f} MB/s" if cap else "here"


def table(profile: dict, pred: dict) -> str:
    """The profile's methods × caps, predicted ×AR (TPS), one verdict per cap."""
    caps = list(pred)
    store = (
        f"read cap {profile['read_bw'] / 1e6:.0f} MB/s"
        if profile["read_bw"]
        else "storage uncapped"
        + (f" (measured {profile['storage_read_bw'] / 1e9:.2f} GB/s)" if profile.get("storage_read_bw") else "")
    )
    lines = [
        f"Will speculation pay? {profile['model']} on {profile['platform']}, engine {profile['engine']}: calibrated "
        f"{profile['date']} on {len(profile['prompts'])} held-out prompts × {profile['max_new_tokens']} tokens, "
        f"{store}.",
        "Predicted ×AR (TPS): a token takes the longer of moving its bytes at the cap and decoding as calibrated.",
        "",
        "| method | α | MiB/token | " + " | ".join(_cap_name(c) for c in caps) + " |",
        "|---|---|---|" + "---|" * len(caps),
    ]
    for label, row in profile["methods"].items():
        a = row.get("acceptance")
        cells = [
            f"{p[label]['speedup']:.2f} ({p[label]['tps']:.1f})" if p[label]["speedup"] else "–" for p in pred.values()
        ]
        moved, tokens = row.get("moved_bytes"), row.get("decode_tokens")
        mib = f"{moved / tokens / 2**20:.2f}" if moved is not None and tokens else "–"
        alpha = f"{a:.2f}" if a is not None else "–"
        lines.append(f"| {label} | {alpha} | {mib} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [verdict(p, _cap_name(c)) for c, p in pred.items()]
    lines.append(
        "--method auto chooses per round among DraftExpert, top-1, top-3 and AR by measured price (not predicted "
        "here: it adapts to what it measures)."
    )
    if not all(profile["tokens_equal_ar"].values()):
        lines.append(
            "WARNING: a calibrated method's tokens differ from AR's: " + json.dumps(profile["tokens_equal_ar"])
        )
    return "\n".join(lines)


def against(profile: dict, regime: dict, labels=None) -> list[dict]:
    """Predicted beside measured: for each cap of a regime sweep (`bench compare --set regime`'s JSON)
    and each calibrated method it measured, the predicted and measured ×AR and their ratio."""
    out = []
    for cell in regime["caps"]:
        cap, m = cell["read_bw"], cell["methods"]
        pred = predict(profile, [cap])[cap]
        for label in labels or profile["methods"]:
            if label == "ar" or label not in m or not pred.get(label, {}).get("speedup"):
                continue
            p, x = pred[label]["speedup"], m[label]["speedup"]
            out.append({"read_bw": cap, "method": label, "predicted": p, "measured": x, "error": p / x - 1})
    return out


def against_table(rows: list[dict]) -> str:
    lines = ["| read cap | method | predicted ×AR | measured ×AR | error |", "|---|---|---|---|---|"]
    for r in rows:
        cap = f"{r['read_bw'] / 1e6:.0f} MB/s" if r["read_bw"] else "uncapped"
        lines.append(
            f"| {cap} | {r['method']} | {r['predicted']:.2f} | {r['measured']:.2f} | {100 * r['error']:+.0f}% |"
        )
    return "\n".join(lines)


def note(root: Path, cell: Cell) -> str:
    """`bench run`'s one line before a speculative method decodes: the profile's prediction for this
    method at this cell's cap, or how to get one."""
    path = profile_dir(root, cell) / PROFILE
    cmd = f"bench plan --speculation --model {cell.model} --platform {cell.platform} --engine {cell.engine}"
    if not path.exists():
        return f"plan: {cell.model} on {cell.platform}/{cell.engine} not calibrated — `{cmd}` predicts whether it pays"
    try:
        profile = json.loads(path.read_text())
        pred = predict(profile, [cell.read_bw])[cell.read_bw]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"plan: the calibration {path} could not be read ({type(e).__name__}: {e}); rerun `{cmd}`"
    where = _cap_name(cell.read_bw) if cell.read_bw else "this storage"
    mine = pred.get(_calibrated_label(cell))
    top, x = best(pred)
    head = f"plan ({profile['date']}, {where}): "
    if mine and mine["speedup"]:
        head += f"{_calibrated_label(cell)} predicted {mine['speedup']:.2f}× AR; "
    if x < 1.0:
        return head + f"AR is predicted to win (best speculative: {top} {x:.2f}×)"
    return head + f"best predicted: {top} {x:.2f}× AR"


def _calibrated_label(cell: Cell) -> str | None:
    """The calibrated setting a cell runs: the same method, and each option the setting fixes (r, K_max,
    truncation, prefetch) the same; the paper's controller."""
    spec = cell.spec.as_dict()
    if spec.get("controller", "paper") != "paper":
        return None
    for label, method, over in cmp.SETS["regime"]:
        if label in CALIBRATED and method == cell.method:
            want = {"k_max": 4, "truncate": True, "prefetch": True, **over}
            if all(spec.get(k) == v for k, v in want.items()):
                return label
    return None


CHECK_CAPS = (16 * 10**6, 64 * 10**6, 128 * 10**6)  # where the prediction is checked: storage-bound caps
TOLERANCE = 0.15


def check_summary(rows: list[dict], caps=CHECK_CAPS, tolerance: float = TOLERANCE) -> str:
    """One line per checked cap: how many methods' predictions fell within ±tolerance, the worst error."""
    out = []
    for cap in caps:
        at = [r for r in rows if r["read_bw"] == cap]
        if not at:
            continue
        ok = sum(abs(r["error"]) <= tolerance for r in at)
        worst = max(at, key=lambda r: abs(r["error"]))
        out.append(
            f"{cap / 1e6:.0f} MB/s: {ok} of {len(at)} methods within ±{100 * tolerance:.0f}% "
            f"(worst {worst['method']} {100 * worst['error']:+.0f}%)"
        )
    return "\n".join(out)


def page(profile: dict, pred: dict, rows: list[dict] | None, command: str, machine: str) -> str:
    """results/plan_<model>_mn[_llama.cpp].md: the prediction, and beside it the regime sweep's measurement."""
    text = f"{profile['date']}, machine {machine}; `{command}`.\n\n" + table(profile, pred)
    if rows:
        text += (
            "\n\nPredicted beside measured (the regime sweep, `results/regime_*.json`: its own prompts, the first "
            "of each suite; the calibration never saw them):\n\n" + against_table(rows) + "\n\n" + check_summary(rows)
        )
    return text + "\n"
