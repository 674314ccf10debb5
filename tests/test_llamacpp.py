"""The llama.cpp engine, for real (llama-cpp-python is installed by `make test`): GGUF files written
from a checkpoint load in llama.cpp and compute the torch runtime's logits and expert sets;
speculative outputs (shared+top-r, DraftExpert) equal llama.cpp's own AR greedy output at f32 and
Q4_0; the DraftExpert drafter's GGUF computes the torch drafter; staging really goes to storage."""

import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from draftexpert.engines.llama_gguf import link_experts, split_name, write_head
from draftexpert.runtime.loader import build_model, convert_experts
from draftexpert.runtime.model import KVCache, route
from draftexpert.speculation.drafters import DraftExperts, draftexpert
from draftexpert.speculation.lookup import Lookup
from draftexpert.speculation.round import SpecConfig
from tests.conftest import run_bench

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make test installs it)")
import draftexpert.engines.llamacpp as llamacpp  # noqa: E402
from baselines.ar import AROffloadDecoder  # noqa: E402
from draftexpert import metrics  # noqa: E402
from draftexpert.engines.llamacpp import ExpertPages, LlamaEngine, LlamaModel, build_info  # noqa: E402
from draftexpert.runtime.loader import load_router  # noqa: E402
from draftexpert.speculation.round import SpeculativeDecoder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Dimensions in whole Q4_0 blocks (32); weights large enough that a drafter disagrees with the target.
COMMON = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_shared_experts=2,
    num_experts_per_tok=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
MOE = [1, 2]
PROMPTS = [[0, 17, 250, 3000, 41, 9], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 999, 12, 12, 12, 400, 3]]


@pytest.fixture(scope="module")
def disk_dir():
    """A folder on a real disk (page cache and fadvise behave as on storage; tmpfs would not)."""
    d = REPO / "work" / "pytest-llamacpp"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def checkpoint(version: str, folder: Path, **over) -> Path:
    torch.manual_seed(0)
    if version == "v2":
        m = DeepseekV2ForCausalLM(DeepseekV2Config(**{**COMMON, **over}, topk_method="greedy"))
    else:
        m = DeepseekV3ForCausalLM(
            DeepseekV3Config(**{**COMMON, **over}, norm_topk_prob=True, routed_scaling_factor=2.5)
        )
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    m.save_pretrained(folder)
    if version == "v3":  # transformers does not save it; llama.cpp needs it (README: converter pitfalls)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "scoring_func": "sigmoid"}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO / "models" / "ds-tiny" / f, folder / f)
    return folder


def model_files(folder: Path, qtype: str, draft=None, name="target") -> tuple[Path, Path]:
    experts = folder.parent / f"{folder.name}-{qtype}.gguf"
    if not experts.exists():
        convert_experts(folder, experts, qtype)
    prefix = folder.parent / f"{folder.name}-{qtype}" / name
    prefix.parent.mkdir(exist_ok=True)
    head = write_head(folder, split_name(prefix, 1), qtype, draft)
    link_experts(prefix, experts)
    return head, experts


@pytest.fixture(scope="module", params=["v2", "v3"])
def ckpt(request, disk_dir):
    return checkpoint(request.param, disk_dir / request.param)


def random_draft(folder: Path) -> DraftExperts:
    return DraftExperts.random(MOE, 64, 32, seed=1, std=0.3)


def test_build_is_batch_invariant():
    """Exactness needs a multi-token eval to compute what one-token evals compute: llamafile's
    sgemm (on in llama.cpp's default build) does not (the engine refuses to speculate on it)."""
    assert build_info().get("LLAMAFILE", "0") == "0", (
        "build llama-cpp-python with CMAKE_ARGS='-DGGML_LLAMAFILE=OFF' (README)"
    )


