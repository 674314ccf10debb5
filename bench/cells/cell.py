"""A cell: the whole description of one run, built once by every entry point and handed down whole.

A `Cell` says what is decoded (model, method and its `SpecOptions`), where (platform, engine),
and how the experts are held and moved (store and placement options). Its choices are checked
once, when it is built; the rules of which options apply to which cells are data (`RULES`) that
every entry point uses (the CLI only reports them); its defaults are the library's own
(`SpecConfig`). `bench.cells.decoders.make_decoder(cell, folder)` builds its decoder, and
`Cell.config(resolved)` the record key's configuration, so a new option touches this file and the
code that uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, get_args

from bench.runs.runner import CellConfig
from draftexpert.engines.llamacpp import STAGING as LLAMA_STAGING
from draftexpert.runtime.experts import STAGING as TORCH_STAGING
from draftexpert.runtime.ggml_kernel import KERNELS
from draftexpert.runtime.gguf_layout import TYPES
from draftexpert.runtime.loader import HEAD_TYPES
from draftexpert.speculation.config import BUDGET_MODES, CONTROLLERS, DRAFT_CACHES, SpecConfig
from draftexpert.speculation.controller import PRICING
from draftexpert.speculation.lookup import PLD_TOKENS, Lookup

Method = Literal["ar", "reference", "top-r", "draftexpert", "pld", "auto"]
Platform = Literal["mn", "cg", "resident"]
EngineName = Literal["torch", "llama.cpp"]
# The torch engine's compute dtype. Experts are held and moved in the checkpoint's dtype (bf16 for the real
# models) and converted on the accelerator after the copy; fp32 compute keeps speculation exact (a K-token
# verify pass and one-token steps round alike), bf16 compute is the paper's and faster on a GPU, but its
# batch-dependent rounding can flip a near-tie between a verify pass and the one-token step.
Dtype = Literal["fp32", "bf16"]
Device = Literal["cpu", "cuda"]

METHODS: tuple[str, ...] = get_args(Method)
PLATFORMS = {"mn": "flash", "cg": "host", "resident": "resident"}  # platform → expert store (torch engine)
ENGINES: tuple[str, ...] = get_args(EngineName)
DTYPES: tuple[str, ...] = get_args(Dtype)
SPEC_METHODS = ("top-r", "draftexpert", "pld", "auto")
# `--method auto`: the drafters a round chooses among by price, AR steps included (`DrafterChoice`)
AUTO_TOP_R = (1, 3)  # shared + top-r drafters beside DraftExpert (those below the target's top-k)
# … and which prefetch: DraftExpert its draft router's prediction (the paper's); top-r none, as the sweep's
# fixed top-r (a misprediction is a wasted load, and the price credits no overlap to make up for it)
AUTO_PREFETCHING = {"draftexpert"}
STAGINGS = {"torch": tuple(TORCH_STAGING), "llama.cpp": ("demand", "pagefault")}
EXPERT_KERNELS = ("auto", *KERNELS)


class CellError(ValueError):
    """A cell that cannot be run; the message names the option (as the CLI spells it)."""


def flag(name: str) -> str:
    """A cell field as the command line spells it (`k_max` → `--k-max`)."""
    return "--" + name.replace("_", "-")


def _choice(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise CellError(f"{flag(name)}: {value!r} is not one of {', '.join(map(str, allowed))}")


def keyed_round(conf: SpecConfig) -> dict:
    """The round's settings as a key holds them: the paper's controller (the default) left out, so cells
    measured before the cost controller keep their keys."""
    rnd = asdict(conf)
    if rnd["controller"] == "paper":
        del rnd["controller"]
    return rnd


@dataclass(frozen=True)
class SpecOptions:
    """A speculative method's options: the drafter's (`r` routed experts for top-r; the
    `draft_experts` checkpoint for DraftExpert — default the model's distilled `full` preset, else
    zero) and the round's (`SpecConfig`)."""

    r: int = 1
    draft_experts: Path | None = None
    pld_tokens: int = PLD_TOKENS  # prompt lookup: tokens proposed at most (its round's K_max)
    pld_max_ngram: int = Lookup.max_ngram  # prompt lookup: the longest suffix looked up (then down to 1)
    round: SpecConfig = field(default_factory=SpecConfig)

    def with_(self, **overrides) -> SpecOptions:
        """The same options with some changed; a key is the drafter's or a `SpecConfig` field."""
        own = {k: overrides.pop(k) for k in DRAFTER_FIELDS if k in overrides}
        unknown = set(overrides) - ROUND_FIELDS
        if unknown:
            raise CellError(f"unknown speculation option(s): {', '.join(sorted(unknown))}")
        for name, allowed in (
            ("budget_mode", BUDGET_MODES),
            ("draft_cache", DRAFT_CACHES),
            ("controller", CONTROLLERS),
        ):
            if name in overrides:
                _choice(name, overrides[name], allowed)
        counts = (("k_max", overrides.get("k_max", 1)), *((k, v) for k, v in own.items() if k != "draft_experts"))
        for name, value in counts:
            if value < 1:
                raise CellError(f"{flag(name)} is at least 1, not {value}")
        return replace(self, **own, round=replace(self.round, **overrides))

    def as_dict(self) -> dict:
        rnd = keyed_round(self.round)
        return {
            "r": self.r,
            "draft_experts": str(self.draft_experts) if self.draft_experts else None,
            **rnd,
        }

    def lookup(self) -> Lookup:
        """Prompt lookup's settings (`--method pld`)."""
        return Lookup(max_ngram=self.pld_max_ngram)


