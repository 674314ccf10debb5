"""Exact self-speculative decoding on the expert-offload runtime (Algorithm 1).

One round, phases named as the paper names them:
  draft     the drafter (a `DraftPath` of the same weights) proposes v_1 … v_K, K ≤ K_max, one
            token per forward; each forward also yields the confidence q_i of v_i and, for the
            token it consumes, the draft router's top-k experts at every MoE layer — the
            predicted verifier experts of that position.
  truncate  the controller (Eq. 12–14) stops before appending v_i when q_i < τ and the marginal
            expansion Δ_i = |Û_i| − |Û_{i−1}| exceeds the budget B_i.
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
- The drafter's KV cache (`draft_cache`): `"shared"` (default) — the drafter attends to the
  target's own cache for committed tokens and writes its draft positions past them; verification
  crops those and rewrites them with the target's K/V. No draft prefill, no second cache, and the
  draft conditions on the exact target context. `"own"` — a separate cache filled by the draft
  path, prompt prefill included (its loads are counted in phase `prefill-draft`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftexpert.decoding import DecodeOutput
from draftexpert.drafters import DraftPath
from draftexpert.model import KVCache, MoEModel


@dataclass(frozen=True)
class SpecConfig:
    k_max: int = 4
    tau: float = 0.6  # confidence threshold τ
    budget: int = 24  # B: layer-experts a token may add to the verify set when unconfident
    budget_mode: str = "fixed"  # fixed | cache
    truncate: bool = True  # False: the fixed-K ablation
    prefetch: bool = True
    draft_cache: str = "shared"  # shared | own
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be ≥ 1, got {self.k_max}")
        if self.budget_mode not in ("fixed", "cache"):
            raise ValueError(f"budget_mode must be 'fixed' or 'cache', got {self.budget_mode!r}")
        if self.draft_cache not in ("shared", "own"):
            raise ValueError(f"draft_cache must be 'shared' or 'own', got {self.draft_cache!r}")


@dataclass
class Draft:
    """One round's kept proposals: tokens v_1 … v_K, the draft distributions q_j [V] (sampling
    only), the predicted verifier set Û_K, and the layer-experts the drafter ran."""

    tokens: list[int]
    q: list[torch.Tensor]
    predicted: set[tuple[int, int]]
    touched: set[tuple[int, int]]
    truncated: bool
    touched_at: list[int] = field(default_factory=list)  # |touched| when v_j was proposed (Fig. 3)


def layer_experts(routing: dict[int, torch.Tensor], rows: slice = slice(None)) -> set[tuple[int, int]]:
    """{(layer, expert)} over the given token rows of a routing tap (layer → [T, k])."""
    return {(layer, e) for layer, idx in routing.items() for e in idx[rows].unique().tolist()}


def greedy_accept(draft_tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """(emitted, accepted): the longest prefix with v_j = argmax p_j, plus the target's own next
    token (`target_argmax` has one entry per verify position, K + 1)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return draft_tokens[:n] + [target_argmax[n]], n


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