def test_llama_cpp_computes_the_torch_runtime(ckpt):
    """Same checkpoint at f32 (f16 weights are another model: a routing flip moves whole logits):
    logits at every prompt position agree, and so do the routed expert sets (a 600-token prompt
    spans two of llama.cpp's 512-token ubatches: the taps must gather both)."""
    head, _ = model_files(ckpt, "f32")
    lm = LlamaModel(head, 1024, 1, kv_type="f32")
    torch_model = build_model(ckpt, "resident")
    for ids in PROMPTS + [[0] + [(7 * i) % 4000 + 3 for i in range(599)]]:
        lm.reset()
        got = lm.eval(ids)
        want = torch_model.forward(torch.tensor(ids), KVCache.for_model(torch_model, len(ids)))
        scale = float(want.abs().max())
        assert np.abs(got - want.numpy()).max() <= 1e-4 * scale
        for layer in MOE:
            assert (np.sort(lm.topk[layer], 1) == np.sort(torch_model.last_routing[layer].numpy(), 1)).all()
    lm.close()


def test_group_limited_routing_is_one_rule_on_both_engines(disk_dir):
    """V3 with 4 expert groups, top-2 groups: llama.cpp's own top-k, the torch runtime's, and the
    runtime's rule applied to llama.cpp's router logits (how `LlamaEngine.predicted` chooses) are
    the same sets at every position; without the group step the rule would choose otherwise."""
    folder = checkpoint("v3", disk_dir / "v3-groups", n_group=4, topk_group=2)
    head, experts = model_files(folder, "f32")
    lm = LlamaModel(head, 256, 1, kv_type="f32", tap_router_logits=True)
    torch_model = build_model(folder, "resident")
    cfg, bias = load_router(folder)
    assert cfg.n_group == 4 and cfg.topk_group == 2
    engine = LlamaEngine(lm, ExpertPages(experts), drafter=lm, router=(cfg, bias))
    flat = dataclasses.replace(cfg, n_group=1, topk_group=1)
    differs = 0
    for ids in PROMPTS:
        lm.reset()
        lm.eval(ids)
        torch_model.forward(torch.tensor(ids), KVCache.for_model(torch_model, len(ids)))
        for layer in MOE:
            z = torch.from_numpy(lm.router_logits[layer])
            rule = route(z, cfg, cfg.top_k, bias[layer])[1].sort(-1).values.numpy()
            assert (rule == np.sort(lm.topk[layer], 1)).all()
            assert (rule == np.sort(torch_model.last_routing[layer].numpy(), 1)).all()
            differs += int((route(z, flat, cfg.top_k, bias[layer])[1].sort(-1).values.numpy() != rule).any(1).sum())
        assert engine.predicted() == {(layer, int(e)) for layer in MOE for e in lm.topk[layer][-1]}
    assert differs > 0, "the groups never changed a choice: this test could not tell the rules apart"
    engine.close()


def test_draftexpert_gguf_computes_the_torch_drafter(disk_dir):
    """The drafter file (draft expert as extra shared rows, γ folded, zero-padded, top-1) gives the
    torch runtime's DraftExpert draft-path logits (V2: both keep the target's gate weight)."""
    folder = checkpoint("v2", disk_dir / "drafter-v2")
    de = random_draft(folder)
    de.gamma = {1: 0.7, 2: 1.3}
    de.gate_up = {k: v[: 2 * 20] for k, v in de.gate_up.items()}  # I_d = 20: padded to one 32-row block
    de.down = {k: v[:, :20] for k, v in de.down.items()}
    head, _ = model_files(folder, "f32", de, name="draftexpert")
    lm = LlamaModel(head, 256, 1, kv_type="f32")
    torch_model = build_model(folder, "resident")
    path = draftexpert(torch_model, de)
    for ids in PROMPTS:
        lm.reset()
        got = lm.eval(ids)
        want = torch_model.forward(torch.tensor(ids), KVCache.for_model(torch_model, len(ids)), path=path)
        assert np.abs(got - want.numpy()).max() <= 2e-3 * float(want.abs().max())
    lm.close()


CONFIGS = [  # (drafter, r, SpecConfig)
    ("top-r", 1, SpecConfig(k_max=4, truncate=False, prefetch=False)),
    ("top-r", 2, SpecConfig(k_max=1, truncate=False, prefetch=False)),
    ("top-r", 3, SpecConfig(k_max=8, truncate=False, prefetch=True)),
    ("draftexpert", 1, SpecConfig(k_max=4)),
    ("draftexpert", 1, SpecConfig(k_max=8, tau=0.9, budget=2)),
    ("draftexpert", 1, SpecConfig(k_max=3, tau=0.9, budget=2, budget_mode="cache", prefetch=False)),
    ("draftexpert", 1, SpecConfig(k_max=4, controller="cost")),  # priced: K (0 included) from measured costs
    ("top-r", 2, SpecConfig(k_max=8, controller="cost", prefetch=False)),
]


