"""The cell: one typed description of a run, its applicability rules, and the record keys it yields."""

from dataclasses import asdict, fields

import pytest
import torch

from bench import cli
from bench.cells import registry
from bench.cells.artifacts import expert_file_for
from bench.cells.cell import RULES, Cell, CellError, Resolved, SpecOptions, build, flag
from bench.cells.decoders import make_decoder
from bench.runs.results import config_hash, read_records
from bench.steps import compare
from draftexpert.speculation.config import SpecConfig
from draftexpert.speculation.controller import PRICING
from tests.conftest import REPO


def test_choices_are_checked_once_and_named():
    for field, bad in (
        ("platform", "gpu"),
        ("engine", "vllm"),
        ("method", "eagle"),
        ("dtype", "fp16"),
        ("expert_type", "q8_0"),
        ("head_type", "int4"),
        ("expert_kernel", "cublas"),
        ("device", "tpu"),
    ):
        with pytest.raises(CellError, match=f"^{flag(field)}: '{bad}' is not one of"):
            Cell(**{field: bad})
    with pytest.raises(CellError, match="--staging: 'odirect' is not one of demand, pagefault"):
        Cell(engine="llama.cpp", staging="odirect")
    with pytest.raises(CellError, match="--budget-mode: 'sometimes'"):
        build(method="draftexpert", budget_mode="sometimes")
    with pytest.raises(CellError, match="llama.cpp engine decodes greedily"):
        Cell(engine="llama.cpp", temperature=0.5)
    with pytest.raises(CellError, match="--head-type apply to the torch engine"):
        Cell(engine="llama.cpp", head_type="q4_0")
    with pytest.raises(CellError, match="--read-bw: platform cg"):
        Cell(platform="cg", read_bw=10**6)


def test_rules_refuse_or_warn_only_what_was_given():
    with pytest.raises(CellError, match=r"^--tau, --k-max do not apply to --method ar|^--k-max, --tau do not apply"):
        build({"tau", "k_max"}, method="ar", tau=0.5, k_max=3)
    build(method="ar", tau=0.5)  # not given on a command line: the defaults of a form are no one's choice
    with pytest.raises(CellError, match="--device does not apply to --platform mn"):
        build({"device"}, platform="mn", device="cpu")
    with pytest.raises(CellError, match="--r does not apply to --method draftexpert"):
        build({"r"}, method="draftexpert", r=2)
    cell, warnings = build({"cache_experts"}, platform="resident", cache_experts=8)
    assert warnings == [
        "--cache-experts does not apply to --platform resident (every expert is already on the accelerator); ignored"
    ]
    assert cell.cache_experts == 0  # ignored means ignored: not in the cell, not in its key
    cell, warnings = build({"platform", "seed"}, method="reference", platform="mn", seed=3)
    assert len(warnings) == 1 and cell.config().platform == "resident" and cell.config().method_args == {}
    with pytest.raises(CellError, match="--temperature does not apply to --method reference"):
        build({"temperature"}, method="reference", temperature=0.7)
    every_flag = {n for rule in RULES for n in rule.flags}
    assert every_flag <= {f.name for f in fields(Cell)} | set(asdict(SpecOptions())) | set(asdict(SpecConfig()))


def test_names_and_overrides():
    cell = Cell(model="ml-tiny", method="top-r", engine="llama.cpp", spec=SpecOptions(r=2))
    assert cell.label == "top-2" and cell.engine_tag == "-llama.cpp"
    assert cell.run_dir(REPO) == REPO / "runs" / "ml-tiny-top-2-mn-llama.cpp"
    assert Cell(method="reference").run_dir(REPO).name == "ds-tiny-reference-resident"
    assert Cell(method="draftexpert", spec=SpecOptions(round=SpecConfig(k_max=6))).positions == 7
    assert Cell(method="ar").positions == 1
    k8 = cell.with_(k_max=8, truncate=False, r=3)
    assert (k8.spec.r, k8.spec.round.k_max, k8.spec.round.truncate, k8.engine) == (3, 8, False, "llama.cpp")
    with pytest.raises(CellError, match="unknown cell option"):
        cell.with_(colour="red")
    # llama.cpp's drafter always has its own context: the round runs draft_cache=shared, the key omits it
    assert "draft_cache" not in Cell(method="draftexpert", engine="llama.cpp").method_args(Resolved(draft_experts={}))


