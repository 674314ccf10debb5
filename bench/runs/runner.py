"""The runner: one configuration × a list of prompts → one record per prompt in a run folder.

It renders each prompt with the model's chat template, calls the method's `Decoder.generate`,
and appends the record: the tokens, their text, the decoder's counters and, from them, the
per-prompt figures of `draftexpert.metrics` (a table re-derives its own from the summed counters,
never from these). A multi-turn question (Spec-Bench, MT-Bench) is decoded turn by turn: each
turn's prompt is the conversation so far (earlier turns and the model's own answers, as text)
through the chat template, `max_new_tokens` is per turn, and its one record holds every turn
(`turns`) and, at the top, the turns' tokens concatenated and their counters summed.
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
from bench.suites.prompts import render_conversation
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
    converse = lambda turns, answers: render_conversation(tokenizer, turns, answers)  # noqa: E731
    if render is None:
        render = lambda text: converse([text], [])  # noqa: E731
    else:
        converse = None  # a caller's own encoding covers one-turn prompts only
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
                try:
                    turns = decode_turns(p, rendered[p["id"]], decoder, tokenizer, cfg.max_new_tokens, converse)
                except ContextOverflow as e:  # a later turn: its prompt holds the answers so far
                    if on_overflow == "refuse":
                        raise
                    overflow.append({"prompt_id": p["id"], "prompt_tokens": None, "reason": str(e)})
                    progress.note(f"{p['id']}: skipped — {e}")
                    progress.done("", 0, 0.0)
                    continue
                record = {
                    "key": key, "run": run_name or Path(run_dir).name, "config_hash": h, "machine_id": mid, **conf,
                    "prompt_id": p["id"], "category": p["category"],
                    **{k: p[k] for k in ("question_id", "source_category") if k in p},
                    **merge_turns(turns), "finished_at": time.time(),
                }
                c = metrics.counters(record)
                record.update({**c, **metrics.derive(c)})
                store.write(record)
                written += 1
                progress.done(f"{p['id']}: {record['new_tokens']} tokens, {record['decode_tps']:.1f} tok/s",
                              record["new_tokens"], record["decode_s"])
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


def decode_turns(prompt: dict, first_ids: list[int], decoder: Decoder, tokenizer, max_new_tokens: int,
                 converse: Callable[[list[str], list[str]], list[int]] | None) -> list[dict]:
    """Every turn of `prompt` decoded in order (one-turn prompts: one); per turn its prompt length,
    tokens, text, seconds, per-round emitted tokens (`accept_lengths`; 1 a step without
    speculation) and the decoder's counters. A later turn that does not fit: ContextOverflow."""
    turns = prompt.get("turns") or [prompt["prompt"]]
    if len(turns) > 1 and converse is None:
        raise ValueError(f"{prompt['id']}: a multi-turn prompt needs the chat-template renderer")
    answers: list[str] = []
    out_turns = []
    for i in range(len(turns)):
        ids = first_ids if i == 0 else converse(turns, answers)
        if i > 0:
            try:
                check_context(decoder.positions(len(ids), max_new_tokens), decoder.context_length, len(ids),
                              max_new_tokens)
            except ContextOverflow as e:
                raise ContextOverflow(f"turn {i + 1}: {e}") from None
        out = decoder.generate(ids, max_new_tokens, tokenizer.eos_token_id)
        text = tokenizer.decode(out.tokens, skip_special_tokens=True)
        answers.append(text)
        stats = dict(out.stats)
        stats.setdefault("accept_lengths", [1] * (len(out.tokens) - 1))  # one token a forward
        turn = {"prompt_tokens": len(ids), "tokens": out.tokens, "new_tokens": len(out.tokens), "text": text,
                "prefill_s": out.prefill_s, "decode_s": out.decode_s, **stats}
        out_turns.append({**turn, **metrics.counters(turn)})
    return out_turns


def merge_turns(turns: list[dict]) -> dict:
    """A record's fields from its turns: one turn as it is; several → tokens and accept_lengths
    concatenated, numbers (counters, seconds, the ledger's) summed, `prefills` = turns, the first
    turn's prompt length, and `turns` (each without its ledger, whose sums are at the top)."""
    if len(turns) == 1:
        return dict(turns[0])
    out = {"prompt_tokens": turns[0]["prompt_tokens"], "prefills": len(turns)}
    for t in turns:
        for k, v in t.items():
            if k not in ("prompt_tokens", "text", "prefills"):
                out[k] = _add(out[k], v, k) if k in out else v
    out["turns"] = [{k: v for k, v in t.items() if k != "ledger"} for t in turns]
    return out


def _add(a, b, key: str):
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a[k], b[k], k) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):
        if key in metrics.LISTS:  # per-position counters: element-wise
            n = max(len(a), len(b))
            return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(n)]
        return a + b  # tokens, accept_lengths: in order
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return max(a, b) if key.endswith("_peak_bytes") else a + b
    return b  # anything else (none today): the last turn's