@pytest.mark.parametrize("qtype", ["f32", "q4_0"])
def test_speculative_equals_llama_cpp_ar(ckpt, qtype):
    """Greedy: every drafter and controller setting emits exactly llama.cpp's own AR tokens."""
    head, experts = model_files(ckpt, qtype)
    de_head, _ = model_files(ckpt, qtype, random_draft(ckpt), name="draftexpert")
    router = load_router(ckpt)
    assert (ckpt.name == "v3") == bool(router[1])  # V3's correction biases choose the predicted experts
    pages = ExpertPages(experts)
    target = LlamaModel(head, 256, 1)
    ar = AROffloadDecoder(LlamaEngine(target, pages))
    want = [ar.generate(ids, 24, None).tokens for ids in PROMPTS]
    alphas = []
    for method, r, conf in CONFIGS:
        drafter = LlamaModel(
            de_head if method == "draftexpert" else head,
            256,
            1,
            used_experts=r if method == "top-r" else None,
            tap_router_logits=True,
        )
        spec = SpeculativeDecoder(LlamaEngine(target, pages, drafter, router, name=method), conf)
        for ids, expected in zip(PROMPTS, want):
            out = spec.generate(ids, 24, None)
            assert out.tokens == expected, (method, r, conf)
            led = out.stats["ledger"]
            moved = sum(p["loads"] for ph, p in led["by_phase"].items() if not ph.startswith("prefill"))
            moved += led["prefetch"]["issued"]
            assert 0 < led["oracle"]["loads"] <= moved, (method, r, conf)  # MIN with the run's peak memory
            if out.stats["drafted"]:  # α is undefined for a prompt whose every round was truncated empty
                alphas.append(metrics.derive(out.stats)["acceptance"])
        drafter.close()
    assert 0.05 < np.mean(alphas) < 0.95, "the drafters must disagree with the target sometimes, or nothing is tested"
    target.close()
    pages.close()


def test_experts_come_from_storage(disk_dir, monkeypatch):
    """After `evict` no expert page is cached; a step caches the routed experts' pages (and not
    the whole file); `prefetch` stages an expert without llama.cpp touching it."""
    folder = disk_dir / "ds-tiny"  # the committed model: experts of ~14 pages each (Q4_0)
    shutil.copytree(REPO / "models" / "ds-tiny", folder, ignore=shutil.ignore_patterns("draft_experts", "*.png"))
    head, experts = model_files(folder, "q4_0")
    pages = ExpertPages(experts)
    lm = LlamaModel(head, 256, 1)
    lm.eval(PROMPTS[0])
    pages.evict()
    assert pages.cached_pages() == 0
    lm.eval([42])
    routed = {(layer, int(e)) for layer, idx in lm.topk.items() for e in idx.ravel()}
    assert all(pages.cached(key) for key in routed) and not pages.cached(next(k for k in pages.keys if k not in routed))
    total_experts = 5 * 64
    assert pages.cached_pages() < pages.region_pages * (len(routed) + 4) / total_experts
    counts = (pages.cached_pages(), [pages.cached(key) for key in pages.keys])
    monkeypatch.setattr(llamacpp, "_cachestat", None)  # the kernel's count (cachestat) is mincore's
    assert (pages.cached_pages(), [pages.cached(key) for key in pages.keys]) == counts
    monkeypatch.undo()
    pages.evict()
    pages.prefetch({(2, 5)})
    deadline = time.time() + 5
    while not pages.cached((2, 5)) and time.time() < deadline:
        time.sleep(0.01)
    assert pages.cached((2, 5))
    lm.close()
    pages.close()