ROUND_FIELDS = {f.name for f in fields(SpecConfig)} - {"temperature", "seed"}  # sampling is the cell's own
DRAFTER_FIELDS = ("r", "draft_experts", "pld_tokens", "pld_max_ngram")
SPEC_FIELDS = {*DRAFTER_FIELDS, *ROUND_FIELDS}


@dataclass(frozen=True)
class Resolved:
    """What building a cell's decoder decided on this machine and these weights (recorded in its key)."""

    device: str | None = None  # torch engine: where it computes
    kernel: str = "dequant"  # torch engine: how Q4_0 experts are computed (`ggml_kernel.resolve_kernel`)
    working_set: int = 0  # torch engine: the bound a round keeps on the accelerator (asked for or planned)
    draft_experts: dict | None = None  # DraftExpert: the draft experts' card (file, preset, sha256, steps)
    threads: int = 1  # llama.cpp: its threads
    weights: str = ""  # the checkpoint's fingerprint
    top_k: int = 0  # the target's routed experts per token (`--method auto`: which top-r drafters exist)
    calibration: dict | None = None  # the cost controller's prior: the profile's hash, date and rows


@dataclass(frozen=True)
class Cell:
    """One run: model × method × platform × engine × store and placement × speculation options."""

    model: str = "ds-tiny"
    method: Method = "ar"
    platform: Platform = "mn"
    engine: EngineName = "torch"
    expert_type: str = "q4_0"  # mn: the expert file's type (gguf_experts.TYPES)
    max_new_tokens: int = 64
    temperature: float = SpecConfig.temperature
    seed: int = SpecConfig.seed
    # how experts are held and moved
    cache_experts: int = 0  # experts kept on the accelerator between forwards (0: the paper's cold setting)
    staging_budget: int = 0  # mn: bytes of raw experts kept staged in DRAM between steps
    staging: str = "demand"  # mn: how experts come from storage (STAGINGS per engine)
    read_bw: int | None = None  # mn: the storage's read cap, bytes/s (`bench.runs.readcap`)
    resident_from_file: bool = False  # resident: hold the expert file's experts (the same model as mn's)
    # torch engine: placement and numerics
    device: Device | None = None  # cg: cuda (default) | cpu; resident: cpu (default) | cuda
    dtype: Dtype = "fp32"
    working_set: int = 0  # bytes a round may keep on the accelerator (cg / mn; 0: unbounded)
    expert_kernel: str = "auto"  # EXPERT_KERNELS
    head_type: str = "checkpoint"  # loader.HEAD_TYPES
    compile: bool = False
    calibration: Path | None = None  # a `bench plan --speculation` profile: the cost controller's acceptance prior
    spec: SpecOptions = field(default_factory=SpecOptions)

    def __post_init__(self):
        for name, allowed in (
            ("method", METHODS),
            ("platform", PLATFORMS),
            ("engine", ENGINES),
            ("expert_type", TYPES),
            ("dtype", DTYPES),
            ("expert_kernel", EXPERT_KERNELS),
            ("head_type", HEAD_TYPES),
            ("device", (None, *get_args(Device))),
        ):
            _choice(name, getattr(self, name), allowed)
        if self.method == "reference":
            return
        if self.calibration is not None and not self.priced:
            raise CellError(
                "--calibration: a calibration is the cost controller's prior; it applies to --method auto and "
                "--controller cost (top-r / draftexpert)"
            )
        _choice("staging", self.staging, STAGINGS[self.engine])
        if self.engine == "llama.cpp":
            if self.method not in ("ar", *SPEC_METHODS):
                raise CellError(
                    f"--method {self.method} does not run on the llama.cpp engine (ar, top-r, draftexpert, pld do)"
                )
            if self.platform not in ("mn", "resident"):
                raise CellError(
                    f"--platform: the llama.cpp engine runs mn (experts from storage) or resident, not {self.platform}"
                )
            if self.temperature > 0:
                raise CellError("--temperature: the llama.cpp engine decodes greedily; use the torch engine to sample")
            if self.compile:
                raise CellError("--compile applies to the torch engine only")
            torch_only = [
                flag(n)
                for n in ("device", "dtype", "working_set", "expert_kernel", "head_type")
                if getattr(self, n) != CELL_DEFAULTS[n]
            ]
            if torch_only:
                raise CellError(
                    f"{' / '.join(torch_only)} apply to the torch engine (llama.cpp runs the model file's "
                    "types and stages through the page cache)"
                )
        if self.working_set and self.platform == "resident":
            raise CellError("--working-set bounds what a round moves to the accelerator: platforms cg and mn")
        if self.read_bw is not None and self.platform != "mn":
            raise CellError(f"--read-bw: platform {self.platform} reads nothing from storage")

    # -- derived names -----------------------------------------------------------------

    @property
    def label(self) -> str:
        """The method as tables name it: top-r with its r."""
        return f"top-{self.spec.r}" if self.method == "top-r" else self.method

    @property
    def engine_tag(self) -> str:
        """The suffix of a run folder's name on the llama.cpp engine."""
        return "-llama.cpp" if self.engine == "llama.cpp" else ""

    @property
    def speculative(self) -> bool:
        return self.method in SPEC_METHODS

    @property
    def priced(self) -> bool:
        """Whether the cost controller prices its rounds (`--method auto`, `--controller cost`)."""
        return self.method == "auto" or (
            self.method in ("top-r", "draftexpert") and self.spec.round.controller == "cost"
        )

    @property
    def positions(self) -> int:
        """The positions one round adds to the KV cache at most."""
        return self.spec.round.positions if self.speculative else 1

    @property
    def store(self) -> str:
        """The torch engine's expert store."""
        return "resident" if self.method == "reference" else PLATFORMS[self.platform]

    @property
    def from_file(self) -> bool:
        """The torch engine computes the expert file's experts (mn; resident held from the file)."""
        return self.store == "flash" or (self.store == "resident" and self.resident_from_file)

    def run_dir(self, root: Path, prefix: str = "") -> Path:
        """The default run folder under `root`/runs (`prefix`: e.g. `eval-`)."""
        where = "resident" if self.method == "reference" else self.platform
        return Path(root) / "runs" / f"{prefix}{self.model}-{self.label}-{where}{self.engine_tag}"

    def with_(self, **overrides) -> Cell:
        """The same cell with some fields changed; a speculation option's key changes `spec`."""
        spec = {k: overrides.pop(k) for k in list(overrides) if k in SPEC_FIELDS}
        unknown = set(overrides) - CELL_FIELDS
        if unknown:
            raise CellError(f"unknown cell option(s): {', '.join(sorted(unknown))}")
        return replace(self, **overrides, spec=self.spec.with_(**spec) if spec else self.spec)

    # -- what a record's key holds -----------------------------------------------------------

    def round_config(self) -> SpecConfig:
        """The round's settings as the decoder runs them (sampling is the cell's)."""
        conf = replace(self.spec.round, temperature=self.temperature, seed=self.seed)
        if self.method == "auto":  # every round priced: the cost controller's stop rule
            conf = replace(conf, controller="cost")
        if self.method == "pld":  # no draft forward: nothing to truncate on, nothing predicted to prefetch
            conf = replace(conf, k_max=self.spec.pld_tokens, truncate=False, prefetch=False)
        return replace(conf, draft_cache="shared") if self.engine == "llama.cpp" else conf  # its own context

    def method_args(self, resolved: Resolved = Resolved()) -> dict:
        """Everything besides model, method, platform, engine and sampling that changes what the cell
        measures (hashed into its key). An option is recorded only where it applies, and the newer
        options only off their defaults, so a cell's key stays what it was before they existed."""
        if self.method == "reference":
            return {}
        spec = self.spec
        round_args = {k: v for k, v in keyed_round(self.round_config()).items() if k in ROUND_FIELDS}
        if self.engine == "llama.cpp":
            args = {
                "expert_type": self.expert_type,
                "threads": resolved.threads,
                "kv_type": "f32" if self.expert_type == "f32" else "f16",  # an f32 model keeps an f32 cache
                "staging": LLAMA_STAGING["resident" if self.platform == "resident" else self.staging],
            }
            if self.staging_budget and self.platform != "resident":
                args["staging_budget"] = self.staging_budget
            if self.method == "top-r":
                args["r"] = spec.r
            elif self.method in ("draftexpert", "auto"):
                args["draft_experts"] = resolved.draft_experts
            if self.method == "auto":
                args["drafters"] = self.auto_drafters(resolved)
                args["prefetching"] = sorted(AUTO_PREFETCHING)
            if self.method == "pld":
                args.update(self._pld_args())
            elif self.speculative:
                args.update({k: v for k, v in round_args.items() if k != "draft_cache"})
        else:
            args = {"store": self.store, "device": resolved.device, "cache_experts": self.cache_experts}
            if self.dtype != "fp32":
                args["dtype"] = self.dtype
            if resolved.working_set:
                args["working_set"] = resolved.working_set
            if self.store == "resident" and self.from_file:
                args["expert_type"] = self.expert_type
            if resolved.kernel != "dequant":
                args["expert_kernel"] = resolved.kernel
            if self.head_type != "checkpoint":
                args["head_type"] = self.head_type
            if self.compile:
                args["compiled"] = True
            if self.store == "flash":
                args.update(
                    expert_type=self.expert_type,
                    staging_budget=self.staging_budget,
                    staging=TORCH_STAGING[self.staging],
                )
            if self.method == "pld":
                args.update(self._pld_args())
            elif self.speculative:
                args.update(round_args)
                if self.method == "top-r":
                    args["r"] = spec.r
                else:
                    args["draft_experts"] = resolved.draft_experts
                if self.method == "auto":
                    args["drafters"] = self.auto_drafters(resolved)
                    args["prefetching"] = sorted(AUTO_PREFETCHING)
        if self.read_bw:
            args["read_bw"] = self.read_bw  # a capped cell is another cell
        if self.priced:
            args["pricing"] = PRICING  # another revision of the prices is another cell, never resumed
        if resolved.calibration:
            args["calibration"] = resolved.calibration  # the controller's prior: its profile's hash and rows
        return args

    def auto_drafters(self, resolved: Resolved = Resolved()) -> list[str]:
        """`--method auto`'s drafters, as its records name them (`resolved.top_k`: the target's)."""
        return ["draftexpert", *(f"top-{r}" for r in AUTO_TOP_R if not resolved.top_k or r < resolved.top_k)]

    def _pld_args(self) -> dict:
        s = self.spec
        return {"drafter": "prompt lookup", "pld_tokens": s.pld_tokens, "pld_max_ngram": s.pld_max_ngram}

    def config(self, resolved: Resolved = Resolved()) -> CellConfig:
        """The configuration a record's key is hashed from."""
        if self.method == "reference":
            return CellConfig(
                model=self.model,
                method=self.method,
                weights=resolved.weights,
                platform="resident",
                max_new_tokens=self.max_new_tokens,
            )
        return CellConfig(
            model=self.model,
            method=self.method,
            weights=resolved.weights,
            platform=self.platform,
            engine=self.engine,
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if self.engine == "llama.cpp" else self.temperature,
            seed=0 if self.engine == "llama.cpp" else self.seed,
            method_args=self.method_args(resolved),
        )

    def check(self, given: Iterable[str]) -> list[str]:
        """The options in `given` (cell fields a user set) that do not apply to this cell: raises
        CellError for those that would be silently ignored, returns warnings for those that cannot
        change the result."""
        given, warnings = set(given), []
        for rule in RULES:
            hit = [n for n in rule.flags if n in given]
            if not hit or not rule.when(self):
                continue
            names = ", ".join(flag(n) for n in hit)
            msg = f"{names} {'does' if len(hit) == 1 else 'do'} not apply {rule.why(self)}"
            if not rule.warn:
                raise CellError(msg)
            warnings.append(f"{msg}; ignored")
        return warnings