def test_auto_prices_every_round_and_names_its_drafters():
    for engine in ("torch", "llama.cpp"):
        cell = Cell(method="auto", engine=engine)
        assert cell.round_config().controller == "cost" and cell.label == "auto"
        args = cell.method_args(Resolved(draft_experts={"sha256": "x"}, top_k=6))
        assert args["drafters"] == ["draftexpert", "top-1", "top-3"] and args["controller"] == "cost"
        assert args["draft_experts"] == {"sha256": "x"}
    top_2 = Cell(method="auto").auto_drafters(Resolved(top_k=2))
    assert top_2 == ["draftexpert", "top-1"]  # top-3 is no drafter of a top-2 target
    with pytest.raises(CellError, match="--r does not apply to --method auto"):
        build({"r"}, method="auto", r=2)
    with pytest.raises(CellError, match="--controller does not apply to --method auto"):
        build({"controller"}, method="auto", controller="paper")


def test_defaults_are_the_librarys():
    """The command line's speculation defaults are SpecConfig's (one place to change them)."""
    spec = SpecConfig()
    for command in (cli.run, cli.compare, cli.eval_cmd):
        params = {p.name: p.default for p in __import__("inspect").signature(command).parameters.values()}
        assert (params["k_max"], params["tau"], params["budget"]) == (spec.k_max, spec.tau, spec.budget)
    c = Cell()
    assert (c.temperature, c.seed) == (spec.temperature, spec.seed)


@pytest.mark.parametrize("engine", ["torch", "llama.cpp"])
def test_committed_records_keep_their_keys(engine, monkeypatch):
    """Every cell of the committed Table 2 on ds-tiny is built today with the key its records carry."""
    if engine == "llama.cpp":
        pytest.importorskip("llama_cpp")
    torch.set_num_threads(1)  # the committed runs' threads (recorded by llama.cpp cells)
    folder = registry.resolve("ds-tiny")
    runs = REPO / "results" / "runs" / f"compare-ds-tiny-mn{'-llama.cpp' if engine == 'llama.cpp' else ''}"
    base = Cell(model="ds-tiny", method="draftexpert", engine=engine, max_new_tokens=64)
    checked = 0
    for label, method, over in compare.METHODS:
        over = dict(over)
        if over.pop(compare.EQUAL_MEMORY, False):  # sized by the committed DraftExpert row, as compare sizes it
            de = read_records(runs / "draftexpert" / "records.jsonl")
            row = {
                "method_args": de[0]["method_args"],
                "prefetch_peak_bytes": max(r["prefetch_peak_bytes"] for r in de),
            }
            over.update(compare.cache_for(base, folder, compare.extra_memory(base, folder, row)["bytes"]))
        platform = over.pop("platform", "mn")
        cell = (
            base.with_(method=method, **over)
            if platform == "mn"
            else base.with_(method=method, platform=platform, resident_from_file=True, **over)
        )
        dec, _, cfg = make_decoder(cell, folder, lambda qt: expert_file_for("ds-tiny", folder, qt))
        dec.close()
        conf = asdict(cfg)  # a record's key is this configuration and its machine: compare the configuration
        committed = {config_hash({k: r[k] for k in conf}) for r in read_records(runs / label / "records.jsonl")}
        if cell.priced:  # the key holds the pricing revision: records priced by an earlier one are re-measured
            args = conf["method_args"]
            assert args["pricing"] == PRICING
            older = {**conf, "method_args": {k: v for k, v in args.items() if k != "pricing"}}
            assert config_hash(older) != config_hash(conf)
            assert config_hash(conf) in committed or config_hash(older) in committed, (label, conf)
        else:
            assert config_hash(conf) in committed, (label, conf)
        checked += 1
    assert checked == len(compare.METHODS)
