"""A target checkpoint in a local Hugging Face folder (never the network): loading it, and the
fingerprint of its weights — the identity results and draft experts are paired with."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from draftexpert.runtime.loader import CheckpointError


def load_target(folder: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local folder in Hugging Face format, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not list(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} holds no *.safetensors weights (only {', '.join(sorted(p.name for p in folder.iterdir())) or 'nothing'})")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, safetensors' own
        raise CheckpointError(f"the weights in {folder} could not be loaded by transformers "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); is a shard truncated?") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"the tokenizer in {folder} could not be loaded ({type(e).__name__}); the folder "
                              "needs tokenizer.json / tokenizer_config.json beside config.json") from None
    return model.eval(), tokenizer


def _fingerprint_cache() -> Path:
    root = os.environ.get("DRAFTEXPERT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "draftexpert") / "fingerprints.json"


def weights_fingerprint(folder: Path) -> str:
    """sha256 over the folder's safetensors files (names and bytes, in name order). Hashing a
    16B checkpoint takes a minute, so the digest is cached per machine, keyed by the folder and
    every shard's name, size and mtime: a rewritten shard is hashed again."""
    folder = Path(folder).resolve()
    shards = sorted(folder.glob("*.safetensors"))
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in shards]
    cache = _fingerprint_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(folder))
    if entry and entry.get("shards") == stamp:
        return entry["sha256"]
    h = hashlib.sha256()
    for p in shards:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    known[str(folder)] = {"shards": stamp, "sha256": digest}
    try:  # best effort: a read-only home only costs the hash next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest
