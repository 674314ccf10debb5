"""Files derived from a checkpoint, written once and reused: the GGUF expert file (platform mn and
split 2 of the llama.cpp model), the llama.cpp heads (split 1: a target's or a DraftExpert
drafter's), and where a model's distilled draft experts live.

Draft experts: embedded models keep theirs beside the weights,
`models/<name>/draft_experts/<preset>.safetensors`; real models (whose folder may be a read-only
Hugging Face cache) under `work/draft_experts/<name>/`.
"""
from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

from bench import registry

WORK = registry.REPO_ROOT / "work"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def expert_file_for(model: str, folder: Path, qtype: str, out: Path | None = None,
                    log: Callable[[str], None] = _stderr) -> Path:
    """The GGUF expert file of a checkpoint, written once and reused: its name carries a
    fingerprint of config.json and the shards' names, sizes and mtimes."""
    from bench.sources import cache_dir
    from draftexpert.runtime.loader import convert_experts

    h = hashlib.sha256((folder / "config.json").read_bytes())
    h.update(b"expert split v2")  # v2: the file is split 2 of the llama.cpp model (split.no = 1)
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = out or cache_dir() / "gguf" / f"{model}-{qtype}-{h.hexdigest()[:12]}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the {qtype} expert file {path} (once)")
        convert_experts(folder, path, qtype)
    return path


def llama_head_for(model: str, folder: Path, qtype: str, expert_file: Path, draft=None, draft_id: str | None = None,
                   log: Callable[[str], None] = _stderr) -> Path:
    """Split 1 of the llama.cpp model (the target's, or a DraftExpert drafter's), written once next
    to the expert file, whose symlink is split 2 (`draftexpert.engines.llama_gguf`)."""
    from draftexpert.engines.llama_gguf import link_experts, split_name, write_head

    prefix = expert_file.with_suffix("") / ("target" if draft is None else f"draftexpert-{draft_id}")
    head = split_name(prefix, 1)
    if not head.exists():
        head.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the llama.cpp {qtype} head {head} (once)")
        write_head(folder, head, qtype, draft)
    link_experts(prefix, expert_file)
    return head


def experts_dir(model: str, folder: Path) -> Path:
    spec = registry.get(model)
    return folder / "draft_experts" if spec.embedded else WORK / "draft_experts" / model


def find_draft_experts(model: str, folder: Path, preset: str = "full") -> Path | None:
    p = experts_dir(model, folder) / f"{preset}.safetensors"
    return p if p.exists() else None


def load_draft_experts_for(model: str, folder: Path, file: Path | str | None):
    """(DraftExperts or None, description): `file` if given ("zero": the zero draft expert), else
    the model's distilled `full` preset when one exists, else None — the zero draft expert
    (shared + top-1)."""
    from draftexpert.training.distill import load_draft_experts

    if file is not None and str(file) == "zero":
        return None, {"preset": "zero", "file": None}
    path = Path(file) if file else find_draft_experts(model, folder, "full")
    if path is None:
        return None, {"preset": "zero", "file": None}
    experts, meta = load_draft_experts(path, folder)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return experts, {"preset": meta.get("preset"), "file": path.name, "sha256": digest, "steps": meta.get("steps")}
