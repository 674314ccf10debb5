"""The runner: one configuration × a list of prompts → one record per prompt in a run folder.

It renders each prompt with the model's chat template, calls the method's `Decoder.generate`,
and appends the record: the decoder's counters and, from them, the per-prompt figures of
`draftexpert.metrics` (a table re-derives its own from the summed counters, never from these).
Cells already in the folder (same configuration hash and prompt id) are skipped, so an
interrupted sweep resumes where it stopped.

A prompt whose tokens and new tokens (+ K_max + 1 for speculation) exceed the decoder's context
is never started: with `on_overflow="skip"` it is skipped with its reason (logged, in the summary
and the manifest's session entry) and the rest of the suite runs; with `"refuse"` the whole run is
refused before anything is decoded or written.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.runs.progress import Progress
from bench.suites.prompts import render_prompt
from bench.runs.results import RecordWriter, RunFolderError, RunManifest, cell_key, config_hash
from bench.runs.telemetry import machine_id
from draftexpert import metrics
from draftexpert.decoding import ContextOverflow, Decoder, check_context


@dataclass
class CellConfig:
    """What identifies a cell besides its prompt (hashed into the record key)."""

    model: str
    method: str
    weights: str = ""  # sha256 of the checkpoint's safetensors (runtime.checkpoint.weights_fingerprint)
    platform: str = "resident"
    engine: str = "torch"
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    method_args: dict = field(default_factory=dict)  # r, k_max, tau, budget, truncate, prefetch …


OVERFLOW = ("skip", "refuse")


def context_overflows(prompts: list[dict], ids: dict[str, list[int]], decoder: Decoder,
                      max_new_tokens: int) -> list[dict]:
    """The prompts (rendered: `ids` by prompt id) that do not fit the decoder's context, each with its reason."""
    out = []
    for p in prompts:
        n = len(ids[p["id"]])
        try:
            check_context(decoder.positions(n, max_new_tokens), decoder.context_length, n, max_new_tokens)
        except ContextOverflow as e:
            out.append({"prompt_id": p["id"], "prompt_tokens": n, "reason": str(e)})
    return out


def run_cells(cfg: CellConfig, prompts: list[dict], decoder: Decoder, tokenizer, run_dir: Path,
              machine: dict | None = None, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
              run_name: str | None = None, on_overflow: str = "skip",
              render: Callable[[str], list[int]] | None = None) -> dict:
    """Decode every prompt not yet in `run_dir`; return a summary of this session. `prompts`: a
    list of records or a `datasets.Dataset`; `render`: text → ids (default the chat template)."""
    if on_overflow not in OVERFLOW:
        raise ValueError(f"--context-overflow: {on_overflow!r} is not one of {', '.join(OVERFLOW)}")
    render = render or (lambda text: render_prompt(tokenizer, text))
    prompts = list(prompts)
    rendered = {p["id"]: render(p["prompt"]) for p in prompts}  # once: checked, then decoded
    overflow = context_overflows(prompts, rendered, decoder, cfg.max_new_tokens)
    if overflow and on_overflow == "refuse":
        raise ContextOverflow(f"{len(overflow)} prompt(s) do not fit the context, nothing was run: "
                              f"{overflow[0]['prompt_id']}: {overflow[0]['reason']}"
                              + (f" (and {len(overflow) - 1} more)" if len(overflow) > 1 else "")
                              + "; lower --max-new-tokens or use --context-overflow skip")
    too_long = {o["prompt_id"]: o for o in overflow}
    conf = asdict(cfg)
    mid = (machine or {}).get("machine_id") or machine_id()
    ident = {**conf, "machine_id": mid}  # the same cell on another machine is a new cell
    h = config_hash(ident)
    manifest = RunManifest(run_dir, conf, machine)
    written = skipped = 0
    status = "interrupted"
    progress = Progress(len(prompts), f"{cfg.model} {cfg.method} {cfg.platform}", log)
    try:
        with RecordWriter(run_dir) as store:
            if store.repaired_bytes:
                progress.note(f"repaired a torn last record ({store.repaired_bytes} bytes) in {store.path}; "
                              "it will be redone")
            for p in prompts:
                key = cell_key(ident, p["id"])
                if key in store.done:
                    skipped += 1
                    progress.done("", 0, 0.0)
                    continue
                if p["id"] in too_long:
                    progress.note(f"{p['id']}: skipped — {too_long[p['id']]['reason']}")
                    progress.done("", 0, 0.0)
                    continue
                ids = rendered[p["id"]]
                out = decoder.generate(ids, cfg.max_new_tokens, tokenizer.eos_token_id)
                record = {
                    "key": key, "run": run_name or Path(run_dir).name, "config_hash": h, "machine_id": mid, **conf,
                    "prompt_id": p["id"], "category": p["category"], "prompt_tokens": len(ids),
                    "tokens": out.tokens, "new_tokens": len(out.tokens),
                    "prefill_s": out.prefill_s, "decode_s": out.decode_s, "finished_at": time.time(), **out.stats,
                }
                c = metrics.counters(record)
                record.update({**c, **metrics.derive(c)})
                store.write(record)
                written += 1
                progress.done(f"{p['id']}: {len(out.tokens)} tokens, {record['decode_tps']:.1f} tok/s",
                              len(out.tokens), out.decode_s)
        status = "complete"
    except KeyboardInterrupt:
        raise
    except BaseException:
        status = "failed"
        raise
    finally:
        progress.close()
        try:
            manifest.finish(status, written=written, skipped=skipped, skipped_context=overflow)
        except RunFolderError as e:
            if status == "complete":
                raise
            log(f"warning: the manifest could not be marked {status}: {e}")
    return {"run_dir": str(run_dir), "config_hash": h, "written": written, "skipped": skipped,
            "records": written + skipped, "skipped_context": overflow}
