"""Self-distillation of draft experts: the loss terms on hand-checkable cases, the training path
equal to the decoding path, a frozen target, and checkpoints that refuse a foreign target."""

import inspect

import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from bench.cli import distill_cmd
from bench.steps.distill import state_dir
from draftexpert.runtime.loader import build_model, convert_experts
from draftexpert.runtime.model import KVCache, ModelConfig, from_hf_model
from draftexpert.speculation.drafters import draftexpert
from draftexpert.training.distill import (
    PRESETS,
    DistillConfig,
    DistillError,
    DraftExpertModule,
    RuntimeTeacher,
    TransformersTeacher,
    by_margin,
    draft_pass,
    eval_windows,
    evaluate_continuations,
    load_draft_experts,
    losses,
    save_draft_experts,
    target_pass,
    token_counts,
    total_loss,
    train,
)

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_shared_experts=2,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    initializer_range=0.3,
)


def model(version: str, top_k: int = 4, layers: int = 3):
    torch.manual_seed(0)
    common = COMMON | {"num_hidden_layers": layers}
    if version == "v2":
        m = DeepseekV2ForCausalLM(DeepseekV2Config(**common, num_experts_per_tok=top_k, topk_method="greedy"))
    else:
        m = DeepseekV3ForCausalLM(
            DeepseekV3Config(**common, num_experts_per_tok=top_k, norm_topk_prob=True, routed_scaling_factor=2.5)
        )
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    m.set_experts_implementation("eager")
    return m.eval()


X = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def test_loss_terms_on_hand_made_activations():
    m = torch.randn(5, 8)
    z = torch.randn(1, 5, 11)
    log_r = torch.randn(5, 6).log_softmax(-1)
    target = {"logits": z, "layers": {1: {"m": m, "log_r": log_r}}}
    same = {"logits": z.clone(), "layers": {1: {"de": m.clone(), "log_r": log_r.clone()}}}
    parts = losses(target, same, ("res", "logit", "tok", "router"))
    assert parts["res"] == 0 and parts["logit"].abs() < 1e-6 and parts["router"].abs() < 1e-6
    assert torch.isclose(parts["tok"], torch.nn.functional.cross_entropy(z[0], z[0].argmax(-1)))
    off = {"logits": z, "layers": {1: {"de": m + 1.0, "log_r": log_r}}}
    assert torch.isclose(losses(target, off, ("res",))["res"], torch.tensor(8.0))  # ‖1‖² over H = 8
    assert set(losses(target, same, ("res",))) == {"res"}


def test_agreement_is_read_per_target_margin():
    # two vocab entries: a near-tie the draft flips (margin 0.02), a confident token it keeps (margin 0.8)
    zt = torch.tensor([[0.51, 0.49], [0.9, 0.1]]).log()
    zd = torch.tensor([[0.4, 0.6], [0.7, 0.3]]).log()
    c = token_counts(zt, zd)
    assert c["agree"] == 1 and c["tokens"] == 2 and abs(c["p1_sum"] - 1.41) < 1e-5
    assert c["margin_tokens"] == [1, 0, 0, 0, 1] and c["margin_agree"] == [0, 0, 0, 0, 1]
    m = by_margin(c)
    assert m["share"] == [0.5, 0, 0, 0, 0.5] and m["token_agreement"][0] == 0 and m["token_agreement"][4] == 1
    assert m["token_agreement"][1] != m["token_agreement"][1]  # an empty bucket is NaN, not 0


