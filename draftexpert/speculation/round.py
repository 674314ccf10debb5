"""Exact self-speculative decoding (Algorithm 1), written once over the `Engine` protocol
(`draftexpert.decoding`): the torch runtime and llama.cpp run this same round.

One round, phases named as the paper names them:
  draft     the drafter (a `DraftPath` of the same weights) proposes v_1 … v_K, K ≤ K_max, one
            token per forward; each forward also yields the confidence q_i of v_i and, for the
            token it consumes, the draft router's top-k experts at every MoE layer — the
            predicted verifier experts of that position. Prompt lookup (`lookup.Lookup`) drafts
            with no forward at all: q_j a point mass on v_j, nothing predicted or prefetched.
  truncate  the controller (`controller`, Eq. 12–14) stops before appending v_i when q_i < τ and
            the marginal expansion Δ_i = |Û_i| − |Û_{i−1}| exceeds the budget B_i.
  prefetch  as v_i is kept, non-blocking loads of Ê_{·,i} not cached, not in flight, not moved yet.
  verify    one multi-token forward of the frozen target over [x_0, v_1 … v_K] (x_0 = the last
            committed token); it waits only for the transfers it uses, loads misses on demand.
  accept    greedy: the longest prefix with v_j = argmax p_j, plus the target's own next token.
            Sampling (T > 0): accept v_j with probability min(1, p_j(v_j) / q_j(v_j)); on the first
            rejection emit a draw from norm(max(0, p_j − q_j)); if all K pass, a draw from p_{K+1}.
            Either way the emitted tokens are distributed as the target's (Leviathan et al. 2023).
  commit    append the emitted tokens, crop the KV cache(s) back to the committed length.

Definitions (stated once; the controller, prefetch and ledger all use them):
- q_i = softmax(z^d_i / T)(v_i), the draft's probability of its own proposal: at greedy
  (T = 1 for the confidence) the draft's max probability.
- Ê_{l,i} = the draft router's top-k at layer l when the drafter consumes v_i: keeping v_i adds
  exactly one position (v_i's) to the verify block, and these are the experts that position is
  predicted to need. Û_0 = Ê_{·,0} (x_0's experts: verified even when nothing is drafted, so
  never charged to a draft token); Û_i = Û_{i−1} ∪ ⋃_l Ê_{l,i} (Eq. 12). So the controller and
  prefetch see every verify position, v_K's included, the drafter consumes the last kept token
  too — one draft forward more than K when truncation or prefetch is on (plain fixed-K top-r
  drafting, with neither, runs K forwards).
- B_i: `budget_mode="fixed"` — B_i = B; `"cache"` — Δ_i counts only experts that are not already
  on the accelerator (cached or moved earlier in the round), i.e. B_i = B + |new ∩ resident|.
- The drafter's KV cache (`draft_cache`, the torch engine): `"shared"` (default) — the drafter
  attends to the target's own cache for committed tokens and writes its draft positions past
  them; verification crops those and rewrites them with the target's K/V. No draft prefill, no
  second cache, and the draft conditions on the exact target context. `"own"` — a separate cache
  filled by the draft path, prompt prefill included (its loads are counted in phase
  `prefill-draft`). llama.cpp's drafter is a second context: always its own cache.
- Accounting, the same on every engine: `prefetched` = the keys the round's prefetches were
  issued for; `resident` = what was on the accelerator when verification started, less those;
  hits = prefetched ∩ needed, waste = prefetched − needed, misses = needed − resident − prefetched
  (loaded on demand by the verify pass), needed = the experts the verify pass routed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftexpert.decoding import DecodeOutput, Engine, Key, check_context, check_finite, probs, sample
from draftexpert.metrics import RoundStats
from draftexpert.speculation.config import SpecConfig
from draftexpert.speculation.controller import CostController, DrafterChoice, expansion, stop
from draftexpert.speculation.lookup import Lookup


@dataclass
class Draft:
    """One round's kept proposals: tokens v_1 … v_K, the draft distributions q_j [V] (sampling
    only), the predicted verifier set Û_K, the layer-experts the drafter ran, and those its
    prefetches were issued for."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    predicted: set[Key] = field(default_factory=set)
    touched: set[Key] = field(default_factory=set)
    truncated: bool = False
    touched_at: list[int] = field(default_factory=list)  # |touched| when v_j was proposed (Fig. 3)
    prefetched: set[Key] = field(default_factory=set)
    new_at: list[int] = field(default_factory=list)  # the cost controller: new layer-experts each kept v_j added
    x0_new: int | None = None  # the cost controller: new layer-experts after x_0's forward (None: a catch-up ran)
    footprint: set[Key] = field(default_factory=set)  # the cost controller: touched before v_i's forward


