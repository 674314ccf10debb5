"""Shared fixtures: a tiny random DeepseekV2 checkpoint in Hugging Face format, with a small
byte-level BPE tokenizer trained on the spot (no network, no committed weights needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from typer.testing import CliRunner

from bench.cli import app
from bench.tiny.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, "-m", "bench.cli"]


def run_bench(*args, env=None, **kw):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([*BENCH, *args], cwd=REPO, capture_output=True, text=True, env=e, **kw)


def bench_inproc(*args, env=None):
    """`bench ARGS` in this process (typer's runner): for refusals, which end before anything loads —
    no interpreter start-up (~4 s a call). An uncaught exception reads as a traceback on stderr, as in
    a subprocess. Commands whose modules read the environment at import time need `run_bench`."""
    r = CliRunner().invoke(app, [str(a) for a in args], env=env)
    stderr = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, stderr)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 2-layer random DeepseekV2 model (layer 0 dense, layer 1 MoE) + tokenizer, saved like the real ones."""
    folder = tmp_path_factory.mktemp("tiny-ckpt")
    words = "the model routes each token to six experts and the shared experts see every token".split()
    texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    tok = train_tokenizer(iter(texts), folder, vocab_size=300)
    cfg = DeepseekV2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        topk_method="greedy",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(folder)
    return folder
