"""A randomized exactness campaign: every decoder, engine and configuration against plain decoding.

Case i of a campaign is drawn from `random.Random(f"{seed}/{engine}/{i}")` alone, so any case
replays by itself (`bench fuzz --engine E --seed S --case i`). A case draws the model, platform,
method (AR offload, shared+top-r for every r < k, DraftExpert with each distilled preset or the
zero draft expert, prompt lookup with its proposal length and n-gram), K_max, τ, B, budget mode,
truncation, prefetch, the drafter's KV cache, the accelerator cache, llama.cpp's staging, a prompt
(a suite prompt, or random token ids), the number of new tokens and — on the torch engine, which
samples — the temperature and seed, and (drawn last, so that adding them left every other draw of
a case as it was) the torch engine's head type on the CPU platforms, then whether a speculative
case runs prompt lookup instead, then whether a drafting one prices its rounds (`--controller cost`).
Each decoder is built by `bench.cells.decoders.make_decoder`, the factory `bench run` uses.

Plain decoding is AR with every expert resident on the same weights: the checkpoint's for the
torch engine's resident and cg platforms, the expert file's (`expert_type`) for mn and for
llama.cpp. The contract checked:
- T = 0: the tokens equal plain decoding's, token for token.
- T > 0, AR offload: equal to plain AR's at the same seed (the same logits, the same draws).
- T > 0, speculative: the first token equals plain AR's (both are the first draw from the
  target's prefill distribution), and the same case decoded twice emits the same tokens (a
  seeded run is reproducible). That the emitted tokens follow the target's distribution is a
  statistical property, proved by `tests/test_speculative.py` (χ² against the exact joint).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.cells import registry
from bench.cells.cell import Cell, SpecOptions
from bench.cells.decoders import available_device, make_decoder
from bench.suites import prompts
from bench.suites.prompts import render_prompt
from draftexpert.speculation.config import SpecConfig
from draftexpert.speculation.lookup import PLD_TOKENS, Lookup

SPEC = SpecConfig()

MODELS = ("ds-tiny", "ml-tiny")
PLATFORMS = {"torch": ("resident", "cg", "mn"), "llama.cpp": ("mn", "resident")}
EXPERT_TYPES = {"torch": ("q4_0", "f32", "bf16"), "llama.cpp": ("q4_0", "f32")}


@dataclass(frozen=True)
class Case:
    index: int
    model: str
    engine: str
    platform: str
    method: str
    expert_type: str = "q4_0"
    r: int = 1
    draft_experts: str | None = None  # a preset file name, "zero", or None (the default: `full`)
    k_max: int = SPEC.k_max
    tau: float = SPEC.tau
    budget: int = SPEC.budget
    budget_mode: str = SPEC.budget_mode
    truncate: bool = SPEC.truncate
    prefetch: bool = SPEC.prefetch
    draft_cache: str = SPEC.draft_cache
    cache_experts: int = 0
    staging: str = "demand"
    prompt_id: str | None = None  # a suite prompt, else `random_ids`
    random_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = SPEC.seed
    head_type: str = "checkpoint"
    pld_tokens: int = PLD_TOKENS
    pld_max_ngram: int = Lookup.max_ngram
    controller: str = SPEC.controller


def draw(engine: str, seed: int, index: int) -> Case:
    rng = random.Random(f"{seed}/{engine}/{index}")
    model = rng.choice(MODELS)
    folder = registry.resolve(model)
    cfg = json.loads((folder / "config.json").read_text())
    top_k, vocab = cfg["num_experts_per_tok"], cfg["vocab_size"]
    platform = rng.choice(PLATFORMS[engine])
    method = rng.choices(["ar", "top-r", "draftexpert"], weights=[1, 2, 3])[0]
    presets = sorted(p.name for p in (folder / "draft_experts").glob("*.safetensors"))
    c = dict(
        index=index,
        model=model,
        engine=engine,
        platform=platform,
        method=method,
        expert_type=rng.choice(EXPERT_TYPES[engine]) if (engine == "llama.cpp" or platform == "mn") else "q4_0",
        max_new_tokens=rng.randint(1, 40),
    )
    if method == "top-r":
        c["r"] = rng.randint(1, top_k - 1)
    if method == "draftexpert":
        c["draft_experts"] = rng.choice([None, "zero", *presets])
    if method != "ar":
        c.update(
            k_max=rng.randint(1, 8),
            tau=rng.choice([0.0, 1.0, round(rng.random(), 3)]),
            budget=rng.choice([0, 1, 6, 24, 48, 1000]),
            budget_mode=rng.choice(["fixed", "cache"]),
            truncate=rng.random() < 0.7,
            prefetch=rng.random() < 0.7,
        )
        if engine == "torch":
            c["draft_cache"] = rng.choice(["shared", "own"])
    if engine == "torch" and platform != "resident":
        c["cache_experts"] = rng.choice([0, 0, 6, 64])
    if engine == "llama.cpp" and platform == "mn":
        c["staging"] = rng.choice(["demand", "pagefault"])
    if rng.random() < 0.1:
        c["random_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
    else:
        suite = rng.choice(list(prompts.SUITES))
        c["prompt_id"] = rng.choice(prompts.load(suite))["id"]
    if engine == "torch" and rng.random() < 0.3:
        c.update(temperature=round(rng.uniform(0.3, 1.5), 2), seed=rng.randrange(1 << 16))
    if engine == "torch" and platform in ("mn", "resident") and rng.random() < 0.3:
        c["head_type"] = "q4_0"  # MLPs and LM head on ggml's Q4_0 kernels (a CPU only)
    if method != "ar" and rng.random() < 0.25:  # drawn after the head type: every earlier draw stays
        c.update(method="pld", pld_tokens=rng.randint(1, 12), pld_max_ngram=rng.randint(1, 4))
    if c["method"] in ("top-r", "draftexpert") and rng.random() < 0.3:  # drawn last: earlier draws stay
        c["controller"] = "cost"
    return Case(**c)


def replay_command(case: Case, seed: int) -> str:
    return f"bench fuzz --engine {case.engine} --seed {seed} --case {case.index}"


class Campaign:
    """Builds decoders (through the CLI's factory) and caches plain decoding's tokens."""

    def __init__(self, expert_file: Callable[[str, Path, str], Path]):
        self.expert_file = expert_file
        self._plain: dict[tuple, list[int]] = {}
        self._prompts = {p["id"]: p["prompt"] for s in prompts.SUITES for p in prompts.load(s)}

    def _decoder(
        self,
        case: Case,
        method: str,
        platform: str,
        cache_experts: int,
        spec: SpecOptions | None = None,
        resident_from_file: bool = False,
    ):
        folder = registry.resolve(case.model)
        cell = Cell(
            model=case.model,
            method=method,
            platform=platform,
            engine=case.engine,
            expert_type=case.expert_type,
            max_new_tokens=case.max_new_tokens,
            temperature=case.temperature,
            seed=case.seed,
            cache_experts=cache_experts,
            staging=case.staging if case.engine == "llama.cpp" else "demand",
            resident_from_file=resident_from_file,
            device=available_device(platform) if case.engine == "torch" else None,
            head_type=case.head_type,
            spec=spec or SpecOptions(),
        )
        return make_decoder(cell, folder, lambda qt: self.expert_file(case.model, folder, qt))

    def prompt_ids(self, case: Case, tokenizer) -> list[int]:
        return list(case.random_ids) if case.random_ids else render_prompt(tokenizer, self._prompts[case.prompt_id])

    def plain(self, case: Case, ids: list[int]) -> list[int]:
        """AR with every expert resident, on the weights the case's decoder computes with."""
        from_file = case.engine == "llama.cpp" or case.platform == "mn"
        key = (
            case.model,
            case.engine,
            case.expert_type if from_file else "checkpoint",
            case.head_type,
            tuple(ids),
            case.max_new_tokens,
            case.temperature,
            case.seed,
        )
        if key not in self._plain:
            dec, tok, _ = self._decoder(case, "ar", "resident", 0, resident_from_file=from_file)
            try:
                self._plain[key] = dec.generate(ids, case.max_new_tokens, tok.eos_token_id).tokens
            finally:
                dec.close()
        return self._plain[key]

    def check(self, case: Case) -> dict:
        """{"ok", "tokens", "plain", "why"} for one case."""
        spec = SpecOptions(
            r=case.r,
            draft_experts=self._draft_file(case),
            pld_tokens=case.pld_tokens,
            pld_max_ngram=case.pld_max_ngram,
            round=SpecConfig(
                k_max=case.k_max,
                tau=case.tau,
                budget=case.budget,
                budget_mode=case.budget_mode,
                truncate=case.truncate,
                prefetch=case.prefetch,
                draft_cache=case.draft_cache,
                controller=case.controller,
            ),
        )
        dec, tok, _ = self._decoder(case, case.method, case.platform, case.cache_experts, spec)
        try:
            ids = self.prompt_ids(case, tok)
            out = dec.generate(ids, case.max_new_tokens, tok.eos_token_id).tokens
            again = (
                dec.generate(ids, case.max_new_tokens, tok.eos_token_id).tokens
                if case.temperature > 0 and case.method != "ar"
                else out
            )
        finally:
            dec.close()
        plain = self.plain(case, ids)
        if case.temperature <= 0 or case.method == "ar":
            ok, why = out == plain, "tokens differ from plain decoding"
        else:
            ok = out == again and out[:1] == plain[:1]
            why = "not reproducible at its seed" if out != again else "first token differs from plain AR's"
        return {"ok": ok, "tokens": out, "plain": plain, "why": None if ok else why}

    def _draft_file(self, case: Case) -> Path | None:
        if case.method != "draftexpert" or case.draft_experts is None:
            return None
        if case.draft_experts == "zero":
            return ZERO
        return registry.resolve(case.model) / "draft_experts" / case.draft_experts


ZERO = Path("zero")  # the zero draft expert: shared + top-1 (resolved by `bench.cells.artifacts`)


def run(engine: str, cases: int, seed: int, only: int | None, expert_file, log, out: Path | None = None) -> dict:
    """Run cases 0 … cases-1 (or just `only`); a JSONL line per case to `out` when given."""
    camp = Campaign(expert_file)
    indices = [only] if only is not None else range(cases)
    mismatches, t0, n = [], time.perf_counter(), 0
    sink = open(out, "a") if out else None
    try:
        for i in indices:
            case = draw(engine, seed, i)
            res = camp.check(case)
            n += 1
            if sink:
                sink.write(json.dumps({"case": asdict(case), **res}) + "\n")
                sink.flush()
            if not res["ok"]:
                mismatches.append({"case": asdict(case), "why": res["why"], "replay": replay_command(case, seed)})
                log(f"MISMATCH case {i}: {res['why']} — replay: {replay_command(case, seed)}")
            if only is not None:
                log(json.dumps({"case": asdict(case), **res}))
            if only is not None or n % 50 == 0:
                log(f"{n} cases, {len(mismatches)} mismatches, {time.perf_counter() - t0:.0f} s")
    finally:
        if sink:
            sink.close()
    return {
        "engine": engine,
        "seed": seed,
        "cases": n,
        "mismatches": len(mismatches),
        "failures": mismatches,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
