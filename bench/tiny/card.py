"""Model card of an embedded tiny model: models/<name>/README.md plus its figures, written only
from files in the folder (config.json, training_log.jsonl, training_config.json,
corpus_manifest.json, eval.json) so that every number in the card can be traced to a run."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from draftexpert.runtime.params import breakdown  # noqa: E402

TRAVELS_MIB = 19.0  # weights at most this leave room for the draft experts under 20 MiB

WHY = """\
## Why these dimensions

Three constraints pull against each other (the paper's regime, this machine, the machines it travels to):

- **Expert loading must matter in offloaded decoding** (Fig. 1b). With hidden {hidden} and
  `moe_intermediate_size` {inter} one routed expert is 3·{hidden}·{inter} = {expert:,} parameters =
  **{expert_kib:.0f} KiB in bf16** ({expert_q4_kib:.0f} KiB in Q4_0); a token loads {k} experts × {moe} MoE layers
  = {per_token} experts = **{token_mib:.2f} MiB** (bf16). The project's measurement of the split is Fig. 1b
  (`results/fig1b_breakdown.md`), and the regime sweep caps the storage where loading must dominate.
- **Size and training budget.** {total_m:.2f}M parameters = {mib:.1f} MiB in bf16 ({shards}){travels}.
  This run trained at a median {tok_s:.0f} tokens/s (its log).
- **The routed experts' share**: {routed_pct:.1f}% of the weights (91.6% in ds) and {token_pct:.1f}% of what a
  decoded token reads (DeepSeek-V2-Lite: 55.1%, Moonlight: 52.3%; `bench params`): the {vocab:,}-token
  head{tied} and attention ({heads} heads, kv_lora {kv}) are what keep it from more at this width.
"""


def _curves(log: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    steps = np.array([r["step"] for r in log])
    ce = np.array([r["ce"] for r in log])
    k = 20
    smooth = np.convolve(ce, np.ones(k) / k, mode="valid") if len(ce) >= k else ce
    ax.plot(steps[len(steps) - len(smooth) :], smooth, label=f"train cross-entropy ({k}-step mean)")
    ev = [r for r in log if "val_loss" in r]
    ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="validation cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.grid(alpha=0.3)
    ties = [r for r in ev if "val_near_ties" in r]
    if ties:  # the drafting bound: how often the target hesitates between its top two tokens
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ties], [r["val_near_ties"] for r in ties], "s--", color="C3", ms=3,
                 label="held-out near-ties (p1 − p2 < 0.05), right axis")  # fmt: skip
        ax2.set_ylabel("share of positions")
        ax2.set_ylim(0, 1)
        lines = ax.get_legend_handles_labels()
        more = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def _usage(share: list[list[float]], out: Path) -> Path:
    a = np.array(share) * len(share[0])  # × uniform
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(a)))
    im = ax.imshow(a, aspect="auto", cmap="viridis", vmin=0, vmax=max(2.0, a.max()))
    ax.set_xlabel("routed expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(a)), [str(i + 1) for i in range(len(a))])
    fig.colorbar(im, ax=ax, label="load share × uniform")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def training_wall_s(log: list[dict], tcfg: dict) -> float:
    """Wall seconds of training: the last record's `elapsed_s` when the trainer wrote it, else the
    sum over logged intervals of tokens / tokens_per_s (which leaves out evaluation time)."""
    if "elapsed_s" in log[-1]:
        return log[-1]["elapsed_s"]
    total, prev = 0.0, 0
    for r in log:
        if "tokens_per_s" in r:
            total += (r["step"] - prev) * tcfg["batch_size"] * tcfg["seq_len"] / r["tokens_per_s"]
            prev = r["step"]
    return total


def _weights(folder: Path) -> str:
    shards = sorted(p.name for p in folder.glob("model*.safetensors"))
    return ", ".join(f"`{n}`" for n in shards) or "`model.safetensors`"


def write_card(folder: Path, name: str, reproduce_cmd: str) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    log = [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines() if line.strip()]
    tcfg = json.loads((folder / "training_config.json").read_text())
    ev = json.loads((folder / "eval.json").read_text())
    corpus = json.loads((folder / "corpus_manifest.json").read_text())
    b = breakdown(cfg).summary()
    _curves(log, folder / "loss_curve.png")
    _usage(ev["usage_share"], folder / "expert_usage.png")
    wall_s = training_wall_s(log, tcfg)
    v3 = cfg["model_type"] == "deepseek_v3"
    routing = (
        "sigmoid scores + `e_score_correction_bias` choose the top-6 (`noaux_tc`, one group); weights = "
        f"un-biased sigmoid scores, normalised, × {cfg['routed_scaling_factor']} (Moonlight's routing)"
        if v3
        else "softmax over 64 experts, greedy top-6, no renormalisation, routed output × "
        f"{cfg['routed_scaling_factor']} (DeepSeek-V2's routing"
        + (
            "; V2-Lite ships scale 1.0, see `bench/tiny/configs.py` for why this one is larger)"
            if cfg["routed_scaling_factor"] != 1.0
            else ")"
        )
    )
    balance = (
        "DeepSeek-V3 auxiliary-loss-free balancing: after each step b_i ← b_i + u·sign(mean load − load_i), "
        f"u = {tcfg['bias_update_speed']}, plus V3's sequence-wise balance loss α = {tcfg['seq_balance_alpha']}"
        if v3
        else f"DeepSeek-V2 expert-level balance loss α·Σ_i f_i P_i per MoE layer, α = {tcfg['balance_alpha']}"
    )
    tokens_seen = log[-1]["tokens_seen"]
    lines = [
        f"# {name}",
        "",
        f"An embedded MoE target of the DraftExpert suite: transformers' `{cfg['architectures'][0]}`, with the "
        f"routing structure of {'Moonlight-16B-A3B' if v3 else 'DeepSeek-V2-Lite'} at small dimensions, trained by "
        f"this project on an offline corpus. Weights: {_weights(folder)} (bf16). Load with "
        f"`AutoModelForCausalLM.from_pretrained('models/{name}')` (no network) or through `bench --model {name}`.",
        "",
        f"Reproduce: `{reproduce_cmd} --steps {tcfg['steps']} --batch-size {tcfg['batch_size']} "
        f"--seq-len {tcfg['seq_len']} --lr {tcfg['lr']}"
        + (f" --threads {tcfg['threads']}" if tcfg.get("threads", 1) != 1 else "")
        + (f" --device {tcfg['device']}" if tcfg.get("device", "cpu") != "cpu" else "")
        + "` (its tokenizer, committed here, is reused).",
        "",
        "## Shape",
        "",
        "| | |",
        "|---|---|",
        f"| layers | {cfg['num_hidden_layers']} (first {cfg['first_k_dense_replace']} dense, intermediate "
        f"{cfg['intermediate_size']}) |",
        f"| hidden | {cfg['hidden_size']} |",
        f"| routed experts | {cfg['n_routed_experts']} per MoE layer, top-{cfg['num_experts_per_tok']}, intermediate "
        f"{cfg['moe_intermediate_size']} |",
        f"| shared experts | {cfg['n_shared_experts']} |",
        f"| routing | {routing} |",
        f"| attention | MLA, {cfg['num_attention_heads']} heads, q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank "
        f"{cfg['kv_lora_rank']}, qk_nope {cfg['qk_nope_head_dim']} / qk_rope {cfg['qk_rope_head_dim']} / "
        f"v {cfg['v_head_dim']} |",
        f"| vocabulary | {cfg['vocab_size']} (byte-level BPE trained on the corpus; chat template "
        "`User: … / Assistant: …`) |",
        "",
        "## Parameters (`bench params --model " + name + "`)",
        "",
        f"- total {b['total'] / 1e6:.2f}M; routed experts {b['routed_experts'] / 1e6:.2f}M = "
        f"**{100 * b['routed_share']:.1f}%**; non-routed {b['non_routed'] / 1e6:.2f}M",
        f"- one routed expert: {b['routed_expert_params_each']:,} parameters = "
        f"{b['routed_expert_mib_bf16'] * 1024:.0f} KiB bf16, {b['routed_expert_mib_q4_0'] * 1024:.0f} KiB Q4_0; "
        f"per decoded token (6 × {b['n_routed_experts_total'] // cfg['n_routed_experts']} MoE layers) "
        f"{6 * b['n_routed_experts_total'] // cfg['n_routed_experts'] * b['routed_expert_mib_bf16']:.1f} MiB bf16",
        "",
        WHY.format(
            hidden=cfg["hidden_size"],
            inter=cfg["moe_intermediate_size"],
            expert=b["routed_expert_params_each"],
            expert_kib=b["routed_expert_mib_bf16"] * 1024,
            expert_q4_kib=b["routed_expert_mib_q4_0"] * 1024,
            k=cfg["num_experts_per_tok"],
            moe=b["n_routed_experts_total"] // cfg["n_routed_experts"],
            per_token=cfg["num_experts_per_tok"] * b["n_routed_experts_total"] // cfg["n_routed_experts"],
            token_mib=2 * b["routed_per_token"] / 2**20,
            total_m=b["total"] / 1e6,
            mib=2 * b["total"] / 2**20,
            shards=_weights(folder),
            travels=", small enough that a target and its draft experts stay under 20 MiB and travel to an "
            "accelerator machine (at most 64 MiB of tree, files of 16 MiB back)"
            if 2 * b["total"] / 2**20 <= TRAVELS_MIB
            else "",
            tok_s=float(np.median([r["tokens_per_s"] for r in log if "tokens_per_s" in r])),
            routed_pct=100 * b["routed_share"],
            token_pct=100 * b["token_routed_share"],
            vocab=cfg["vocab_size"],
            tied=", tied to the embedding," if cfg.get("tie_word_embeddings") else "",
            heads=cfg["num_attention_heads"],
            kv=cfg["kv_lora_rank"],
        ),
        "## Training",
        "",
        f"- corpus: {sum(s['train_bytes'] for s in corpus['sources']) / 2**20:.1f} MiB of offline prose and code "
        f"({', '.join(s['name'] for s in corpus['sources'])}); documents sharing a {corpus['ngram']}-word sequence "
        "with any evaluation prompt dropped (see `corpus_manifest.json`)",
        f"- {tcfg['steps']} steps × {tcfg['batch_size']} × {tcfg['seq_len']} tokens = "
        f"**{tokens_seen / 1e6:.2f}M tokens seen**; AdamW lr {tcfg['lr']} (warm-up {tcfg['warmup']}, cosine to "
        f"{tcfg['min_lr_ratio']}×), weight decay {tcfg['weight_decay']}, bf16 autocast, seed {tcfg['seed']}, "
        + (f"on {tcfg['device']}" if tcfg.get("device", "cpu") != "cpu" else f"{tcfg['threads']} CPU thread(s)")
        + (
            f", wall time {wall_s / 60:.0f} min"
            + ("" if "elapsed_s" in log[-1] else " (from the logged throughput; evaluation time not included)")
        ),
        f"- load balancing: {balance}"
        + (
            f"; then {tcfg['bias_rebalance']['bias_balance_steps']} bias-update-only steps with every weight frozen "
            f"(u = {tcfg['bias_rebalance']['bias_update_speed']}, training batches of "
            f"{tcfg['bias_rebalance']['batch_size']} × {tcfg['bias_rebalance']['seq_len']}, seeds disjoint from "
            "training), part of the recipe since an earlier ml-tiny's full validation split showed two layers above "
            "3× the uniform load after the schedule ended"
            if "bias_rebalance" in tcfg
            else ""
        ),
        "",
        "![loss curve](loss_curve.png)",
        "",
        f"## Evaluation (`bench model eval --model {name}`: the whole validation split)",
        "",
        f"On {ev['sequences']} validation sequences of {ev['seq_len']} tokens ({ev['tokens']:,} tokens). The split "
        f"holds ~{corpus['val_fraction']:.0%} of each source's documents (hashed by path), each cut to its first "
        f"{corpus.get('val_doc_cap_bytes', 0) // 1024} KiB so that no single huge document (the collected "
        "Shakespeare is one 465 KB file) dominates it:",
        "",
        f"- validation perplexity **{ev['perplexity']:.1f}** vs the unigram baseline of the same tokenizer "
        f"**{ev['unigram_perplexity']:.1f}**",
        "- expert usage per MoE layer (normalised entropy; max and min load share × uniform; experts used of "
        f"{cfg['n_routed_experts']}) and how much of each token the routed experts carry (mean Σ of the top-"
        f"{cfg['num_experts_per_tok']} gate weights, scaling factor included; mean routed output norm over the shared "
        "experts' — what a shared+top-1 draft mostly leaves out):",
        "",
        "| MoE layer | entropy | max × uniform | min × uniform | experts used | Σ top-k weights | routed : shared |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {i + 1} | {e:.3f} | {mx:.2f} | {mn:.2f} | {u} | {ws} | {rs} |"
            for i, (e, mx, mn, u, ws, rs) in enumerate(
                zip(
                    ev["usage_entropy"],
                    ev["max_share_x_uniform"],
                    ev["min_share_x_uniform"],
                    ev["experts_used"],
                    [f"{x:.2f}" for x in ev.get("routed_weight_sum", [])] or ["–"] * len(ev["experts_used"]),
                    [f"{x:.2f}" for x in ev.get("routed_to_shared_norm", [])] or ["–"] * len(ev["experts_used"]),
                )
            )
        ],
        "",
        "![expert usage](expert_usage.png)",
        "",
        "## Greedy continuations",
        "",
    ]
    rep = ev.get("repetition")
    if rep:
        lines += [
            f"Greedy AR continuations of {rep['prompts']} benchmark prompts (the first {rep['prompts'] // 6} of "
            f"each suite, through the chat template), {rep['max_new_tokens']} new tokens: "
            f"**{rep['mean_repeated_4gram_share']:.0%}** of their token 4-grams repeat an earlier 4-gram of the "
            f"same continuation (mean over prompts); the most common opening (first 4 tokens, "
            f"`{rep['most_shared_opening'].strip()}`) is shared by **{rep['max_shared_opening']}** of "
            f"{rep['prompts']} prompts."
            + (
                f" How sure the target is of each token it emitted (the positions acceptance is measured on): "
                f"mean top-1 probability **{rep['top1_prob']:.3f}**, near-ties (p1 − p2 < 0.05) at "
                f"**{rep['near_tie_share']:.0%}** of them."
                if "near_tie_share" in rep
                else ""
            ),
            "",
            "| prompt | repeated 4-grams | opening |",
            "|---|---|---|",
            *[f"| {r['id']} | {r['repeated_4gram_share']:.0%} | `{r['opening'].strip()}` |" for r in rep["rows"]],
            "",
            "A few of the continuations in full:",
            "",
        ]
    for c in ev.get("continuations", []):
        lines += [
            f"**{c['kind']}** — prompt: `{c['prompt'].strip()[:80]}`",
            "",
            "```",
            c["continuation"].strip(),
            "```",
            "",
        ]
    lines += [
        "## Licence and credits",
        "",
        "Weights trained by the DraftExpert suite; training text from the packages listed in "
        "`corpus_manifest.json` under their own licences (PSF, BSD, GPL-2.0 documentation, PostgreSQL, "
        "Artistic/GPL, public domain).",
    ]
    out = folder / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out
