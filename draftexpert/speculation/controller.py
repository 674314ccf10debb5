"""The confidence–expansion controller (Eq. 12–14): whether the drafter may keep proposing.

Û_i = Û_{i−1} ∪ Ê_{·,i} is the predicted verifier set once v_i is kept (Eq. 12); the marginal
expansion of v_i is Δ_i = |Ê_{·,i} \\ Û_{i−1}| (Eq. 13) — with `budget_mode="cache"` only the new
experts that are not already on the accelerator count (B_i = B + |new ∩ resident|). The round
stops before appending v_i when the draft is unconfident about it *and* it would widen the
verify pass by more than the budget (Eq. 14):

    stop  ⇔  q_i < τ  ∧  Δ_i > B_i
"""

from __future__ import annotations

import math

Key = tuple[int, int]  # (layer, expert)
# The cost model's revision, in the key of every priced cell (`--controller cost`, `--method auto`): a
# change to what the prices are or how a round is chosen re-measures rather than resuming older records.
# 2: catch-ups priced and kept out of x_0's footprint; exploration per drafter; acceptance discounted.
PRICING = 2


def expansion(predicted: set[Key], kept: set[Key], resident: set[Key] | None = None) -> int:
    """Δ_i: the layer-experts v_i's position adds to Û_{i−1} (`kept`), less those on the
    accelerator when `resident` is given (budget mode "cache")."""
    new = predicted - kept
    return len(new - resident) if resident is not None else len(new)


def stop(confidence: float, delta: int, tau: float, budget: int) -> bool:
    """Eq. 14: stop before v_i when q_i < τ and Δ_i > B."""
    return confidence < tau and delta > budget


# -- the cost controller: price each round from measured costs -----------------------------------


class Ema:
    """An exponential moving average that starts at its first observation (or `prior`)."""

    def __init__(self, prior: float | None = None, weight: float = 0.1):
        self.value, self.weight = prior, weight

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


class CostModel:
    """What a round costs on this engine and storage, in seconds, from what the ledger measured:

        round(k) = draft_s · forwards(k) + verify_s + position_s · k + load_s · loads(k)

    a draft forward's compute (`draft_s`); a verify pass's compute for its first position (`verify_s`)
    and each further one (`position_s`); one layer-expert loaded in the round (`load_s`: by the drafter,
    prefetched or on demand by the verify pass alike — the storage moves each byte once either way; no
    overlap with compute is credited, so the estimate errs towards stopping). loads(k) is the
    controller's (`CostController.loads`: the drafter's footprint scaled to what rounds measured)."""

    def __init__(self, shared: CostModel | None = None):
        """`shared`: another drafter's model on the same engine — the verify pass's prices are the
        engine's (one estimate for both); a draft forward's cost is each drafter's."""
        self.draft_s = Ema()
        if shared is not None:
            self.verify_s, self.position_s, self.load_s, self.ar_loads = (
                shared.verify_s,
                shared.position_s,
                shared.load_s,
                shared.ar_loads,
            )
        else:
            self.verify_s, self.position_s, self.load_s = Ema(), Ema(0.0), Ema()
            self.ar_loads = Ema()  # new layer-experts a one-position round needs (x_0's, unpredicted)

    @property
    def ready(self) -> bool:
        return None not in (self.draft_s.value, self.verify_s.value, self.load_s.value, self.ar_loads.value)

    def round_s(self, forwards: int, positions: int, loads: float) -> float:
        return (
            self.draft_s.value * forwards
            + self.verify_s.value
            + self.position_s.value * (positions - 1)
            + self.load_s.value * loads
        )

    def ar_round_s(self) -> float:
        return self.verify_s.value + self.load_s.value * self.ar_loads.value

    def observe_verify(self, positions: int, compute_s: float, loads: int) -> None:
        """A verify pass: its compute (wall less stall) and, for a one-position pass, its loads."""
        if positions == 1:
            self.verify_s.add(compute_s)
            self.ar_loads.add(loads)
        elif self.verify_s.value is not None:
            self.position_s.add(max(0.0, (compute_s - self.verify_s.value) / (positions - 1)))
        else:
            self.verify_s.add(compute_s / positions)

    def observe_draft(self, forwards: list[tuple[int, float]]) -> None:
        """A round's draft forwards, (tokens, compute: wall less their own loads' stall) each. A draft
        forward in a round runs one token; the first of a round may run more — the tokens committed
        while this drafter sat out (AR steps, another drafter's rounds) — and is not what the next
        round's forwards cost: a round's one-token forwards price it where it has any."""
        steady = [s for t, s in forwards if t == 1] or [s for _, s in forwards]
        if steady:
            self.draft_s.add(sum(steady) / len(steady))

    def observe_loads(self, loads: int, stall_s: float) -> None:
        """A round's layer-experts loaded (on demand by any forward, or prefetched) and the seconds its
        forwards stalled on them: one price per load, whoever loaded it."""
        if loads and stall_s == stall_s:  # NaN: a stall not observable (llama.cpp's page faults)
            self.load_s.add(stall_s / loads)


