"""Model registry: which models the suite knows, where each is looked for, and whether it is here.

Resolution order for a model (the first folder holding a config.json wins):
  1. `--model-path PATH` (a folder in Hugging Face format): when given, the only place looked in —
     a missing or empty folder is an error, never a fall-back to another copy;
  2. `$DRAFTEXPERT_MODELS/<name>` or `$DRAFTEXPERT_MODELS/<repo basename>` (e.g. `DeepSeek-V2-Lite`);
  3. the Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), read
     offline (`local_files_only`): nothing is ever downloaded;
  4. embedded models only: `models/<name>` in this repository.
A real model that is absent raises `ModelNotFound`, whose message lists every place searched
and the command that fetches the weights. The folder found must hold the model's architecture
(and, for the real models, the published checkpoint's dimensions): else `ModelMismatch` — a tiny
folder is not `ds`, an ml-tiny folder not `ds-tiny`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FACTS_DIR = Path(__file__).parents[1] / "model_facts"
EMBEDDED_DIR = REPO_ROOT / "models"
ENV_VAR = "DRAFTEXPERT_MODELS"
# Accept a checkpoint of a real model's architecture and routing structure at other dimensions
# (fewer layers, a small vocabulary: the shaped checkpoints the tests write). Never set by default:
# a user's wrong folder must still be refused.
SHAPED_ENV = "DRAFTEXPERT_ALLOW_SHAPED"
# What a shaped checkpoint must still share with the published one: how a token is routed.
SHAPED_KEYS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace")


def work_dir() -> Path:
    """Large local artifacts (corpus, token files, training state, real models' draft experts):
    `$DRAFTEXPERT_WORK`, else `work/` in this checkout (ignored by git)."""
    root = os.environ.get("DRAFTEXPERT_WORK")
    return Path(root).expanduser() if root else REPO_ROOT / "work"


def allow_shaped() -> bool:
    return os.environ.get(SHAPED_ENV, "") not in ("", "0")


class ModelNotFound(RuntimeError):
    """A registered model's weights are not on this machine."""


class UnknownModel(KeyError):
    pass


class ModelMismatch(ModelNotFound):
    """A folder holds a checkpoint, but not of the model asked for (another architecture or size)."""


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
        ModelSpec(
            "ds",
            "deepseek-ai/DeepSeek-V2-Lite",
            "DeepseekV2ForCausalLM",
            "DeepSeek-V2-Lite: 27 layers, 64 routed + 2 shared experts, top-6 softmax, MLA",
        ),
        ModelSpec(
            "ml",
            "moonshotai/Moonlight-16B-A3B",
            "DeepseekV3ForCausalLM",
            "Moonlight-16B-A3B: 27 layers, 64 routed + 2 shared experts, top-6 sigmoid + bias",
        ),
        ModelSpec(
            "ds-tiny",
            None,
            "DeepseekV2ForCausalLM",
            "embedded, trained here: ds's routing structure at small dims",
            embedded=True,
        ),
        ModelSpec(
            "ml-tiny",
            None,
            "DeepseekV3ForCausalLM",
            "embedded, trained here: ml's routing structure at small dims",
            embedded=True,
        ),
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
        return (
            f"the embedded weights are committed in models/{spec.name}; restore them with "
            f"`git checkout -- models/{spec.name}` or retrain with `bench model train --model {spec.name}`"
        )
    name = spec.hf_repo.split("/")[-1]
    dest = f"${ENV_VAR}/{name}" if os.environ.get(ENV_VAR) else f"~/models/{name}"
    return (
        f"on a machine with network: `hf download {spec.hf_repo} --local-dir {dest}` "
        f"(about 32 GB), then pass `--model-path {dest}` or set {ENV_VAR} to its parent folder"
    )


def resolve(name: str, model_path: str | os.PathLike | None = None) -> Path:
    """The folder holding `name`'s config.json and weights, or ModelNotFound. An explicit
    `model_path` is the only place looked in: missing, not a folder, or without config.json is an
    error, never a fall-back to another copy. Whatever folder is found must hold `name`'s
    architecture (`check_identity`), else ModelMismatch."""
    spec = get(name)
    if model_path:
        folder = Path(model_path).expanduser()
        problem = (
            "does not exist"
            if not folder.exists()
            else "is not a folder"
            if not folder.is_dir()
            else "is empty"
            if not any(folder.iterdir())
            else "has no config.json"
            if not (folder / "config.json").is_file()
            else None
        )
        if problem:
            raise ModelNotFound(
                f"--model-path {folder} {problem}: it must be a Hugging Face model folder "
                f"(config.json, tokenizer, *.safetensors) of {name!r}. To get it: {fetch_hint(spec)}."
            )
        check_identity(spec, folder)
        return folder
    searched = candidates(spec, model_path)
    for how, folder in searched:
        if (folder / "config.json").is_file():
            check_identity(spec, folder)
            return folder
    lines = "\n".join(f"  - {folder}  ({how})" for how, folder in searched)
    raise ModelNotFound(
        f"model {name!r} ({spec.hf_repo or 'embedded'}) was not found. Looked in:\n{lines}\n"
        f"To get it: {fetch_hint(spec)}."
    )


# What must match between a real model's shipped facts and a checkpoint claiming to be it.
IDENTITY_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "kv_lora_rank",
    "vocab_size",
)


