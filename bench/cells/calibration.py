"""A calibration profile (`bench plan --speculation`) as the cost controller's prior: each drafter's
per-position acceptance counts from the calibration's rows, so `--method auto` and `--controller cost`
start from what the drafters accepted on held-out prompts rather than from ½ (their prices are still
measured in the run: a draft forward, a verify pass and a load are timed in its first rounds)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bench.cells.cell import CellError

PRIOR_ROUNDS = 32  # pseudo-rounds a prior weighs at most (a run's own rounds outweigh it soon)


class CalibrationError(CellError):
    """A profile that cannot be read or does not calibrate the drafters asked for."""


def row_for(methods: dict, drafter: str, k_max: int) -> str | None:
    """The profile row that calibrates `drafter` at `k_max`: its K = k_max setting when calibrated
    (e.g. top-3-k8), else the drafter's own (K = 4)."""
    for label in (f"{drafter}-k{k_max}", drafter):
        if label in methods and methods[label].get("drafted_at"):
            return label
    return None


def priors(path: Path, model: str, drafters: list[str], k_max: int) -> tuple[dict[str, tuple[list, list]], dict]:
    """({drafter: (drafted_at, accepted_at)}, the profile's record for a key) from a profile of `model`."""
    try:
        raw = Path(path).read_bytes()
        profile = json.loads(raw)
        methods = profile["methods"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"--calibration: {path} is not a calibration profile ({type(e).__name__}: {e})") from e
    if profile.get("model") != model:
        raise CalibrationError(f"--calibration: {path} calibrates {profile.get('model')}, not {model}")
    out = {}
    for d in drafters:
        label = row_for(methods, d, k_max)
        if label is None:
            raise CalibrationError(
                f"--calibration: {path} does not calibrate the drafter {d} (rows: {', '.join(methods)}); "
                "rerun `bench plan --speculation`"
            )
        out[d] = (methods[label]["drafted_at"], methods[label]["accepted_at"])
    meta = {
        "sha256": hashlib.sha256(raw).hexdigest()[:16],
        "date": profile.get("date"),
        "model": profile.get("model"),
        "engine": profile.get("engine"),
        "rows": {d: row_for(methods, d, k_max) for d in drafters},
    }
    return out, meta
