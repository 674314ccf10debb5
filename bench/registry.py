"""Model registry: which models the suite knows, where each is looked for, and whether it is here.

Resolution order for a model (the first folder holding a config.json wins):
  1. `--model-path PATH` (a folder in Hugging Face format);
  2. `$DRAFTEXPERT_MODELS/<name>` or `$DRAFTEXPERT_MODELS/<repo basename>` (e.g. `DeepSeek-V2-Lite`);
  3. the Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), read
     offline (`local_files_only`): nothing is ever downloaded;
  4. embedded models only: `models/<name>` in this repository.
A real model that is absent raises `ModelNotFound`, whose message lists every place searched
and the command that fetches the weights.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FACTS_DIR = Path(__file__).parent / "model_facts"
EMBEDDED_DIR = REPO_ROOT / "models"
ENV_VAR = "DRAFTEXPERT_MODELS"


class ModelNotFound(RuntimeError):
    """A registered model's weights are not on this machine."""


class UnknownModel(KeyError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_repo: str | None  # None for the embedded models
    architecture: str
    description: str
    embedded: bool = False
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def folder_names(self) -> list[str]:
        names = [self.name, *self.aliases]
        if self.hf_repo:
            names.append(self.hf_repo.split("/")[-1])
        return names


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("ds", "deepseek-ai/DeepSeek-V2-Lite", "DeepseekV2ForCausalLM",
                  "DeepSeek-V2-Lite: 27 layers, 64 routed + 2 shared experts, top-6 softmax, MLA"),
        ModelSpec("ml", "moonshotai/Moonlight-16B-A3B", "DeepseekV3ForCausalLM",
                  "Moonlight-16B-A3B: 27 layers, 64 routed + 2 shared experts, top-6 sigmoid + bias"),
        ModelSpec("ds-tiny", None, "DeepseekV2ForCausalLM",
                  "embedded, trained here: ds's routing structure at small dims", embedded=True),
        ModelSpec("ml-tiny", None, "DeepseekV3ForCausalLM",
                  "embedded, trained here: ml's routing structure at small dims", embedded=True),
    ]
}


def get(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UnknownModel(f"unknown model {name!r}; registered: {', '.join(MODELS)}")
    return MODELS[name]


def hf_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def _hf_cache_snapshot(repo: str, cache: Path) -> Path | None:
    """The newest snapshot of `repo` in one HF cache folder that holds a config.json (offline)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if ref.exists():
        snap = folder / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").exists():
            return snap
    snaps = sorted((folder / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return snaps[-1].parent if snaps else None


def candidates(spec: ModelSpec, model_path: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """Every (how, folder) where `spec` is looked for, in order."""
    out: list[tuple[str, Path]] = []
    if model_path:
        out.append(("--model-path", Path(model_path).expanduser()))
    if os.environ.get(ENV_VAR):
        for n in spec.folder_names:
            out.append((f"${ENV_VAR}", Path(os.environ[ENV_VAR]).expanduser() / n))
    elif not spec.embedded:
        out.append((f"${ENV_VAR} is unset", Path(f"${ENV_VAR}") / spec.folder_names[-1]))
    if spec.hf_repo:
        for cache in hf_cache_dirs():
            snap = _hf_cache_snapshot(spec.hf_repo, cache)
            out.append(("Hugging Face cache", snap or cache / f"models--{spec.hf_repo.replace('/', '--')}"))
    if spec.embedded:
        out.append(("embedded", EMBEDDED_DIR / spec.name))
    return out


def fetch_hint(spec: ModelSpec) -> str:
    if spec.embedded:
        return (f"the embedded weights are committed in models/{spec.name}; restore them with "
                f"`git checkout -- models/{spec.name}` or retrain with `bench model train --model {spec.name}`")
    dest = f"${ENV_VAR}/{spec.hf_repo.split('/')[-1]}" if os.environ.get(ENV_VAR) else f"~/models/{spec.hf_repo.split('/')[-1]}"
    return (f"on a machine with network: `hf download {spec.hf_repo} --local-dir {dest}` "
            f"(about 32 GB), then pass `--model-path {dest}` or set {ENV_VAR} to its parent folder")


def resolve(name: str, model_path: str | os.PathLike | None = None) -> Path:
    """The folder holding `name`'s config.json and weights, or ModelNotFound."""
    spec = get(name)
    searched = candidates(spec, model_path)
    for how, folder in searched:
        if (folder / "config.json").is_file():
            return folder
    lines = "\n".join(f"  - {folder}  ({how})" for how, folder in searched)
    raise ModelNotFound(f"model {name!r} ({spec.hf_repo or 'embedded'}) was not found. Looked in:\n{lines}\n"
                        f"To get it: {fetch_hint(spec)}.")


def is_present(name: str, model_path: str | os.PathLike | None = None) -> bool:
    try:
        resolve(name, model_path)
        return True
    except ModelNotFound:
        return False


def config_facts(name: str, model_path: str | os.PathLike | None = None) -> dict:
    """The model's config.json: the checkpoint's own when present, else the shipped facts."""
    spec = get(name)
    try:
        return json.loads((resolve(name, model_path) / "config.json").read_text())
    except ModelNotFound:
        if spec.embedded:
            from bench.tiny.configs import TINY_CONFIGS, V3_KEYS_TO_KEEP

            cfg = TINY_CONFIGS[name]().to_dict()
            if cfg.get("model_type") == "deepseek_v3":
                cfg.update(V3_KEYS_TO_KEEP)
            return cfg
        return json.loads((FACTS_DIR / f"{name}.json").read_text())


ROUTING_KEYS = ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "vocab_size",
                "scoring_func", "topk_method")


def describe(name: str, model_path: str | os.PathLike | None = None) -> dict:
    spec = get(name)
    try:
        where: str | None = str(resolve(name, model_path))
    except ModelNotFound:
        where = None
    facts = config_facts(name, model_path)
    scoring = facts.get("scoring_func") or ("sigmoid" if facts.get("model_type") == "deepseek_v3" else "softmax")
    return {
        "name": spec.name, "hf_repo": spec.hf_repo, "architecture": spec.architecture,
        "description": spec.description, "present": where is not None, "path": where,
        "searched": [f"{folder} ({how})" for how, folder in candidates(spec, model_path)],
        "config": {k: (scoring if k == "scoring_func" else facts.get(k)) for k in ROUTING_KEYS},
    }
