"""`bench fuzz`: cases replay by themselves, and the campaign's check catches a broken decoder."""

import draftexpert.speculation.round as rnd
from bench.cells.artifacts import expert_file_for
from bench.steps import fuzz as fz


def test_a_case_is_drawn_from_its_seed_and_index_alone():
    assert fz.draw("torch", 3, 17) == fz.draw("torch", 3, 17)
    cases = [fz.draw("torch", 0, i) for i in range(40)] + [fz.draw("llama.cpp", 0, i) for i in range(40)]
    assert {c.method for c in cases} == {"ar", "top-r", "draftexpert", "pld"}
    assert {c.pld_tokens for c in cases if c.method == "pld"} != {10}  # its proposal length varies too
    assert {c.platform for c in cases} == {"resident", "cg", "mn"}
    assert any(c.temperature > 0 for c in cases) and all(c.temperature == 0 for c in cases if c.engine == "llama.cpp")
    assert fz.replay_command(cases[5], 0) == "bench fuzz --engine torch --seed 0 --case 5"
    assert any(c.head_type == "q4_0" for c in cases)  # the torch engine's Q4_0 head, on the CPU platforms only
    assert all(c.head_type == "checkpoint" for c in cases if c.engine == "llama.cpp" or c.platform == "cg")
    assert {c.controller for c in cases if c.method in ("top-r", "draftexpert")} == {"paper", "cost"}
    assert all(c.controller == "paper" for c in cases if c.method in ("ar", "pld"))


def test_the_check_catches_an_accept_rule_that_keeps_every_draft(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path))
    camp = fz.Campaign(lambda m, f, qt: expert_file_for(m, f, qt))
    case = fz.Case(
        index=0,
        model="ds-tiny",
        engine="torch",
        platform="resident",
        method="top-r",
        r=1,
        k_max=4,
        truncate=False,
        prefetch=False,
        prompt_id="gsm8k-000",
        max_new_tokens=32,
    )
    pld = fz.Case(**{**case.__dict__, "method": "pld", "pld_tokens": 6, "pld_max_ngram": 2})
    assert camp.check(case)["ok"] and camp.check(pld)["ok"]
    monkeypatch.setattr(rnd, "greedy_accept", lambda draft, argmax: (draft + [argmax[len(draft)]], len(draft)))
    for c in (case, pld):
        res = camp.check(c)
        assert not res["ok"] and res["why"] == "tokens differ from plain decoding"
