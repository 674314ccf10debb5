import json

import pytest

from bench import prompts
from bench.sources import SourceError
from tests.conftest import run_bench


def test_committed_suites_have_the_schema_and_counts():
    for cat in prompts.SUITES:
        recs = prompts.load(cat)
        assert len(recs) == prompts.PER_CATEGORY
        assert len({r["id"] for r in recs}) == len(recs)
        for r in recs:
            assert set(r) == {"id", "category", "source", "source_id", "prompt"} and r["category"] == cat
            assert r["prompt"].strip()
    prov = json.loads((prompts.PROMPTS_DIR / "provenance.json").read_text())
    assert {p["category"] for p in prov} == set(prompts.SUITES)
    assert all(p["licence"] and p["credit"] for p in prov)


def _sources_cached() -> bool:
    try:
        for suite in prompts.SUITES.values():
            prompts.source_file(suite, offline=True)
        return True
    except SourceError:
        return False


@pytest.mark.skipif(not _sources_cached(), reason="package archives not cached: run `make prompt-sources` once")
def test_rebuild_is_byte_identical(tmp_path):
    built = prompts.build(tmp_path, offline=True)
    assert set(built) == {f"{c}.jsonl" for c in prompts.SUITES} | {"provenance.json"}
    for name, data in built.items():
        assert data == (prompts.PROMPTS_DIR / name).read_bytes(), name
        assert (tmp_path / name).read_bytes() == data


@pytest.mark.skipif(not _sources_cached(), reason="package archives not cached: run `make prompt-sources` once")
def test_cli_check_reports_identical():
    p = run_bench("prompts", "build", "--check", "--offline", "--json")
    assert p.returncode == 0, p.stderr
    assert all(json.loads(p.stdout)["identical_to_committed"].values())


def test_summarization_prompts_are_short_articles():
    for r in prompts.load("summarization"):
        article = r["prompt"].split("\n\n", 1)[1]
        assert len(article.split()) <= prompts.MAX_ARTICLE_WORDS


def test_cli_list_json():
    p = run_bench("prompts", "list", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert {r["category"]: r["prompts"] for r in rows} == {c: prompts.PER_CATEGORY for c in prompts.SUITES}


def test_unknown_suite_is_refused():
    with pytest.raises(KeyError):
        prompts.load("trivia")