CELL_FIELDS = {f.name for f in fields(Cell)} - {"spec"}
CELL_DEFAULTS = {f.name: f.default for f in fields(Cell) if f.name != "spec"}


@dataclass(frozen=True)
class Rule:
    """Options that do not apply to the cells `when` selects, and why; `warn`: the option cannot change
    the result (warned about and ignored) rather than being silently dropped (refused)."""

    flags: tuple[str, ...]
    when: Callable[[Cell], bool]
    why: Callable[[Cell], str]
    warn: bool = False


SPEC_FLAGS = (
    "r", "k_max", "tau", "budget", "budget_mode", "truncate", "prefetch", "draft_cache", "draft_experts", "controller",
)  # fmt: skip
PLD_FLAGS = ("pld_tokens", "pld_max_ngram")
_offload = lambda c: c.method != "reference"  # noqa: E731 - the reference runs none of the offload options
REFERENCE_WHY = "to --method reference (transformers' greedy decoding, every weight resident)"
NO_STORAGE = "(nothing is read from storage)"
RULES: tuple[Rule, ...] = (
    Rule(
        SPEC_FLAGS, lambda c: not c.speculative, lambda c: f"to --method {c.method} (they set the speculative methods)"
    ),
    Rule(
        tuple(f for f in SPEC_FLAGS if f != "draft_cache"),
        lambda c: c.method == "pld",
        lambda c: "to --method pld (prompt lookup drafts with no model: --pld-tokens and --pld-max-ngram set it)",
    ),
    Rule(PLD_FLAGS, lambda c: c.method != "pld", lambda c: f"to --method {c.method} (they set --method pld)"),
    Rule(
        ("draft_experts",),
        lambda c: c.method == "top-r",
        lambda c: "to --method top-r (its drafter is the target's own top-r experts)",
    ),
    Rule(
        ("r", "controller"),
        lambda c: c.method == "auto",
        lambda c: (
            "to --method auto (it prices every round with the cost controller, over DraftExpert and "
            f"shared + top-{'/'.join(map(str, AUTO_TOP_R))})"
        ),
    ),
    Rule(
        ("r",),
        lambda c: c.method == "draftexpert",
        lambda c: "to --method draftexpert (its drafter is shared + top-1 + the draft expert)",
    ),
    Rule(
        ("temperature", "engine", "read_bw", "compile", "device", "dtype", "working_set", "expert_kernel", "head_type"),
        lambda c: c.method == "reference",
        lambda c: REFERENCE_WHY,
    ),
    Rule(
        ("platform", "expert_type", "cache_experts", "staging_budget", "staging", "seed"),
        lambda c: c.method == "reference",
        lambda c: REFERENCE_WHY,
        warn=True,
    ),
    Rule(
        ("device",),
        lambda c: _offload(c) and c.platform == "mn",
        lambda c: (
            f"to --platform {c.platform} (it runs on the CPU here; cg is the GPU platform, resident takes "
            "--device cuda as its upper bound)"
        ),
    ),
    Rule(
        ("dtype", "expert_kernel", "head_type"),
        lambda c: _offload(c) and c.engine == "llama.cpp",
        lambda c: "to --engine llama.cpp (it computes in the model file's types)",
    ),
    Rule(
        ("read_bw",), lambda c: _offload(c) and c.platform != "mn", lambda c: f"to --platform {c.platform} {NO_STORAGE}"
    ),
    Rule(
        ("staging_budget",),
        lambda c: _offload(c) and c.platform != "mn",
        lambda c: f"to --platform {c.platform} {NO_STORAGE}",
        warn=True,
    ),
    Rule(
        ("expert_type",),
        lambda c: _offload(c) and (c.platform == "cg" or (c.platform == "resident" and c.engine == "torch")),
        lambda c: f"to --platform {c.platform} on the torch engine (the checkpoint's weights are used as they are)",
        warn=True,
    ),
    Rule(
        ("cache_experts",),
        lambda c: _offload(c) and c.platform == "resident",
        lambda c: "to --platform resident (every expert is already on the accelerator)",
        warn=True,
    ),
    Rule(
        ("working_set",),
        lambda c: _offload(c) and c.platform == "resident",
        lambda c: "to --platform resident (nothing is moved)",
    ),
)