def test_continuation_agreement_reads_the_positions_that_predict_the_emitted_tokens():
    class Teacher:  # the target predicts every next token; the draft agrees only from the prompt's last position on
        def target_pass(self, x):
            return {"logits": torch.nn.functional.one_hot(torch.cat([x[:, 1:], x[:, :1]], 1), 8).float() * 5}

        def draft_pass(self, draft, x):
            z = self.target_pass(x)["logits"].clone()
            z[:, :3] = z[:, :3].roll(1, -1)  # disagree before position 3 = len(prompt) - 1
            return {"logits": z}

    r = evaluate_continuations(Teacher(), None, [([1, 2, 3, 4], [5, 6, 7])])
    assert r["tokens"] == 3 and r["token_agreement"] == 1.0


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_top1_target_has_no_missing_residual(version):
    """With top_k = 1 the draft path with a zero draft expert *is* the target: m* = 0, equal logits,
    and the residual loss of a zero draft expert is 0 — the gate weight g_{l,e1} is the target's."""
    hf = model(version, top_k=1)
    cfg = ModelConfig.from_hf(hf.config)
    zero = DraftExpertModule([1, 2], 64, 8)
    t = target_pass(hf, cfg, X)
    d = draft_pass(hf, cfg, zero, X)
    assert all(a["m"].abs().max() < 1e-5 for a in t["layers"].values())
    assert (t["logits"] - d["logits"]).abs().max() < 1e-5
    assert losses(t, d, ("res",))["res"] < 1e-9


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_training_path_equals_decoding_path(version):
    """A trained-looking (random) draft expert gives the same draft logits in the distillation
    path (transformers + hooks) and in the runtime's DraftExpert drafter."""
    hf = model(version)
    cfg = ModelConfig.from_hf(hf.config)
    draft = DraftExpertModule([1, 2], 64, 8, seed=3)
    with torch.no_grad():
        for p in draft.down.values():
            p.normal_(0, 0.3)
        draft.gamma["1"].fill_(0.7)
    z = draft_pass(hf, cfg, draft, X[:1])["logits"][0]
    lean = from_hf_model(hf)
    got = lean.forward(X[0], KVCache.for_model(lean, 16), path=draftexpert(lean, draft.export()))
    assert (got - z).abs().max() < 1e-4


def test_distillation_trains_only_the_draft_experts(tmp_path):
    hf = model("v2")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    data = np.random.default_rng(0).integers(3, 300, 4000).astype(np.uint16)
    cfg = DistillConfig(
        preset="full", intermediate=8, steps=6, batch_size=2, seq_len=16, eval_every=3, checkpoint_every=3, warmup=1
    )
    teacher = TransformersTeacher(hf)
    draft, hist = train(
        teacher, data, eval_windows(data, 4, 16), cfg, tmp_path / "state", log=lambda m: None, progress=False
    )
    assert all(torch.equal(before[k], v) for k, v in hf.state_dict().items())
    assert all(p.abs().sum() > 0 for p in draft.down.values())  # started at 0, moved
    assert {"res", "logit", "tok", "router", "loss"} <= set(hist[0]) and "eval" in hist[2]
    # resuming a finished run does nothing more and returns the same experts
    again, hist2 = train(
        teacher, data, eval_windows(data, 4, 16), cfg, tmp_path / "state", log=lambda m: None, progress=False
    )
    assert len(hist2) == 6 and all(torch.equal(a, b) for a, b in zip(draft.parameters(), again.parameters()))
    with pytest.raises(DistillError, match="another configuration"):
        train(
            teacher,
            data,
            [],
            DistillConfig(preset="residual", intermediate=8, steps=6, batch_size=2, seq_len=16),
            tmp_path / "state",
            log=lambda m: None,
            progress=False,
        )