def test_staging_modes_are_exact_and_measured(disk_dir):
    """demand (the default), pagefault and resident give the same tokens; demand stages a
    layer's experts from the router tap before llama.cpp touches them — its stall is measured,
    every routed expert is loaded once per step (cold) and none by a page fault afterwards;
    pagefault's stall is NaN (not observable); resident loads nothing after the start."""
    folder = disk_dir / "ds-tiny-staging"
    shutil.copytree(REPO / "models" / "ds-tiny", folder, ignore=shutil.ignore_patterns("draft_experts", "*.png"))
    head, experts = model_files(folder, "q4_0")
    outs, cached_before = {}, []
    for staging in ("demand", "pagefault", "resident"):
        engine = LlamaEngine(LlamaModel(head, 256, 1), ExpertPages(experts), staging=staging)
        real_stage = engine.pages.stage

        def stage(keys, real_stage=real_stage, pages=engine.pages):  # what was cached when the hook ran
            cached_before.append(sum(pages.cached(key) for key in keys))
            real_stage(keys)

        if staging == "demand":
            engine.pages.stage = stage
        outs[staging] = [AROffloadDecoder(engine).generate(ids, 12, None) for ids in PROMPTS[:2]]
        engine.close()
    # the hook ran for every MoE layer of every forward, before llama.cpp had touched that layer's experts
    assert len(cached_before) == 2 * 12 * 5 and not any(cached_before)
    assert (
        [o.tokens for o in outs["demand"]]
        == [o.tokens for o in outs["pagefault"]]
        == [o.tokens for o in outs["resident"]]
    )
    for o in outs["demand"]:
        ar = o.stats["ledger"]["by_phase"]["ar"]
        assert ar["requested"] == ar["loads"] == ar["forwards"] * 5 * 6  # cold: 5 MoE layers × top-6, each step
        assert 0 < ar["stall_s"] < ar["wall_s"]
    assert all(
        o.stats["ledger"]["by_phase"]["ar"]["stall_s"] != o.stats["ledger"]["by_phase"]["ar"]["stall_s"]
        for o in outs["pagefault"]
    )  # NaN
    assert all(o.stats["ledger"]["by_phase"]["ar"]["loads"] == 0 for o in outs["resident"])
    with pytest.raises(ValueError, match="--staging"):
        LlamaEngine(None, None, staging="mmap")


def test_cli_runs_the_engine_and_names_bad_flags(tmp_path):
    """`bench run --engine llama.cpp` end to end (records say which engine and staging), equal to
    its own AR; a platform the engine does not run is named."""
    env = {"DRAFTEXPERT_CACHE": str(REPO / "work" / "pytest-llamacpp-cache")}
    common = [
        "--engine",
        "llama.cpp",
        "--model",
        "ds-tiny",
        "--platform",
        "mn",
        "--suite",
        "chat",
        "--limit",
        "2",
        "--max-new-tokens",
        "12",
        "--json",
        "--threads",
        "1",
    ]
    runs = {}
    for method in ("ar", "draftexpert"):
        p = run_bench("run", "--method", method, *common, "--out", str(tmp_path / method), env=env)
        assert p.returncode == 0, p.stderr
        runs[method] = json.loads(p.stdout)["records"]
    assert [r["tokens"] for r in runs["ar"]] == [r["tokens"] for r in runs["draftexpert"]]
    rec = runs["draftexpert"][0]
    assert rec["engine"] == "llama.cpp" and "fadvise" in rec["method_args"]["staging"]
    assert rec["method_args"]["draft_experts"]["preset"] == "full" and rec["drafted"] > 0
    p = run_bench("run", "--engine", "llama.cpp", "--platform", "cg", "--model", "ds-tiny", "--limit", "1", env=env)
    assert p.returncode == 2 and "--platform" in p.stderr and "llama.cpp" in p.stderr
    p = run_bench("crosscheck", "--model", "ds-tiny", "--type", "q4_0", env=env)
    assert p.returncode == 2 and "--type" in p.stderr


def test_a_failing_load_hook_fails_the_eval(ckpt):
    """An exception in the router hook (a failed read, a bug) cannot cross llama.cpp's C callback:
    the eval stops and raises it, instead of decoding on without the experts it staged."""
    head, _ = model_files(ckpt, "f32")
    lm = LlamaModel(head, 256, 1)

    def hook(layer, experts):
        raise OSError(5, "the expert file could not be read")

    lm.on_route = hook
    with pytest.raises(OSError, match="could not be read"):
        lm.eval(PROMPTS[0])
    lm.on_route = None
    lm.reset()
    assert lm.eval(PROMPTS[0]).shape[0] == len(PROMPTS[0])  # the model is usable again
    lm.close()