def build(given: Iterable[str] = (), **options) -> tuple[Cell, list[str]]:
    """A cell from flat options (a cell field, or a speculation option: r, k_max, tau, …), checked
    against `RULES` for the options in `given`: (cell, warnings). Options the rules refuse for this
    cell are dropped before it is built, so that e.g. `--device` on mn is named, not mistaken for a
    placement; CellError for a bad value or a refused option."""
    spec = {k: options.pop(k) for k in list(options) if k in SPEC_FIELDS}
    unknown = set(options) - CELL_FIELDS
    if unknown:
        raise CellError(f"unknown cell option(s): {', '.join(sorted(unknown))}")
    probe = Cell(**{k: options[k] for k in ("model", "method", "platform", "engine") if k in options})
    probe = replace(probe, spec=SpecOptions().with_(**spec))
    warnings = probe.check(given)  # before the values are checked together: a flag that does not apply is named
    if probe.method == "reference":  # options that cannot change the reference are ignored (warned about above)
        options = {k: v for k, v in options.items() if k in ("model", "method", "max_new_tokens")}
    elif probe.platform == "resident":
        options = {k: v for k, v in options.items() if k not in ("cache_experts", "staging_budget")}
    elif probe.platform == "cg":
        options = {k: v for k, v in options.items() if k != "staging_budget"}
    return Cell(**options, spec=SpecOptions().with_(**spec)), warnings