class Acceptance:
    """Per-position acceptance, a_j = P(v_j accepted | v_1 … v_{j−1} accepted), counted over the
    rounds seen (0.5 before any round), older rounds weighing less: each round multiplies the counts
    so far by `decay` (a discounted bandit's estimate — a drafter's acceptance moves with the prompt:
    top-3 at K = 8 accepts 0.34 on one prompt of ds-tiny's regime sweep and 1.0 on the next)."""

    def __init__(self, k_max: int, strength: float = 2.0, decay: float = 0.95):
        self.trials, self.accepted = [0] * k_max, [0] * k_max
        self.strength = strength  # pseudo-trials each position borrows from the one before it
        self.decay = decay  # 1: every round seen counts the same; 0.95: a window of ~20 rounds

    def warm(self, drafted_at: list[int], accepted_at: list[int], rounds: int) -> None:
        """Start from another run's counts (`metrics.RoundStats`: rounds that drafted ≥ j+1 / accepted
        position j+1), scaled to weigh at most `rounds` rounds. v_j was judged in the rounds that
        drafted it and accepted every earlier one: min(drafted_at[j], accepted_at[j−1]) — exact for a
        fixed K, an upper estimate where truncation cut rounds."""
        scale = min(1.0, rounds / drafted_at[0]) if drafted_at and drafted_at[0] else 0.0
        for j in range(min(len(self.trials), len(drafted_at))):
            judged = drafted_at[j] if j == 0 else min(drafted_at[j], accepted_at[j - 1])
            self.trials[j] += judged * scale
            self.accepted[j] += min(accepted_at[j], judged) * scale

    def add(self, drafted: int, accepted: int) -> None:
        if drafted and self.decay < 1:
            self.trials = [t * self.decay for t in self.trials]
            self.accepted = [a * self.decay for a in self.accepted]
        for j in range(min(drafted, accepted + 1)):  # v_j was judged iff every earlier one passed
            self.trials[j] += 1
            self.accepted[j] += j < accepted

    def at(self, j: int, optimism: float = 0.0) -> float:
        """a_{j+1} (0-based j): the counts shrunk towards a_j (a_1 towards ½), so a position judged
        rarely — deep in the block — starts at the estimate of the one before, not at a flat prior;
        `optimism` z: the estimate plus z standard errors (an upper confidence bound, capped at 1)."""
        prior, m = 0.5, self.strength
        for i in range(j + 1):
            prior = (self.accepted[i] + m * prior) / (self.trials[i] + m)
        if optimism:
            prior = min(1.0, prior + optimism * math.sqrt(prior * (1 - prior) / (self.trials[j] + m + 1)))
        return prior

    def expected_tokens(self, k: int, optimism: float = 0.0) -> float:
        """Tokens a round with k drafts emits on average: the accepted prefix and the target's own."""
        e, p = 1.0, 1.0
        for j in range(k):
            p *= self.at(j, optimism)
            e += p
        return e


