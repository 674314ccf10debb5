"""The cost controller's formula on hand-made costs (its exactness: tests/test_speculative.py)."""

from __future__ import annotations

import pytest

from draftexpert.speculation.controller import Acceptance, CostController, DrafterChoice


def priced(load_s: float, draft_s: float, verify_s: float, accept: float, new_per_position: float = 20.0,
           ar_loads: float = 30.0, k_max: int = 4) -> CostController:  # fmt: skip
    c = CostController(k_max)
    c.costs.load_s.value, c.costs.draft_s.value, c.costs.verify_s.value = load_s, draft_s, verify_s
    c.costs.position_s.value, c.costs.ar_loads.value, c.new_per_position.value = (
        verify_s / 10,
        ar_loads,
        new_per_position,
    )
    c.acc.trials, c.acc.accepted = [1000] * k_max, [round(1000 * accept)] * k_max
    return c


def test_expected_tokens_is_the_accepted_prefix_and_the_targets_own():
    a = Acceptance(3, decay=1.0)  # every round counted the same
    assert a.expected_tokens(0) == 1 and a.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the prior
    for _ in range(98):
        a.add(drafted=3, accepted=3)
    a.add(drafted=3, accepted=0)  # v_1 judged and rejected; v_2, v_3 not judged
    assert a.trials == [99, 98, 98] and a.accepted == [98, 98, 98]
    a1 = (98 + 2 * 0.5) / (99 + 2)
    assert a.at(0) == pytest.approx(a1) and a.at(1) == pytest.approx((98 + 2 * a1) / (98 + 2))


def test_older_rounds_weigh_less_so_the_estimate_follows_a_new_prompt():
    for decay, moves in ((0.95, True), (1.0, False)):
        a = Acceptance(2, decay=decay)
        for _ in range(100):
            a.add(drafted=2, accepted=2)  # one prompt: every draft passes
        for _ in range(15):
            a.add(drafted=2, accepted=0)  # the next: v_1 rejected every round
        assert (a.at(0) < 0.5) is moves, (decay, a.at(0))
    assert a.at(0) > 0.8  # undiscounted, 100 old rounds outvote 15 new ones
    a = Acceptance(2)
    a.add(drafted=0, accepted=0)  # an AR step judges nothing: nothing decays
    assert a.trials == [0, 0]


def test_a_position_judged_rarely_borrows_the_estimate_of_the_one_before():
    a = Acceptance(4)
    for _ in range(50):
        a.add(drafted=1, accepted=1)  # only v_1 ever drafted: accepted every time
    assert a.at(0) > 0.95 and a.at(3) == pytest.approx(a.at(0))  # not the flat ½


def test_uncalibrated_it_drafts_as_the_paper_would_then_times_an_ar_step():
    c = CostController(4)
    assert c.draft_this_round() and c.keep(1, 30, 60, True)
    c.costs.observe_draft([(1, 1e-3), (1, 1e-3)])
    c.costs.observe_verify(3, 3e-3, 40)  # a 3-position verify: no one-position round timed yet
    c.costs.observe_loads(40, 2e-3)
    assert not c.costs.ready and not c.draft_this_round()  # an AR step, to time one
    c.costs.observe_verify(1, 2e-3, 20)
    assert c.costs.ready and c.costs.ar_loads.value == 20


def test_where_loading_dominates_and_drafts_miss_an_ar_step_pays():
    c = priced(load_s=1e-3, draft_s=1e-3, verify_s=1e-3, accept=0.3)
    choices = [c.draft_this_round() for _ in range(1 + 16 + 1 + 32 + 1 + 64)]
    # one round in `explore` drafts anyway (a drafter that starts paying is noticed); each exploration
    # that finds AR still cheaper doubles the interval
    assert [i for i, d in enumerate(choices) if d] == [16, 16 + 1 + 32, 16 + 1 + 32 + 1 + 64]
    for _ in range(2000):
        c.draft_this_round()
    assert c.interval == c.explore_max


def test_a_round_priced_for_drafting_resets_the_exploration_interval():
    c = priced(load_s=1e-3, draft_s=1e-3, verify_s=1e-3, accept=0.3)
    for _ in range(100):
        c.draft_this_round()
    assert c.interval > c.explore
    c.acc.trials, c.acc.accepted = [1000] * 4, [990] * 4  # the drafter now passes almost always
    c.costs.draft_s.value = 1e-5
    assert c.draft_this_round() and c.interval == c.explore


def test_where_compute_is_cheap_to_repeat_and_drafts_pass_it_drafts_to_k_max():
    c = priced(load_s=1e-6, draft_s=1e-4, verify_s=1e-2, accept=0.9)
    assert c.draft_this_round()
    assert all(c.keep(i, 30 + 20 * (i - 1), 30 + 20 * i, True) for i in range(1, 5))


def test_a_token_is_kept_by_what_it_adds_to_the_block():
    c = priced(load_s=1e-3, draft_s=1e-4, verify_s=1e-3, accept=0.6)
    assert c.keep(2, 50, 50, True)  # v_2 brings no new expert: nearly free
    assert not c.keep(2, 50, 110, True)  # 60 new layer-experts for a 36% chance of a token
    assert c.keep(2, 50, 110, True) is False and c.rate(1, 50, True) > c.rate(2, 110, True)