class SpeculativeDecoder:
    """`Decoder` contract: exact self-speculative decoding of `model` with `path` as drafter."""

    def __init__(self, model: MoEModel, path: DraftPath, config: SpecConfig = SpecConfig(), max_len: int = 2048,
                 trace: list | None = None):
        self.model, self.path, self.cfg, self.max_len = model, path, config, max_len
        self.name = path.name
        self.trace = trace  # when a list: one dict per round (sets and tokens) for audits and tests

    def close(self) -> None:
        self.model.experts.close()

    # -- phases ---------------------------------------------------------------------------
    def draft(self, committed: list[int], cache: KVCache, k_limit: int, gen) -> Draft:
        """Propose up to k_limit tokens on the draft path (draft → truncate → prefetch)."""
        cfg, store = self.cfg, self.model.experts
        look_ahead = cfg.truncate or cfg.prefetch  # they need Ê of every kept token, the last one included
        out = Draft([], [], set(), set(), False)
        logits = self._forward(torch.tensor(committed[cache.length:]), cache, out)  # consumes x_0 (and any pending)
        self._keep_experts(out, self._predicted(), store)  # x_0 is verified whatever is drafted: never truncated
        for i in range(1, k_limit + 1):
            q = probs(logits, cfg.temperature)
            v = int(torch.multinomial(q, 1, generator=gen)) if cfg.temperature > 0 else int(q.argmax())
            touched_now = len(out.touched)  # the drafter's footprint for proposing v_1 … v_i
            if i < k_limit or look_ahead:
                logits = self._forward(torch.tensor([v]), cache, out)  # consumes v_i: its verify experts Ê_i
                predicted = self._predicted()
                new = predicted - out.predicted
                if cfg.budget_mode == "cache":
                    new -= store.resident_keys()
                if cfg.truncate and float(q[v]) < cfg.tau and len(new) > cfg.budget:  # Eq. 14
                    out.truncated = True
                    break
                self._keep_experts(out, predicted, store)
            out.tokens.append(v)
            out.q.append(q)
            out.touched_at.append(touched_now)
        return out

    def _forward(self, ids: torch.Tensor, cache: KVCache, out: Draft) -> torch.Tensor:
        logits = self.model.forward(ids, cache, phase="draft", path=self.path)[-1]
        out.touched |= {(layer, e) for layer, es in self.model.last_fetched.items() for e in es}
        return logits

    def _predicted(self) -> set[tuple[int, int]]:
        """Ê_{·,i}: the draft router's top-k at every MoE layer for the token just consumed."""
        return layer_experts(self.model.last_routing, slice(-1, None))

    def _keep_experts(self, out: Draft, predicted: set, store) -> None:
        """Û_i = Û_{i−1} ∪ Ê_i (Eq. 12); prefetch what is neither on the accelerator nor in flight."""
        new = predicted - out.predicted
        out.predicted |= predicted
        if self.cfg.prefetch:
            for layer in sorted({layer for layer, _ in new}):
                store.prefetch(layer, sorted(e for l2, e in new if l2 == layer))

    def verify(self, committed: list[int], cache: KVCache, draft: list[int]) -> torch.Tensor:
        """Target logits [K+1, V] at [x_0, v_1 … v_K]; position j judges v_{j+1}."""
        cache.crop(len(committed) - 1)
        return self.model.forward(torch.tensor(committed[-1:] + draft), cache, phase="verify")

    def accept(self, draft: Draft, logits: torch.Tensor, gen) -> tuple[list[int], int]:
        """(emitted tokens, accepted draft tokens): the accepted prefix + one token of the target's."""
        T = self.cfg.temperature
        if T <= 0:
            return greedy_accept(draft.tokens, logits.argmax(-1).tolist())
        for j, v in enumerate(draft.tokens):
            p, q = probs(logits[j], T), draft.q[j]
            if torch.rand((), generator=gen) < torch.clamp(p[v] / q[v], max=1.0):
                continue
            residual = torch.clamp(p - q, min=0.0)
            return draft.tokens[:j] + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))], j
        return draft.tokens + [int(torch.multinomial(probs(logits[-1], T), 1, generator=gen))], len(draft.tokens)

    # -- the loop -------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        m, cfg, store = self.model, self.cfg, self.model.experts
        ledger = store.ledger
        ledger.reset()
        gen = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
        max_len = min(self.max_len, len(prompt_ids) + max_new_tokens + cfg.k_max + 1)
        cache = KVCache.for_model(m, max_len)
        t0 = time.perf_counter()
        logits = m.forward(torch.tensor(prompt_ids), cache, phase="prefill")[-1]
        first = int(torch.multinomial(probs(logits, cfg.temperature), 1, generator=gen)) if cfg.temperature > 0 \
            else int(logits.argmax())
        draft_cache = cache
        if cfg.draft_cache == "own":
            draft_cache = KVCache.for_model(m, max_len)
            m.forward(torch.tensor(prompt_ids), draft_cache, phase="prefill-draft", path=self.path)
        t1 = time.perf_counter()
        committed, tokens = list(prompt_ids) + [first], [first]
        stats = RoundStats(cfg.k_max)
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            k_limit = min(cfg.k_max, max_new_tokens - len(tokens) - 1)
            store.begin_block()
            draft = self.draft(committed, draft_cache, k_limit, gen) if k_limit > 0 else Draft([], [], set(), set(), False)
            resident = store.resident_keys() - store.prefetched  # moved by the drafter, or cached
            logits = self.verify(committed, cache, draft.tokens)
            needed = layer_experts(m.last_routing)
            prefetched = store.end_block()
            hits, waste = len(prefetched & needed), len(prefetched - needed)
            ledger.record_prefetch_outcome(hits, waste, len(needed - resident - prefetched))
            emitted, accepted = self.accept(draft, logits, gen)
            if eos_token_id in emitted:
                emitted = emitted[:emitted.index(eos_token_id) + 1]
            emitted = emitted[:max_new_tokens - len(tokens)]
            stats.add(draft, min(accepted, len(emitted)), verify_unique=len(needed))
            if self.trace is not None:
                self.trace.append({"start": len(committed) - 1, "block": committed[-1:] + draft.tokens,
                                   "emitted": emitted, "touched": draft.touched, "predicted": draft.predicted,
                                   "needed": needed, "prefetched": prefetched, "resident": resident})
            committed += emitted
            tokens += emitted
            cache.crop(len(committed) - 1)  # drop K/V of rejected positions (and of the last token)
            if draft_cache is not cache:
                draft_cache.crop(min(draft_cache.length, len(committed) - 1))
        t2 = time.perf_counter()
        return DecodeOutput(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1,
                            stats={**stats.summary(), "ledger": ledger.summary()})