class CostController:
    """The stop rule by price (`--controller cost`): before appending v_i, the expected tokens per
    second of stopping at i − 1 against the best of drafting on (to any k ≤ K_max, the positions not
    yet drafted priced at the mean new experts a kept position added so far); and before a round,
    whether drafting pays at all — K = 0 is an AR step (no draft forward). Until every cost has been
    measured it calibrates: it drafts as the paper's rule would until a draft forward, a verify pass
    and a load have been timed, then takes one AR step to time a one-position round. When AR is
    priced better, one round in `explore` drafts anyway, so a drafter that starts paying is noticed;
    each exploration that confirms AR doubles that interval (up to `explore_max`), and a round priced
    for drafting resets it. The verifier still decides every token: exactness does not depend on any
    of this."""

    def __init__(
        self,
        k_max: int,
        explore: int = 16,
        explore_max: int = 256,
        costs: CostModel | None = None,
        optimism: float = 1.0,
        prior: tuple[list[int], list[int]] | None = None,
        prior_rounds: int = 32,
    ):
        """`prior`: (drafted_at, accepted_at) of a calibration (`Acceptance.warm`), weighing at most
        `prior_rounds` rounds."""
        self.k_max, self.explore, self.explore_max, self.optimism = k_max, explore, explore_max, optimism
        self.costs, self.acc = costs or CostModel(), Acceptance(k_max)
        if prior is not None:
            self.acc.warm(*prior, prior_rounds)
        # the round's footprint in the drafter's terms: what it ran (and predicted, with prefetch), new
        self.x0_new = Ema()  # … after x_0's forward
        self.new_per_position = Ema()  # … added by each kept draft position
        self.load_scale = Ema()  # the round's measured loads ÷ that footprint (verify misses, waste)
        self.catch_up_s = Ema()  # seconds a catch-up forward takes per token committed while this drafter sat out
        self.rounds = self.ar_rounds = 0
        self.interval, self.since_draft = explore, 0  # AR rounds between explorations, and since the last draft

    def rate(self, k: int, new_experts: float, look_ahead: bool) -> float:
        """Priced tokens/s of a round of k drafts, its acceptance taken at its upper confidence bound
        (`optimism`): a drafter or a depth judged rarely is tried until its estimate is tight enough
        to rule it out (optimism in the face of uncertainty, as a bandit's UCB)."""
        forwards = k + 1 if look_ahead else max(k, 1)  # x_0's forward, and v_K's when prefetch / truncation read it
        return self.acc.expected_tokens(k, self.optimism) / self.costs.round_s(forwards, k + 1, self.loads(new_experts))

    def loads(self, new_experts: float) -> float:
        """Layer-experts a round whose footprint adds `new_experts` loads: all of them, each the verify
        pass needed beside them (the drafter ran top-r of 6, or mispredicted), and each wasted prefetch —
        the footprint scaled by the ratio rounds measured (1 before any)."""
        return new_experts * (self.load_scale.value or 1.0)

    def round_x0(self) -> float:
        """x_0's new layer-experts in the drafter's footprint (an AR step's loads before a round is seen)."""
        return self.x0_new.value if self.x0_new.value is not None else self.costs.ar_loads.value

    def catch_up(self, lag: int) -> float:
        """Seconds the next draft forward first spends on `lag` tokens committed while this drafter sat
        out (AR steps, another drafter's rounds; a llama.cpp drafter is a context of its own): per token
        as catch-ups measured, before any as x_0's layer-experts loaded for each (no reuse: errs high)."""
        if lag <= 0:
            return 0.0
        per = self.catch_up_s.value
        if per is None:
            per = self.costs.load_s.value * self.round_x0()
        return lag * per

    def observe_catch_up(self, tokens: int, wall_s: float) -> None:
        """A round's first draft forward over `tokens` (x_0 and the lag before it): its time beyond a
        one-token draft forward, per lagging token."""
        if tokens > 1 and self.costs.draft_s.value is not None:
            self.catch_up_s.add(max(0.0, wall_s - self.costs.draft_s.value) / (tokens - 1))

    def best_rate_from(self, k: int, new_experts: float, look_ahead: bool) -> float:
        """The best rate of drafting to any k' ≥ k, positions past k at the mean new experts."""
        step = self.new_per_position.value or 0.0
        return max(self.rate(j, new_experts + step * (j - k), look_ahead) for j in range(k, self.k_max + 1))

    def draft_this_round(self, x0_new: float | None = None, lag: int = 0, remaining: int | None = None) -> bool:
        """Whether to draft at all (else an AR step); `lag`, `remaining`: `priced_drafting`'s."""
        self.rounds += 1
        c = self.costs
        if not c.ready:  # calibrating: time the drafted round first, then one AR step
            return not (c.ar_loads.value is None and None not in (c.draft_s.value, c.load_s.value))
        if self.priced_drafting(x0_new, lag, remaining):
            self.interval, self.since_draft = self.explore, 0
            return True
        self.since_draft += 1
        if self.since_draft > self.interval:  # explore: has the drafter started paying?
            self.interval, self.since_draft = min(2 * self.interval, self.explore_max), 0
            return True
        return False

    def priced_drafting(self, x0_new: float | None = None, lag: int = 0, remaining: int | None = None) -> bool:
        """Whether a drafted round is priced above an AR step. With the `remaining` tokens of the sequence
        known: whether drafting them is priced faster than AR steps, the drafter first catching up on
        the `lag` tokens it has not consumed (`catch_up`)."""
        x0 = self.round_x0() if x0_new is None else x0_new
        drafting = self.best_rate_from(1, x0 + (self.new_per_position.value or 0.0), look_ahead=True)
        ar = 1.0 / self.costs.ar_round_s()
        if remaining:
            return remaining / drafting + self.catch_up(lag) < remaining / ar
        return drafting > ar

    def keep(self, i: int, kept_new: float, candidate_new: float, look_ahead: bool) -> bool:
        """Append v_i? `kept_new`: new layer-experts of x_0 … v_{i−1} (|Û_{i−1} − resident|), `candidate_new`:
        with v_i kept too."""
        if not self.costs.ready:
            return True
        return self.best_rate_from(i, candidate_new, look_ahead) > self.rate(i - 1, kept_new, look_ahead)

    def observe(
        self, drafted: int, accepted: int, new_per_kept: list[int], x0_new: int | None = None, loads: int | None = None
    ) -> None:
        """After a round: its acceptance, the new layer-experts of its footprint after x_0 and per kept
        draft position, and the layer-experts it loaded (any forward, prefetches included)."""
        self.acc.add(drafted, accepted)
        for n in new_per_kept:
            self.new_per_position.add(n)
        if x0_new is not None:
            self.x0_new.add(x0_new)
            footprint = x0_new + sum(new_per_kept)
            if loads is not None and footprint:
                self.load_scale.add(loads / footprint)


