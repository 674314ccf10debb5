"""lm-eval on the suite's decoders: the registered model `draftexpert` and `bench eval`.

`DraftExpertLM` is an `lm_eval.api.model.LM` (`@register_model("draftexpert")`):
- `generate_until` decodes through any of the suite's decoders — `ar` (AR offload), `top-r`,
  `draftexpert` — on either engine and platform (`bench.cells.decoders.make_decoder`). The requests go
  through the runner into a run folder (one record per request, keyed by task, doc and a digest
  of the context), so an interrupted evaluation resumes and every record carries the decoder's
  counters (TPS, α, loads). The text is the decoded tokens cut at the first stop string.
- `loglikelihood` / `loglikelihood_rolling` score with the target's forward: the same weights as
  the decoder's target (for mn, its expert file's), every expert resident — speculation changes
  how tokens are found, never the distribution, so scores are the same for every method.

lm-eval 0.4 has no entry point for models of other packages: the model exists once this module
is imported. `python -m bench.steps.evaluation ARGS` is lm-eval's own command line with it registered
(`--model draftexpert --model_args model=ds-tiny,method=draftexpert,platform=mn --tasks
gsm8k_offline --include_path bench/data/lm_eval`); from Python, `import bench.steps.evaluation` then
`lm_eval.simple_evaluate(model="draftexpert", ...)`.

`evaluate` (`bench eval`) runs each method on the same task samples and reports, per task and
method, the metric, decode TPS, α, and whether every answer equals AR's (mismatches listed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import lm_eval
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from bench.cells import registry
from bench.cells.artifacts import expert_file_for
from bench.cells.cell import build
from bench.cells.decoders import context_length, make_decoder
from bench.runs.results import read_records, write_json_atomic
from bench.runs.runner import run_cells
from bench.steps.eval_tasks import OFFLINE_TASKS, TASKS_DIR, UNSAFE
from draftexpert import metrics
from draftexpert.runtime.loader import build_model
from draftexpert.runtime.model import KVCache
from draftexpert.speculation.config import SpecConfig


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _flag(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


def cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string (lm-eval's `until`)."""
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


SPEC = SpecConfig()