def test_checkpoint_refuses_a_foreign_target(tmp_path):
    a, b = model("v2"), model("v2")
    with torch.no_grad():
        b.model.norm.weight.mul_(1.5)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    experts = DraftExpertModule([1, 2], 64, 8).export()
    save_draft_experts(tmp_path / "de.safetensors", experts, tmp_path / "a", {"preset": "full"})
    got, meta = load_draft_experts(tmp_path / "de.safetensors", tmp_path / "a")
    assert meta == {"preset": "full"} and torch.equal(got.gate_up[1], experts.gate_up[1])
    with pytest.raises(DistillError, match="different target"):
        load_draft_experts(tmp_path / "de.safetensors", tmp_path / "b")
    with pytest.raises(DistillError, match="bench distill"):
        load_draft_experts(tmp_path / "missing.safetensors", tmp_path / "a")
    with pytest.raises(DistillError, match="unknown preset"):
        DistillConfig(preset="everything")


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("store", ["host", "flash"])
def test_the_runtime_teacher_is_the_transformers_teacher(version, store, tmp_path):
    """Distillation where inference runs: both paths through the offload runtime (experts streamed
    from the store, the draft path's top-1 term recomputed in the backward) give transformers'
    activations, every loss term and the draft experts' gradients (fp32, f32 expert file)."""
    hf = model(version, layers=5)  # 4 MoE layers: the backward needs every layer's cache rows unchanged
    hf.save_pretrained(tmp_path / "ckpt")
    gguf = convert_experts(tmp_path / "ckpt", tmp_path / "experts.gguf", "f32") if store == "flash" else None
    lean = build_model(tmp_path / "ckpt", store, gguf_path=gguf)
    teachers = TransformersTeacher(hf), RuntimeTeacher(lean)
    draft = DraftExpertModule([1, 2, 3, 4], 64, 8, seed=1)
    with torch.no_grad():
        for p in draft.down.values():
            p.normal_(0, 0.3)  # a draft expert that changes the draft path (down starts at 0)
    got = []
    for t in teachers:
        target, drafted = t.target_pass(X), t.draft_pass(draft, X)
        parts = losses(target, drafted, PRESETS["full"])
        draft.zero_grad()
        t.backward(total_loss(parts, DistillConfig()))
        got.append((target, drafted, parts, {n: p.grad.clone() for n, p in draft.named_parameters()}))
    (ta, da, pa, ga), (tb, db, pb, gb) = got
    assert (ta["logits"] - tb["logits"]).abs().max() < 1e-4 and (da["logits"] - db["logits"]).abs().max() < 1e-4
    for i in (1, 2, 3, 4):
        assert (ta["layers"][i]["m"] - tb["layers"][i]["m"]).abs().max() < 1e-4
        assert torch.equal(ta["layers"][i]["topk"], tb["layers"][i]["topk"])
        assert torch.equal(da["layers"][i]["topk"], db["layers"][i]["topk"])
    for k in pa:
        assert torch.isclose(pa[k], pb[k], rtol=1e-4, atol=1e-6), k
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-3, atol=1e-5), n
    by_phase = lean.experts.ledger.summary()["by_phase"]
    assert by_phase["distill-target"]["loads"] > 0 and by_phase["distill-backward"]["loads"] > 0  # recomputed, streamed


def test_distillation_runs_through_the_offload_runtime(tmp_path):
    """`train` with the runtime teacher over the flash store (Q4_0 experts, as on mn): it trains."""
    model("v3").save_pretrained(tmp_path / "ckpt")
    lean = build_model(
        tmp_path / "ckpt", "flash", gguf_path=convert_experts(tmp_path / "ckpt", tmp_path / "e.gguf", "q4_0")
    )
    data = np.random.default_rng(0).integers(3, 300, 4000).astype(np.uint16)
    cfg = DistillConfig(preset="full", intermediate=8, steps=3, batch_size=2, seq_len=16, eval_every=3, warmup=1)
    draft, hist = train(
        RuntimeTeacher(lean),
        data,
        eval_windows(data, 4, 16),
        cfg,
        tmp_path / "state",
        log=lambda m: None,
        progress=False,
    )
    assert all(p.abs().sum() > 0 for p in draft.down.values()) and len(hist) == 3
    assert 0 <= hist[-1]["eval"]["router_agreement"] <= 1


def test_resumable_state_is_keyed_by_the_target_weights(tmp_path):
    """A retrained target (same config, new weights) must not resume the old target's distillation."""
    model("v2").save_pretrained(tmp_path / "a")
    model("v2", layers=2).save_pretrained(tmp_path / "b")
    cfg = DistillConfig(preset="full", intermediate=8)
    here = state_dir("ds-tiny", tmp_path / "a", cfg, "transformers", "mn", "q4_0")
    assert here == state_dir("ds-tiny", tmp_path / "a", cfg, "transformers", "mn", "q4_0")
    assert here != state_dir("ds-tiny", tmp_path / "b", cfg, "transformers", "mn", "q4_0")
    assert here != state_dir(
        "ds-tiny", tmp_path / "a", DistillConfig(preset="full", intermediate=16), "transformers", "mn", "q4_0"
    )


def test_bench_distill_defaults_are_the_trainers():
    """The CLI keeps its own copy of the defaults (it must not import torch to start); they must not drift."""
    params = inspect.signature(distill_cmd).parameters
    for name in ("steps", "batch_size", "seq_len", "lr", "alpha", "beta", "eta"):
        assert params[name].default == getattr(DistillConfig, name), name
