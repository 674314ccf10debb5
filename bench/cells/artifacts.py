"""Files derived from a checkpoint, written once and reused: the GGUF expert file (platform mn and
split 2 of the llama.cpp model), the llama.cpp heads (split 1: a target's or a DraftExpert
drafter's), and where a model's distilled draft experts live.

Every GGUF written here carries per-tensor checksums (`gguf_checksums.verify_checksums`); a cached
file is checked before it is used — cheaply when unchanged since its last check — and a damaged
or unfinished one is rebuilt, never used.

Draft experts: embedded models keep theirs beside the weights,
`models/<name>/draft_experts/<preset>.safetensors`; real models (whose folder may be a read-only
Hugging Face cache) under `work/draft_experts/<name>/<weights sha256[:12]>/` (`$DRAFTEXPERT_WORK`
instead of `work/` when set).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from bench.cells import registry
from bench.suites.sources import cache_dir
from draftexpert.engines.llama_gguf import link_experts, split_name, write_head
from draftexpert.runtime.checkpoint import weights_fingerprint, write_dense_counterpart
from draftexpert.runtime.gguf_checksums import checksum_path, verify_checksums
from draftexpert.runtime.loader import convert_experts
from draftexpert.training.distill import load_draft_experts

WORK = registry.work_dir()  # $DRAFTEXPERT_WORK, else work/ in this checkout


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def usable(path: Path, log: Callable[[str], None] = _stderr, full: bool = False) -> bool:
    """Whether a cached artifact exists and matches its checksums; a damaged one is removed
    (with its sidecar), so the caller writes it anew."""
    if not path.exists():
        return False
    problem = verify_checksums(path, full=full)
    if problem is None:
        return True
    log(f"{path} is damaged: {problem}; rebuilding it")
    path.unlink()
    checksum_path(path).unlink(missing_ok=True)
    return False


def expert_file_for(
    model: str,
    folder: Path,
    qtype: str,
    out: Path | None = None,
    log: Callable[[str], None] = _stderr,
    verify: bool = False,
) -> Path:
    """The GGUF expert file of a checkpoint, written once and reused (after its checksums are
    checked; `verify`: every byte read again): its name carries a fingerprint of config.json and
    the shards' names, sizes and mtimes."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    # v2: split 2 of the llama.cpp model (split.no = 1); v3: checksummed; v4: gate_up fused
    h.update(b"expert split v4")
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = out or cache_dir() / "gguf" / f"{model}-{qtype}-{h.hexdigest()[:12]}.gguf"
    if not usable(path, log, verify):
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the {qtype} expert file {path} (once)")
        convert_experts(folder, path, qtype)
    return path


def dense_counterpart_for(model: str, folder: Path, log: Callable[[str], None] = _stderr) -> Path:
    """The MoE checkpoint's dense counterpart (`write_dense_counterpart`, Fig. 4's dense half),
    written once under the cache (into a temporary folder, renamed when complete) and reused;
    its name carries a fingerprint of the source's config.json and shards."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    h.update(b"dense counterpart v1")
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = cache_dir() / "dense" / f"{model}-dense-{h.hexdigest()[:12]}"
    if not (path / "config.json").exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"writing {model}'s dense counterpart {path} (once)")
        write_dense_counterpart(folder, tmp)
        os.replace(tmp, path)
    return path


def llama_head_for(
    model: str,
    folder: Path,
    qtype: str,
    expert_file: Path,
    draft=None,
    draft_id: str | None = None,
    log: Callable[[str], None] = _stderr,
    verify: bool = False,
) -> Path:
    """Split 1 of the llama.cpp model (the target's, or a DraftExpert drafter's), written once next
    to the expert file, whose symlink is split 2 (`draftexpert.engines.llama_gguf`)."""
    prefix = expert_file.with_suffix("") / ("target" if draft is None else f"draftexpert-{draft_id}")
    head = split_name(prefix, 1)
    if not usable(head, log, verify):
        head.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing the llama.cpp {qtype} head {head} (once)")
        write_head(folder, head, qtype, draft)
    link_experts(prefix, expert_file)
    return head


def experts_dir(model: str, folder: Path) -> Path:
    """Embedded models: beside the weights. Real models: `work/draft_experts/<model>/<weights sha256
    [:12]>/` — one folder per checkpoint, so draft experts trained for one copy are never overwritten
    (nor looked for) on behalf of another."""
    spec = registry.get(model)
    if spec.embedded:
        return folder / "draft_experts"
    return WORK / "draft_experts" / model / weights_fingerprint(folder)[:12]


def find_draft_experts(model: str, folder: Path, preset: str = "full") -> Path | None:
    p = experts_dir(model, folder) / f"{preset}.safetensors"
    return p if p.exists() else None


def load_draft_experts_for(model: str, folder: Path, file: Path | str | None):
    """(DraftExperts or None, description): `file` if given ("zero": the zero draft expert), else
    the model's distilled `full` preset when one exists, else None — the zero draft expert
    (shared + top-1)."""
    if file is not None and str(file) == "zero":
        return None, {"preset": "zero", "file": None}
    path = Path(file) if file else find_draft_experts(model, folder, "full")
    if path is None:
        return None, {"preset": "zero", "file": None}
    experts, meta = load_draft_experts(path, folder)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return experts, {"preset": meta.get("preset"), "file": path.name, "sha256": digest, "steps": meta.get("steps")}