class DrafterChoice:
    """`--method auto`: which drafter a round drafts with, or none (an AR step), by the same prices.
    One `CostController` per drafter (its acceptance, draft forward, footprint and load ratio its own; the verify
    pass priced once for the engine); each round goes to the drafter whose best priced rate is the
    highest, or to AR when none beats it. Calibration: each drafter drafts until priced, then one AR
    step is timed. Exploration, per drafter: one not drafted for its interval (`explore` rounds at
    first) drafts a round anyway (its acceptance would otherwise never move; the stalest first), and
    its interval doubles (up to `explore_max`); it is reset whenever that drafter is priced best. Each
    drafter keeps its own clock, so two arms priced alike and trading the lead do not starve a third."""

    def __init__(
        self,
        names: list[str],
        k_max: int,
        explore: int = 16,
        explore_max: int = 256,
        priors: dict[str, tuple[list[int], list[int]]] | None = None,
    ):
        """`priors`: each drafter's calibration counts (`CostController`'s `prior`)."""
        if not names:
            raise ValueError("auto: at least one drafter")
        shared, priors = CostModel(), priors or {}
        self.arms = {
            n: CostController(k_max, explore, explore_max, CostModel(shared), prior=priors.get(n)) for n in names
        }
        self.explore, self.explore_max = explore, explore_max
        self.interval = dict.fromkeys(names, explore)  # rounds each drafter may sit out before it is explored
        self.last_drafted = dict.fromkeys(names, 0)  # round each drafter last drafted
        self.rounds = 0

    def rates(self) -> dict[str | None, float]:
        """Priced tokens/s of each drafter's best round, and of an AR step (None)."""
        out: dict[str | None, float] = {}
        for n, arm in self.arms.items():
            out[n] = arm.best_rate_from(1, arm.round_x0() + (arm.new_per_position.value or 0.0), look_ahead=True)
        out[None] = 1.0 / next(iter(self.arms.values())).costs.ar_round_s()
        return out

    def choose(self, lags: dict[str, int] | None = None, remaining: int | None = None) -> str | None:
        """The drafter of this round (None: an AR step). With the `remaining` tokens of the sequence known,
        the one priced to emit them soonest, a drafter first catching up on the tokens it lags behind
        (`lags`; `CostController.catch_up`) — switching costs a llama.cpp drafter its lag's loads."""
        self.rounds += 1
        pick = self._choose(lags or {}, remaining)
        if pick is not None:
            self.last_drafted[pick] = self.rounds
        return pick

    def _choose(self, lags: dict[str, int], remaining: int | None) -> str | None:
        for n, arm in self.arms.items():  # calibrating: every drafter timed, then one AR step
            c = arm.costs
            if None in (c.draft_s.value, c.load_s.value, c.verify_s.value):
                return n
        if next(iter(self.arms.values())).costs.ar_loads.value is None:
            return None
        rates = self.rates()
        if remaining:  # seconds to emit the rest: AR's, and each drafter's after its catch-up
            secs = {n: remaining / r + (self.arms[n].catch_up(lags.get(n, 0)) if n else 0.0) for n, r in rates.items()}
            best = min(secs, key=secs.get)
        else:
            best = max(rates, key=rates.get)
        if best is not None:
            self.interval[best] = self.explore
        stale = [n for n in self.arms if n != best and self.rounds - self.last_drafted[n] > self.interval[n]]
        if stale:  # explore the drafter drafted least recently
            pick = min(stale, key=self.last_drafted.get)
            self.interval[pick] = min(2 * self.interval[pick], self.explore_max)
            return pick
        return best