@pytest.mark.parametrize("qtype", ["f32", "q4_0"])
def test_prompt_lookup_equals_llama_cpp_ar(ckpt, qtype):
    """Greedy prompt lookup on llama.cpp (no drafter model at all) emits llama.cpp's own AR tokens."""
    head, experts = model_files(ckpt, qtype)
    pages = ExpertPages(experts)
    target = LlamaModel(head, 256, 1)
    ar = AROffloadDecoder(LlamaEngine(target, pages))
    prompts = [ids + ids[: len(ids) // 2] + ids for ids in PROMPTS]  # prompts that repeat: lookup proposes
    drafted = accepted = 0
    for k in (2, 10):
        pld = SpeculativeDecoder(
            LlamaEngine(target, pages, name="pld"),
            SpecConfig(k_max=k, truncate=False, prefetch=False),
            lookup=Lookup(3),
        )
        for ids in prompts:
            want = ar.generate(ids, 24, None).tokens
            out = pld.generate(ids, 24, None)
            assert out.tokens == want, (qtype, k)
            drafted, accepted = drafted + out.stats["drafted"], accepted + out.stats["accepted"]
            assert out.stats.get("draft_forwards", 0) == 0
    assert drafted > 0 and accepted < drafted, "lookup must propose and be rejected sometimes, or nothing is tested"
    target.close()
    pages.close()


def test_staging_budget_keeps_recent_experts_and_stays_exact(disk_dir):
    """--staging-budget: AR with an LRU of whole experts kept in the page cache between steps emits
    cold AR's tokens, reads fewer expert bytes, and holds no more than the budget across steps
    (what stays cached after an eviction is the kept experts, not the file)."""
    folder = disk_dir / "ds-tiny-budget"
    shutil.copytree(REPO / "models" / "ds-tiny", folder, ignore=shutil.ignore_patterns("draft_experts", "*.png"))
    head, experts = model_files(folder, "q4_0")
    target, pages = LlamaModel(head, 256, 1), ExpertPages(experts)
    one = pages.nbytes[min(pages.nbytes)]
    outs = {}
    for budget in (0, 40 * one):
        engine = LlamaEngine(target, pages, staging="demand", staging_budget=budget)
        outs[budget] = [AROffloadDecoder(engine).generate(ids, 16, None) for ids in PROMPTS[:2]]
        if budget:
            engine._evict()
            assert len(engine._since_evict) <= 40
            assert pages.cached_pages() * llamacpp.PAGE <= budget + 4 * len(engine._since_evict) * llamacpp.PAGE
            kept = sorted(engine._since_evict)
            assert kept and all(pages.cached(k) for k in kept)
    assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[40 * one]]
    cold = sum(metrics.counters(o.stats)["decode_bytes"] for o in outs[0])
    cached = sum(metrics.counters(o.stats)["decode_bytes"] for o in outs[40 * one])
    assert 0 < cached < 0.9 * cold
    with pytest.raises(ValueError, match="--staging demand"):
        LlamaEngine(target, pages, staging="pagefault", staging_budget=one)
    target.close()
    pages.close()


def _rss(start: int) -> int:
    """Resident kB of the mapping that starts at `start` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                inside = int(head.split("-")[0], 16) == start
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {start:#x}")


def test_a_forward_stages_into_its_own_models_mapping_only(disk_dir):
    """Two models map the expert split; a verify pass populates the target's mapping and leaves the
    drafter's alone (populating both cost a speculative AR step ~10% over plain AR on ds-tiny), and the
    drafter's own forward populates its own."""
    folder = disk_dir / "ds-tiny-mappings"
    shutil.copytree(REPO / "models" / "ds-tiny", folder, ignore=shutil.ignore_patterns("draft_experts", "*.png"))
    head, experts = model_files(folder, "q4_0")
    target = LlamaModel(head, 256, 1)
    drafter = LlamaModel(head, 256, 1, used_experts=1, tap_router_logits=True)
    engine = LlamaEngine(target, ExpertPages(experts), drafter, load_router(folder), name="top-1")
    engine.start(64)
    mine = [m[0] for m in engine.pages._mappings]
    t_map, d_map = (next(a for a in mine if a in m.mappings) for m in (target, drafter))
    assert len(mine) == 2 and t_map != d_map
    engine.prefill(PROMPTS[0])
    engine.begin_round()  # evicts: neither mapping holds an expert page
    assert _rss(t_map) == _rss(d_map) == 0
    engine.verify(len(PROMPTS[0]), [42])
    assert _rss(t_map) > 0 and _rss(d_map) == 0
    engine.draft_forward(PROMPTS[0] + [42])
    assert _rss(d_map) > 0
    engine.close()


def test_auto_on_llama_cpp_equals_ar_whichever_drafter_it_takes(ckpt):
    """`--method auto` on llama.cpp: a context per drafter; one left out for rounds catches up on the
    committed tokens when next chosen. Tokens equal llama.cpp's AR under the priced choice and with
    each drafter (and AR) forced."""
    head, experts = model_files(ckpt, "q4_0")
    de_head, _ = model_files(ckpt, "q4_0", random_draft(ckpt), name="draftexpert")
    pages = ExpertPages(experts)
    target = LlamaModel(head, 256, 1)
    ar = AROffloadDecoder(LlamaEngine(target, pages))
    drafters = {
        "draftexpert": LlamaModel(de_head, 256, 1, tap_router_logits=True),
        "top-1": LlamaModel(head, 256, 1, used_experts=1, tap_router_logits=True),
        "top-3": LlamaModel(head, 256, 1, used_experts=3, tap_router_logits=True),
    }
    engine = LlamaEngine(target, pages, router=load_router(ckpt), name="auto", drafters=drafters)
    spec = SpeculativeDecoder(engine, SpecConfig(k_max=4, controller="cost"), drafters=list(drafters))
    x0 = []  # every x_0 footprint the arms were priced by
    for arm in spec.choice.arms.values():
        arm.x0_new.add = lambda v, add=arm.x0_new.add: (x0.append(v), add(v))
    for ids in PROMPTS:
        assert spec.generate(ids, 24, None).tokens == ar.generate(ids, 24, None).tokens
    for forced in [*drafters, None, "top-1", "draftexpert"]:  # switches: a drafter left behind catches up
        spec.choice.choose = lambda *_, forced=forced: forced
        out = spec.generate(PROMPTS[1], 24, None)
        assert out.tokens == ar.generate(PROMPTS[1], 24, None).tokens, forced
        assert set(out.stats["auto_rounds"]) == {forced or "ar"}
    # x_0's footprint is one position's: at most its verify experts and what the drafter ran for it
    # (a catch-up forward over the tokens committed meanwhile touches many more: not x_0's, not priced)
    assert x0 and max(x0) <= 2 * len(MOE) * COMMON["num_experts_per_tok"], x0
    for m in drafters.values():
        m.close()
    target.close()
    pages.close()


def test_speculation_with_a_staging_budget_equals_ar_and_reads_less(ckpt):
    """A drafter with experts kept staged across rounds (`--staging-budget` on a speculative method:
    the LRU of whole experts an AR + cache run keeps, the round's eviction keeping the most recently
    routed) emits llama.cpp's AR tokens and reads fewer expert bytes than its cold rounds."""
    head, experts = model_files(ckpt, "q4_0")
    de_head, _ = model_files(ckpt, "q4_0", random_draft(ckpt), name="draftexpert")
    router = load_router(ckpt)
    pages = ExpertPages(experts)
    target = LlamaModel(head, 256, 1)
    want = [AROffloadDecoder(LlamaEngine(target, pages)).generate(ids, 24, None).tokens for ids in PROMPTS]
    budget = 40 * pages.nbytes[min(pages.nbytes)]
    moved = {}
    for b in (0, budget):
        drafter = LlamaModel(de_head, 256, 1, tap_router_logits=True)
        engine = LlamaEngine(target, pages, drafter, router, name="draftexpert", staging_budget=b)
        spec = SpeculativeDecoder(engine, SpecConfig(k_max=4))
        outs = [spec.generate(ids, 24, None) for ids in PROMPTS]
        assert [o.tokens for o in outs] == want, b
        moved[b] = sum(metrics.derive(metrics.counters(o.stats))["moved_bytes"] for o in outs)
        drafter.close()
    assert 0 < moved[budget] < 0.9 * moved[0]
    target.close()
    pages.close()