def chooser(accepts: dict[str, float], draft_s: dict[str, float], load_s=1e-3, verify_s=1e-3) -> DrafterChoice:
    ch = DrafterChoice(list(accepts), k_max=4)
    for name, arm in ch.arms.items():
        p = priced(load_s, draft_s[name], verify_s, accepts[name])
        arm.costs.draft_s.value = draft_s[name]
        arm.acc, arm.new_per_position.value = p.acc, p.new_per_position.value
        arm.optimism = 0.0
    shared = next(iter(ch.arms.values())).costs
    shared.load_s.value, shared.verify_s.value, shared.position_s.value, shared.ar_loads.value = (
        load_s,
        verify_s,
        verify_s / 10,
        30.0,
    )
    return ch


def test_auto_calibrates_every_drafter_then_times_an_ar_step():
    ch = DrafterChoice(["a", "b"], k_max=4)
    assert ch.choose() == "a"
    a = ch.arms["a"].costs
    a.observe_draft([(1, 5e-4), (1, 5e-4)])
    a.observe_verify(3, 3e-3, 40)
    a.observe_loads(40, 4e-3)
    assert ch.choose() == "b"  # the verify prices are shared; b's draft forward is not timed yet
    ch.arms["b"].costs.observe_draft([(1, 1e-3), (1, 1e-3)])
    assert ch.choose() is None  # every drafter timed: one AR step, to time a one-position round
    a.observe_verify(1, 1e-3, 30)
    assert ch.arms["b"].costs.ready and ch.choose() in ("a", "b")


def test_auto_takes_the_best_priced_drafter_or_ar():
    ch = chooser({"de": 0.9, "top-3": 0.6}, {"de": 1e-4, "top-3": 1e-4})
    assert ch.choose() == "de"
    ch = chooser({"de": 0.2, "top-3": 0.3}, {"de": 1e-3, "top-3": 1e-3})
    assert ch.choose() is None  # loading dominates, drafts miss: AR
    rates = ch.rates()
    assert rates[None] > max(rates["de"], rates["top-3"])


def test_auto_explores_each_drafter_on_its_own_doubling_interval():
    ch = chooser({"de": 0.2, "top-3": 0.3, "top-1": 0.25}, {"de": 1e-3, "top-3": 1e-3, "top-1": 1e-3})
    picks = [ch.choose() for _ in range(116)]
    explored = {n: [i + 1 for i, p in enumerate(picks) if p == n] for n in ch.arms}
    # AR is priced best; a drafter sat out for its interval drafts once (the stalest first), and its
    # interval doubles: 16, 32, 64 rounds
    assert explored == {"de": [17, 50, 115], "top-3": [18, 51, 116], "top-1": [19, 52]}


def test_two_arms_trading_the_lead_do_not_starve_a_third():
    """A single exploration clock reset at every change of the priced best never ran out while AR and
    one drafter, priced alike, took turns: the third drafter was never tried again."""
    ch = chooser({"a": 0.6, "c": 0.2}, {"a": 1e-3, "c": 1e-3})
    flips = iter([{"a": 2.0, "c": 0.5, None: 1.0}, {"a": 0.9, "c": 0.5, None: 1.0}] * 20)
    ch.rates = lambda: next(flips)
    picks = [ch.choose() for _ in range(40)]
    assert picks.index("c") == 16 and picks.count("c") == 1  # round 17: sat out its interval
    assert set(picks) == {"a", None, "c"}


def test_a_catch_up_forward_does_not_price_the_next_rounds_draft_forwards():
    """After AR steps the drafter's first forward runs every token committed meanwhile (here 40):
    averaged in, it would price a one-token draft forward at ~10× and keep the controller on AR."""
    c = CostController(4)
    c.costs.observe_draft([(1, 1e-3)] * 5)
    c.costs.observe_draft([(40, 30e-3), (1, 1e-3), (1, 1e-3), (1, 1e-3), (1, 1e-3)])
    assert c.costs.draft_s.value == pytest.approx(1e-3)
    c2 = CostController(4)
    c2.costs.observe_draft([(2, 1.5e-3)])  # a round with no one-token forward: priced by what it has
    assert c2.costs.draft_s.value == pytest.approx(1.5e-3)


def test_a_drafter_that_lags_pays_its_catch_up_so_a_switch_near_the_end_does_not():
    """A llama.cpp drafter left out of rounds first consumes the tokens committed meanwhile: priced
    per token as catch-ups measured, set against the seconds the rest of the sequence takes."""
    ch = chooser({"a": 0.8, "b": 0.9}, {"a": 1e-3, "b": 1e-3})
    for arm in ch.arms.values():
        arm.x0_new.value = 30.0
    ch.arms["b"].observe_catch_up(21, 1e-3 + 20 * 0.05)  # 50 ms a lagging token
    assert ch.arms["b"].catch_up_s.value == pytest.approx(0.05)
    rates = ch.rates()
    assert rates["b"] > rates["a"]  # b is the better drafter once caught up
    assert ch.choose({"a": 0, "b": 20}, remaining=1000) == "b"  # 1 s of catch-up is worth it over 1000 tokens
    assert ch.choose({"a": 0, "b": 20}, remaining=8) == "a"  # not over the last 8
    assert ch.choose({"a": 0, "b": 0}, remaining=8) == "b"


def test_ar_steps_leave_the_drafter_behind_and_its_catch_up_is_priced():
    c = priced(load_s=1e-3, draft_s=1e-4, verify_s=1e-3, accept=0.8)
    c.x0_new.value = 30.0
    assert c.priced_drafting() and c.priced_drafting(lag=0, remaining=4)
    assert c.catch_up(10) == pytest.approx(10 * 1e-3 * 30)  # before any catch-up: x_0's loads per token
    assert not c.priced_drafting(lag=200, remaining=4) and c.priced_drafting(lag=200, remaining=10_000)