def _architecture(cfg: dict) -> str | None:
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    return {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}.get(cfg.get("model_type"))


def identity_problem(spec: ModelSpec, cfg: dict) -> str | None:
    """Why a config is not `spec`'s model (None when it is): another architecture, or — for the
    real models — other dimensions than the shipped facts of the published checkpoint."""
    arch = _architecture(cfg)
    if arch != spec.architecture:
        return f"its architecture is {arch or 'not stated'}, {spec.name}'s is {spec.architecture}"
    if not spec.embedded:
        facts = json.loads((FACTS_DIR / f"{spec.name}.json").read_text())
        keys = SHAPED_KEYS if allow_shaped() else IDENTITY_KEYS
        diff = [f"{k} {cfg.get(k)} (not {facts[k]})" for k in keys if cfg.get(k) != facts.get(k)]
        if diff:
            return (
                f"it is not {spec.hf_repo}"
                + (" (nor shaped like it)" if allow_shaped() else "")
                + ": "
                + ", ".join(diff)
            )
    return None


def is_shaped(name: str, cfg: dict) -> bool:
    """A real model's checkpoint at other dimensions than the published one (accepted only under
    $DRAFTEXPERT_ALLOW_SHAPED)."""
    spec = get(name)
    if spec.embedded:
        return False
    facts = json.loads((FACTS_DIR / f"{spec.name}.json").read_text())
    return any(cfg.get(k) != facts.get(k) for k in IDENTITY_KEYS)


def matching_models(cfg: dict) -> list[str]:
    return [n for n, s in MODELS.items() if identity_problem(s, cfg) is None]


def check_identity(spec: ModelSpec, folder: Path) -> None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelMismatch(f"{folder}/config.json is not readable JSON ({e})") from None
    problem = identity_problem(spec, cfg)
    if problem:
        others = [n for n in matching_models(cfg) if n != spec.name]
        hint = f"; it matches --model {' / '.join(others)}" if others else ""
        raise ModelMismatch(f"the checkpoint in {folder} is not {spec.name!r}: {problem}{hint}")


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
    except ModelMismatch:
        raise
    except ModelNotFound:
        if model_path:
            raise
        if spec.embedded:
            # torch + transformers (~1.8 s): bench/cli.py imports this module, `bench --help` must start fast
            from bench.tiny.configs import TINY_CONFIGS, V3_KEYS_TO_KEEP  # noqa: PLC0415

            cfg = TINY_CONFIGS[name]().to_dict()
            if cfg.get("model_type") == "deepseek_v3":
                cfg.update(V3_KEYS_TO_KEEP)
            return cfg
        return json.loads((FACTS_DIR / f"{name}.json").read_text())


ROUTING_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "q_lora_rank",
    "kv_lora_rank",
    "vocab_size",
    "scoring_func",
    "topk_method",
)


def describe(name: str, model_path: str | os.PathLike | None = None) -> dict:
    """`name`'s row of `bench models`: where it is (when present), or where it was looked for and
    — when a folder there holds another model — why that folder is not it."""
    spec = get(name)
    where, note = None, None
    try:
        where = str(resolve(name, model_path))
    except ModelNotFound as e:
        note = str(e).splitlines()[0] if isinstance(e, ModelMismatch) else None
    facts = config_facts(name, model_path) if where else config_facts(name)
    scoring = facts.get("scoring_func") or ("sigmoid" if facts.get("model_type") == "deepseek_v3" else "softmax")
    return {
        "name": spec.name,
        "hf_repo": spec.hf_repo,
        "architecture": spec.architecture,
        "description": spec.description,
        "present": where is not None,
        "path": where,
        "not_it": note,
        "searched": [f"{folder} ({how})" for how, folder in candidates(spec, model_path)],
        "config": {k: (scoring if k == "scoring_func" else facts.get(k)) for k in ROUTING_KEYS},
    }