class RoundStats:
    """Per-prompt speculation counters (vLLM spec_decode/metrics style: formula next to each).
      rounds            draft → verify rounds
      drafted           Σ K (kept draft tokens sent to verification)
      accepted          Σ accepted draft tokens
      acceptance α      = accepted / drafted
      mean accepted length τ = 1 + accepted / rounds   (tokens emitted per verify forward)
      per_position[j]   = accepted at draft position j / drafted at position j   (j = 1 … K_max)
      truncated         rounds the controller stopped before K_max
      draft_unique      Σ_rounds Σ_l |layer-experts the drafter ran in the round|   (Table 3 "Unique")
      verify_unique     Σ_rounds Σ_l |∪ target top-k over the verify block|      (Eq. 2, |U(B)|)
      predicted_unique  Σ_rounds |Û_K| (the controller's predicted verifier set)
      drafted_at[j]     rounds that drafted ≥ j tokens
      draft_unique_at[j] Σ_rounds layer-experts the drafter had run when it proposed v_j (cumulative;
                        mean = draft_unique_at[j] / drafted_at[j] — Fig. 3)"""

    def __init__(self, k_max: int):
        self.rounds = self.drafted = self.accepted = self.truncated = 0
        self.draft_unique = self.verify_unique = self.predicted_unique = 0
        self.drafted_at, self.accepted_at, self.draft_unique_at = [0] * k_max, [0] * k_max, [0] * k_max

    def add(self, draft: Draft, accepted: int, verify_unique: int) -> None:
        self.rounds += 1
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        self.truncated += draft.truncated
        self.draft_unique += len(draft.touched)
        self.verify_unique += verify_unique
        self.predicted_unique += len(draft.predicted)
        for j in range(len(draft.tokens)):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted
            self.draft_unique_at[j] += draft.touched_at[j]

    def summary(self) -> dict:
        r = max(self.rounds, 1)
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": 1 + self.accepted / r, "truncated": self.truncated,
                "per_position_acceptance": [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)],
                "drafted_at": self.drafted_at, "draft_unique_at": self.draft_unique_at,
                "draft_unique": self.draft_unique, "verify_unique": self.verify_unique,
                "predicted_unique": self.predicted_unique,
                "draft_unique_per_round": self.draft_unique / r, "verify_unique_per_round": self.verify_unique / r}
