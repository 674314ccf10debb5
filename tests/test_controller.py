"""The cost controller's formula on hand-made costs (its exactness: tests/test_speculative.py)."""

from __future__ import annotations

import pytest

from draftexpert.speculation.controller import Acceptance, CostController


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
    a = Acceptance(3)
    assert a.expected_tokens(0) == 1 and a.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the prior
    for _ in range(98):
        a.add(drafted=3, accepted=3)
    a.add(drafted=3, accepted=0)  # v_1 judged and rejected; v_2, v_3 not judged
    assert a.trials == [99, 98, 98] and a.accepted == [98, 98, 98]
    assert a.at(0) == pytest.approx(99 / 101) and a.at(1) == pytest.approx(99 / 100)


def test_uncalibrated_it_drafts_as_the_paper_would_then_times_an_ar_step():
    c = CostController(4)
    assert c.draft_this_round() and c.keep(1, 30, 60, True)
    c.costs.observe_draft(2, 2e-3)
    c.costs.observe_verify(3, 5e-3, 2e-3, 40)  # a 3-position verify: no one-position round timed yet
    assert not c.costs.ready and not c.draft_this_round()  # an AR step, to time one
    c.costs.observe_verify(1, 3e-3, 1e-3, 20)
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