@register_model("draftexpert")
class DraftExpertLM(LM):
    """An lm-eval model decoding with one of the suite's methods (args as in `bench run`)."""

    def __init__(
        self,
        model: str = "ds-tiny",
        method: str = "ar",
        platform: str = "mn",
        engine: str = "torch",
        model_path: str | None = None,
        expert_type: str = "q4_0",
        r: int = 1,
        k_max: int = SPEC.k_max,
        tau: float = SPEC.tau,
        budget: int = SPEC.budget,
        truncate=SPEC.truncate,
        prefetch=SPEC.prefetch,
        draft_experts: str | None = None,
        max_gen_toks: int = 256,
        threads: int | None = None,
        out: str | None = None,
        dtype: str = "fp32",
        head_type: str = "checkpoint",
        log: Callable[[str], None] = _stderr,
        **lm_eval_args,
    ):
        super().__init__()
        # lm_eval_args: lm-eval's batch_size / device / … — one sequence at a time; device matters to cg only
        if threads:
            torch.set_num_threads(int(threads))
        self.folder = registry.resolve(model, model_path)
        self.model_name, self.method, self.platform, self.engine = model, method, platform, engine
        self.expert_type, self.max_gen_toks, self.log = expert_type, int(max_gen_toks), log
        self._expert_file = lambda qt: expert_file_for(model, self.folder, qt, log=log)
        device = str(lm_eval_args.get("device") or "")  # lm-eval's --device: cg's GPU or the CPU
        device = (
            ("cpu" if device == "cpu" else "cuda" if device.startswith("cuda") else None) if platform == "cg" else None
        )
        spec = {
            "r": int(r),
            "k_max": int(k_max),
            "tau": float(tau),
            "budget": int(budget),
            "truncate": _flag(truncate),
            "prefetch": _flag(prefetch),
            "draft_experts": Path(draft_experts) if draft_experts else None,
        }
        self.cell, _ = build(
            model=model,
            method=method,
            platform=platform,
            engine=engine,
            expert_type=expert_type,
            device=device,
            dtype=str(dtype),
            head_type=str(head_type),
            **spec,
        )
        self.decoder, self.tokenizer, self.cfg = make_decoder(self.cell, self.folder, self._expert_file)
        self.run_dir = Path(out) if out else self.cell.run_dir(registry.REPO_ROOT, prefix="eval-")
        self.max_length = context_length(self.folder, engine)
        self._target = None  # the scorer's model, built on the first loglikelihood request
        self.requested: set[tuple[str, str]] = set()  # (config hash, prompt id) of every generation asked for

    # -- tokens -------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return f"{self.model_name}:{self.tokenizer.name_or_path}"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        """Text → ids, the tokenizer's BOS first (once, also when a chat template wrote it)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    # -- generation ---------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[int, list[tuple[int, dict, list[str]]]] = {}
        for i, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            if kw.get("do_sample") or float(kw.get("temperature") or 0) > 0:
                raise ValueError(
                    f"{req.task_name}: sampled generation (do_sample / temperature > 0) is not supported "
                    "by the draftexpert model's lm-eval path; it decodes greedily"
                )
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.get("max_gen_toks") or self.max_gen_toks)
            digest = hashlib.sha256(context.encode()).hexdigest()[:12]
            prompt = {
                "id": f"{req.task_name}-{req.doc_id}-{digest}",
                "category": req.task_name or "lm-eval",
                "prompt": context,
            }
            groups.setdefault(n, []).append((i, prompt, until))
        answers: list[str | None] = [None] * len(requests)
        for n, group in groups.items():
            cfg = replace(self.cfg, max_new_tokens=n)
            summary = run_cells(
                cfg,
                [p for _, p, _ in group],
                self.decoder,
                self.tokenizer,
                self.run_dir,
                log=self.log,
                render=self._encode,
                on_overflow="refuse",
            )
            tokens = {
                r["prompt_id"]: r["tokens"]
                for r in read_records(self.run_dir / "records.jsonl")
                if r["config_hash"] == summary["config_hash"]
            }
            self.requested |= {(summary["config_hash"], p["id"]) for _, p, _ in group}
            for i, p, until in group:
                text = cut_at_stop(self.tokenizer.decode(tokens[p["id"]], skip_special_tokens=True), until)
                answers[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return answers

    # -- scoring ------------------------------------------------------------------------

    def _scorer(self):
        if self._target is None:
            gguf = self._expert_file(self.expert_type) if self.platform == "mn" else None
            self._target = build_model(self.folder, "resident", gguf_path=gguf)
        return self._target

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(Σ log p(continuation | context), whether greedy decoding would produce it)."""
        model = self._scorer()
        seq = (context + continuation)[-(self.max_length + 1) :]
        cache = KVCache.for_model(model, len(seq) - 1)
        logits = model.forward(torch.tensor(seq[:-1]), cache, phase="prefill")[-len(continuation) :]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation)
        ll = float(logp.gather(1, target[:, None]).sum())
        return ll, bool((logp.argmax(-1) == target).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            # lm-eval: a context's trailing spaces go with the continuation
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            ctx = self._encode(context)
            whole = self._encode(context + continuation)
            result = self._score(ctx, whole[len(ctx) :])
            out.append(result)
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        out = []
        for req in requests:
            (text,) = req.args[:1]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            windows = map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=ids, prefix_token=prefix, max_seq_len=self.max_length, context_len=1
                ),
            )
            total = sum(self._score(list(ctx), list(cont))[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out


# ---------------------------------------------------------------- bench eval


class EvalError(ValueError):
    """A `bench eval` request that cannot run (unknown task, code execution not allowed, data absent)."""


def task_names(tasks: list[str]) -> list[str]:
    """`bench eval --tasks` names → lm-eval task names (gsm8k, mbpp: the suite's offline tasks)."""
    return [OFFLINE_TASKS.get(t, t) for t in tasks]


def check_tasks(tasks: list[str], allow_code: bool):
    """(lm-eval task names, their TaskManager) for `bench eval --tasks`, or EvalError before anything runs."""
    names = task_names(tasks)
    unsafe = sorted(UNSAFE & set(names))
    if unsafe and not allow_code:
        raise EvalError(
            f"--tasks: {', '.join(unsafe)} run{'s' if len(unsafe) == 1 else ''} the generated code "
            "against the task's tests; pass --allow-code-execution to allow it"
        )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded: a task needing data fails
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("lm_eval.api.task").setLevel(logging.ERROR)  # not the custom_dataset hint on every run
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # indexing lm-eval's own: ~10 s
    if not all(manager.match_tasks([n]) for n in names):
        manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [t for t, n in zip(tasks, names) if not manager.match_tasks([n])]
    if unknown:
        raise EvalError(
            f"--tasks: unknown task(s) {', '.join(unknown)}; the offline ones: "
            f"{', '.join(OFFLINE_TASKS)} (or any lm-eval task whose data is on this machine)"
        )
    return names, manager


def evaluate(
    model: str,
    folder: Path,
    tasks: list[str],
    methods: list[str],
    out_dir: Path,
    platform: str = "mn",
    engine: str = "torch",
    limit: int | None = None,
    max_gen_toks: int = 256,
    allow_code: bool = False,
    lm_args: dict | None = None,
    log: Callable[[str], None] = _stderr,
) -> dict:
    """Each method on the same samples of each task; per task and method: metrics, decode TPS, α,
    and the answers that differ from the first method's (AR's when listed first)."""
    names, manager = check_tasks(tasks, allow_code)  # one manager for every method's run
    per_method, answers = {}, {}
    for method in methods:
        log(f"== {method}")
        lm = DraftExpertLM(
            model=model,
            model_path=str(folder),
            method=method,
            platform=platform,
            engine=engine,
            max_gen_toks=max_gen_toks,
            out=str(out_dir / method),
            log=log,
            **(lm_args or {}),
        )
        res = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            limit=limit,
            log_samples=True,
            confirm_run_unsafe_code=allow_code,
            verbosity="WARNING",
        )
        lm.decoder.close()
        recs = [
            r for r in read_records(lm.run_dir / "records.jsonl") if (r["config_hash"], r["prompt_id"]) in lm.requested
        ]  # this evaluation's, not earlier ones'
        per_method[method] = {
            "results": res["results"],
            "method_args": lm.cfg.method_args,
            "platform": platform,
            "engine": engine,
            "run_dir": str(lm.run_dir),
            "records": recs,
        }
        answers[method] = {(task, s["doc_id"]): s["resps"] for task, samples in res["samples"].items() for s in samples}
    first = methods[0]
    rows = []
    for task in names:
        for method in methods:
            recs = [r for r in per_method[method]["records"] if r["category"] == task]
            agg = metrics.aggregate(recs) if recs else {}
            mine = {k: v for k, v in answers[method].items() if k[0] == task}
            diff = sorted(doc for (_, doc), v in mine.items() if v != answers[first].get((task, doc)))
            scores = {
                k: v
                for k, v in per_method[method]["results"][task].items()  # "metric,filter" → value
                if "," in k and "_stderr" not in k and isinstance(v, (int, float))
            }
            rows.append(
                {
                    "task": task,
                    "method": method,
                    "scores": scores,
                    "samples": len(mine),
                    "decode_tps": agg.get("decode_tps"),
                    "alpha": agg.get("acceptance"),
                    "new_tokens": agg.get("new_tokens"),
                    "answers_equal": not diff,
                    "mismatches": diff,
                    "compared_to": first,
                    "run_dir": per_method[method]["run_dir"],
                }
            )
    summary = {
        "model": model,
        "platform": platform,
        "engine": engine,
        "tasks": names,
        "methods": methods,
        "limit": limit,
        "max_gen_toks": max_gen_toks,
        "rows": rows,
        "mismatches": sum(len(r["mismatches"]) for r in rows),
    }
    write_json_atomic(out_dir / "eval.json", summary)
    return summary


def table(summary: dict) -> str:
    """Markdown: one row per task and method."""
    lines = [
        "| task | method | score | samples | decode TPS | α | answers = " + summary["methods"][0] + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        score = ", ".join(f"{k.replace(',none', '').replace(',', ' ')} {v:.3f}" for k, v in sorted(r["scores"].items()))
        tps = f"{r['decode_tps']:.1f}" if r["decode_tps"] is not None else "–"
        alpha = f"{r['alpha']:.3f}" if r["alpha"] is not None else "–"
        same = "yes" if r["answers_equal"] else f"**no**: docs {', '.join(map(str, r['mismatches']))}"
        lines.append(f"| {r['task']} | {r['method']} | {score} | {r['samples']} | {tps} | {alpha} | {same} |")
    return "\n".join(lines)


def lm_eval_main(argv: list[str]) -> None:
    """lm-eval's own command line with the draftexpert model registered and the offline tasks included."""
    if "--include_path" not in argv:
        argv = [*argv, "--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    lm_eval_main(sys.argv[1:])