def greedy_accept(draft_tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """(emitted, accepted): the longest prefix with v_j = argmax p_j, plus the target's own next
    token (`target_argmax` has one entry per verify position, K + 1)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return draft_tokens[:n] + [target_argmax[n]], n


def sampled_accept(draft: Draft, logits: torch.Tensor, temperature: float, gen) -> tuple[list[int], int]:
    """Accept v_j with probability min(1, p_j(v_j) / q_j(v_j)); on the first rejection emit a draw
    from norm(max(0, p_j − q_j)); if all K pass, a draw from p_{K+1} (Leviathan et al. 2023)."""
    for j, v in enumerate(draft.tokens):
        p, q = probs(logits[j], temperature), draft.q[j]
        if torch.rand((), generator=gen) < torch.clamp(p[v] / q[v], max=1.0):
            continue
        residual = torch.clamp(p - q, min=0.0)
        return draft.tokens[:j] + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))], j
    return draft.tokens + [sample(logits[-1], temperature, gen)], len(draft.tokens)


class SpeculativeDecoder:
    """`Decoder` contract: exact self-speculative decoding on `engine` (its drafter proposes)."""

    def __init__(
        self,
        engine: Engine,
        config: SpecConfig = SpecConfig(),
        trace: list | None = None,
        lookup: Lookup | None = None,
        drafters: list[str] | None = None,
        prefetching: set[str] | None = None,
    ):
        """`drafters`: `--method auto` — the engine's drafters (`engine.select_drafter`) a round chooses
        among by price, AR included (`controller.DrafterChoice`; the cost controller's stop rule);
        `prefetching`: those of them whose rounds prefetch (with `config.prefetch`; default all)."""
        self.engine, self.cfg, self.lookup = engine, config, lookup  # lookup: prompt lookup drafts, no forward
        self._vocab = 0
        self.name = engine.name
        self.trace = trace  # when a list: one dict per round (sets and tokens) for audits and tests
        # the cost controller learns this engine's prices across prompts (`--controller cost`)
        self.choice = DrafterChoice(drafters, config.k_max) if drafters else None
        self._prefetch = config.prefetch  # the round's prefetch: config's, or the chosen drafter's under auto
        self.prefetching = set(drafters or ()) if prefetching is None else set(prefetching)
        if self.choice is not None:
            self.ctl = next(iter(self.choice.arms.values()))
        else:
            self.ctl = CostController(config.k_max) if config.controller == "cost" else None

    def warm_start(self, priors: dict[str, tuple[list[int], list[int]]], rounds: int = 32) -> None:
        """Start the cost controller's acceptance from a calibration's counts (`Acceptance.warm`):
        per drafter under `--method auto`, the one drafter's (any key) under `--controller cost`."""
        if self.choice is not None:
            for name, arm in self.choice.arms.items():
                if name in priors:
                    arm.acc.warm(*priors[name], rounds)
        elif self.ctl is not None and priors:
            self.ctl.acc.warm(*next(iter(priors.values())), rounds)

    def choose_round(self, chosen: dict[str, int], committed: int, remaining: int) -> bool:
        """Whether this round drafts: the cost controller's call (`--controller cost`), or under
        `--method auto` which drafter drafts it (selected on the engine; counted in `chosen`).
        `committed` tokens so far and `remaining` to emit: each drafter's lag behind them is priced."""
        if self.choice is None:
            if self.ctl is None:
                return True
            lag = committed - 1 - self.engine.draft_length if self.lookup is None else 0
            return self.ctl.draft_this_round(lag=lag, remaining=remaining)
        lags = {n: committed - 1 - length for n, length in self.engine.draft_lengths().items()}
        arm = self.choice.choose(lags, remaining)
        chosen[arm or "ar"] = chosen.get(arm or "ar", 0) + 1
        if arm is None:
            return False
        self.engine.select_drafter(arm)
        self.ctl = self.choice.arms[arm]
        self._prefetch = self.cfg.prefetch and arm in self.prefetching
        return True

    def close(self) -> None:
        self.engine.close()

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def positions(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return prompt_tokens + max_new_tokens + self.cfg.positions

    # -- phases ---------------------------------------------------------------------------
    def draft(self, committed: list[int], k_limit: int, gen) -> Draft:
        """Propose up to k_limit tokens on the draft path (draft → truncate → prefetch)."""
        if self.lookup is not None:
            return self.lookup_draft(committed, k_limit)
        cfg, eng, ctl = self.cfg, self.engine, self.ctl
        # Ê of every kept token, the last one included: truncation, prefetch and the cost controller read it
        prefetch = self._prefetch
        look_ahead = cfg.truncate or prefetch or ctl is not None
        out = Draft()
        resident = eng.resident() if ctl is not None else set()  # the cost controller: what the round need not load
        pending = committed[eng.draft_length :]  # x_0, after the tokens committed while this drafter sat out
        logits = self._draft_forward(pending, out)
        out.footprint = set(out.touched)
        catch_up = len(pending) > 1  # its experts are those tokens' too: not x_0's footprint
        self._keep(out, eng.predicted())  # x_0 is verified whatever is drafted: never truncated
        for i in range(1, k_limit + 1):
            q = probs(logits, cfg.temperature)
            v = int(torch.multinomial(q, 1, generator=gen)) if cfg.temperature > 0 else int(q.argmax())
            touched_now = len(out.touched)  # the drafter's footprint for proposing v_1 … v_i
            if i < k_limit or look_ahead:
                logits = self._draft_forward([v], out)  # consumes v_i: its verify experts Ê_i
                predicted = eng.predicted()
                if ctl is not None:  # priced: the round's new layer-experts (run or predicted) without and with v_i
                    # what the round loads: the drafter's experts, and the predicted ones where prefetched
                    ahead = out.predicted if prefetch else set()
                    kept = len((out.footprint | ahead) - resident)
                    if i == 1 and not catch_up:
                        out.x0_new = kept
                    grown = len((out.touched | ahead | (predicted if prefetch else set())) - resident)
                    out.footprint = set(out.touched)
                    if not ctl.keep(i, kept, grown, look_ahead):
                        out.truncated = True
                        break
                    out.new_at.append(grown - kept)
                elif cfg.truncate:
                    delta = expansion(predicted, out.predicted, eng.resident() if cfg.budget_mode == "cache" else None)
                    if stop(float(q[v]), delta, cfg.tau, cfg.budget):  # Eq. 14
                        out.truncated = True
                        break
                self._keep(out, predicted)
            out.tokens.append(v)
            out.q.append(q)
            out.touched_at.append(touched_now)
        return out

    def lookup_draft(self, committed: list[int], k_limit: int) -> Draft:
        """Prompt lookup's proposal: no forward, no expert touched or predicted; q_j a point mass on
        v_j, so sampled acceptance keeps v_j with probability p_j(v_j) (Leviathan et al. 2023)."""
        tokens = self.lookup.propose(committed, k_limit)
        q = []
        if self.cfg.temperature > 0:
            for v in tokens:
                q.append(torch.zeros(self._vocab))
                q[-1][v] = 1.0
        return Draft(tokens=tokens, q=q, touched_at=[0] * len(tokens))

    def _draft_forward(self, ids: list[int], out: Draft) -> torch.Tensor:
        logits = self.engine.draft_forward(ids)
        out.touched |= self.engine.draft_ran()
        return logits

    def _keep(self, out: Draft, predicted: set[Key]) -> None:
        """Û_i = Û_{i−1} ∪ Ê_i (Eq. 12); prefetch what is new to Û."""
        new = predicted - out.predicted
        out.predicted |= predicted
        if self._prefetch and new:
            out.prefetched |= self.engine.prefetch(new)

    def _price(self, forwards, draft: Draft, accepted: int, prefetched_new: int) -> None:
        """The cost controller's observations of one round, from the ledger's forwards of it: the
        draft forwards' wall time, the verify pass's compute, the round's loads and their stall."""
        ctl, c = self.ctl, self.ctl.costs
        nan0 = lambda x: 0.0 if x != x else x  # noqa: E731 - a stall not observable (llama.cpp's page faults)
        drafts = [f for f in forwards if f.phase == "draft"]
        if drafts:  # the first consumed x_0 and any lag before it (before draft_s moves with this round)
            ctl.observe_catch_up(drafts[0].tokens, drafts[0].wall_s)
        c.observe_draft([(f.tokens, f.wall_s - nan0(f.stall_s)) for f in drafts])
        for f in forwards:
            if f.phase == "verify":
                c.observe_verify(f.tokens, f.wall_s - nan0(f.stall_s), f.loads)
        loads = sum(f.loads for f in forwards) + prefetched_new
        c.observe_loads(loads, sum(f.stall_s for f in forwards))
        ctl.observe(len(draft.tokens), accepted, draft.new_at, draft.x0_new, loads)

    def verify(self, committed: list[int], draft: list[int]) -> torch.Tensor:
        """Target logits [K+1, V] at [x_0, v_1 … v_K]; position j judges v_{j+1}."""
        return self.engine.verify(len(committed) - 1, committed[-1:] + draft)

    def accept(self, draft: Draft, logits: torch.Tensor, gen) -> tuple[list[int], int]:
        """(emitted tokens, accepted draft tokens): the accepted prefix + one token of the target's.
        Either way the emitted tokens are distributed as the target's."""
        check_finite(logits)
        if self.cfg.temperature <= 0:
            return greedy_accept(draft.tokens, logits.argmax(-1).tolist())
        return sampled_accept(draft, logits, self.cfg.temperature, gen)

    # -- the loop -------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        cfg, eng = self.cfg, self.engine
        gen = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
        need = self.positions(len(prompt_ids), max_new_tokens)
        check_context(need, self.context_length, len(prompt_ids), max_new_tokens)
        eng.start(need)
        t0 = time.perf_counter()
        logits = eng.prefill(prompt_ids)
        self._vocab = logits.shape[-1]
        first = sample(logits, cfg.temperature, gen)
        if self.lookup is None:
            eng.prefill_draft(prompt_ids)
        t1 = time.perf_counter()
        committed, tokens = list(prompt_ids) + [first], [first]
        stats = RoundStats(cfg.k_max)
        emitted_per_round: list[int] = []  # Spec-Bench's accept_lengths: tokens each round emitted
        prefetch_peak = 0  # the most bytes one round prefetched: the prefetch buffer it needs
        cost_ar_rounds = 0  # rounds the cost controller made AR steps
        chosen: dict[str, int] = {}  # --method auto: rounds by drafter ("ar": AR steps)
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            k_limit = min(cfg.k_max, max_new_tokens - len(tokens) - 1)
            if k_limit > 0 and not self.choose_round(chosen, len(committed), max_new_tokens - len(tokens)):
                k_limit, cost_ar_rounds = 0, cost_ar_rounds + 1  # priced: an AR step pays more here
            eng.begin_round()
            prefetched_before = eng.ledger.prefetch["bytes"]
            first_forward = len(eng.ledger.forwards)
            draft = self.draft(committed, k_limit, gen) if k_limit > 0 else Draft()
            prefetch_peak = max(prefetch_peak, eng.ledger.prefetch["bytes"] - prefetched_before)
            resident = eng.resident() - draft.prefetched  # moved by the drafter, or cached
            logits = self.verify(committed, draft.tokens)
            needed = eng.routed()
            eng.end_round()
            pf = draft.prefetched
            eng.ledger.record_prefetch_outcome(len(pf & needed), len(pf - needed), len(needed - resident - pf))
            emitted, accepted = self.accept(draft, logits, gen)
            if eos_token_id in emitted:
                emitted = emitted[: emitted.index(eos_token_id) + 1]
            emitted = emitted[: max_new_tokens - len(tokens)]
            stats.add(draft, min(accepted, len(emitted)), verify_unique=len(needed))
            if self.ctl is not None:
                self._price(eng.ledger.forwards[first_forward:], draft, accepted, len(pf - resident))
            emitted_per_round.append(len(emitted))
            if self.trace is not None:
                self.trace.append(
                    {
                        "start": len(committed) - 1,
                        "block": committed[-1:] + draft.tokens,
                        "emitted": emitted,
                        "touched": draft.touched,
                        "predicted": draft.predicted,
                        "needed": needed,
                        "prefetched": pf,
                        "resident": resident,
                    }
                )
            committed += emitted
            tokens += emitted
            eng.commit(len(committed) - 1)  # drop K/V of rejected positions (and of the last token)
        t2 = time.perf_counter()
        return DecodeOutput(
            tokens=tokens,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            stats={
                **stats.counters(),
                "accept_lengths": emitted_per_round,
                "prefetch_peak_bytes": prefetch_peak,
                **({"cost_ar_rounds": cost_ar_rounds} if self.ctl is not None else {}),
                **({"auto_rounds": chosen} if self.choice is not None else {}),
                **eng.stats(),
            },
        )
